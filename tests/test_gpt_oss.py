"""gpt-oss (GptOssForCausalLM) on a tiny random-weight model built with transformers' own class, the oracle (eager
attention, eager experts): four layers, sliding (window 12) and full in turn, learned sink logits, a biased router
taking the top 2 of 4 experts then a softmax, biased experts with the clamped SwiGLU, YaRN rotary.

The config and weights load as transformers holds them (the experts' interleaved gate/up columns de-interleaved);
prefill, chunked prefill and paged decode over prompts longer than the window equal transformers' logits, and the
sink logits, the windows and YaRN each change them (so the match depends on all three); the engine, with its
sliding and full KV groups, gives transformers' greedy tokens and logprobs within 1e-4 through chunk boundaries and
a prefix-cache hit, its sliding tables bounded by the window."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_model_tiny import PagedDriver, _engine_generate, assert_close, hf_greedy  # noqa: E402
from tiny_llama import VOCAB, Tiny, _tokens, redraw_weights  # noqa: E402

from petrel import LLM, SamplingParams  # noqa: E402
from petrel.engine.block_manager import held_blocks  # noqa: E402
from petrel.engine.engine_core import EngineCore  # noqa: E402
from petrel.engine.llm_engine import EngineConfig  # noqa: E402
from petrel.engine.sequence import EngineRequest  # noqa: E402
from petrel.model import dense_kernels, moe_kernels  # noqa: E402
from petrel.model.config import ModelConfig  # noqa: E402
from petrel.model.gpt_oss import GptOssForCausalLM  # noqa: E402
from petrel.model.loader import load_model, resolve_model  # noqa: E402

W, BS = 12, 4  # the sliding layers' window; KV block size
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 64,
    "rope_theta": 150000.0,
}
GPT_OSS = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=W,
    max_position_embeddings=256,
    rope_parameters=YARN,
    bos_token_id=1,
    eos_token_id=2,
)


def build_hf(seed: int = 0, **overrides) -> torch.nn.Module:
    config = transformers.GptOssConfig(**{**GPT_OSS, **overrides})
    config._attn_implementation = "eager"  # a reference independent of petrel's attention
    config._experts_implementation = "eager"  # the experts' plain loop
    torch.manual_seed(seed)
    hf = transformers.GptOssForCausalLM(config)
    redraw_weights(hf, seed)
    with torch.no_grad():  # logits 4x wider than redraw_weights' (~N(0, 1)): no near-ties among greedy choices
        hf.lm_head.weight.mul_(4.0)
        for layer in hf.model.layers:  # sinks comparable to the scores (N(0, 2)): each head's weight on them matters
            layer.self_attn.sinks.mul_(4.0)
    return hf.float().eval()


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> Tiny:
    hf = build_hf()
    path = tmp_path_factory.mktemp("gpt-oss")
    hf.save_pretrained(path, safe_serialization=True)
    model, cfg = load_model(resolve_model(str(path)), torch.float32, "cpu")
    return Tiny(hf, model, cfg, str(path))


def _dense(weight) -> torch.Tensor:
    return weight if isinstance(weight, torch.Tensor) else weight.dequantize()


def test_config_and_weights_load_as_transformers_holds_them(gpt_oss):
    cfg, model, hf = gpt_oss.cfg, gpt_oss.model, gpt_oss.hf
    assert isinstance(model, GptOssForCausalLM)
    assert cfg.sliding_windows == [W, None, W, None] and cfg.sink_logits and cfg.attention_bias
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 32)
    assert cfg.router_bias and cfg.routing == "topk_softmax" and cfg.expert_bias
    assert (cfg.expert_activation, cfg.swiglu_alpha, cfg.swiglu_limit) == ("swiglu_clamped", 1.702, 7.0)
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_theta == 150000.0
    for layer, ref in zip(model.model.layers, hf.model.layers):
        torch.testing.assert_close(layer.self_attn.sink_logits, ref.self_attn.sinks, atol=0, rtol=0)
        torch.testing.assert_close(layer.mlp.gate.bias, ref.mlp.router.bias, atol=0, rtol=0)
        experts, ref_experts = layer.mlp.experts, ref.mlp.experts
        for e in range(4):
            gate_up, down = (_dense(w) for w in experts.expert_weights(e))
            interleaved = ref_experts.gate_up_proj[e].t()  # [2I, H]: gate 0, up 0, gate 1, ...
            torch.testing.assert_close(gate_up[:32], interleaved[0::2], atol=0, rtol=0)
            torch.testing.assert_close(gate_up[32:], interleaved[1::2], atol=0, rtol=0)
            torch.testing.assert_close(down, ref_experts.down_proj[e].t(), atol=0, rtol=0)
            bias = ref_experts.gate_up_proj_bias[e]
            torch.testing.assert_close(experts.gate_up_bias[e], torch.cat([bias[0::2], bias[1::2]]), atol=0, rtol=0)
            torch.testing.assert_close(experts.down_bias[e], ref_experts.down_proj_bias[e], atol=0, rtol=0)
    bad = {**hf.config.to_dict(), "architectures": ["GptOssForCausalLM"], "hidden_act": "gelu"}
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf_config(bad)


def test_prefill_chunks_and_decode_match_transformers(gpt_oss):
    """Prompts longer than the window, whole and in chunks, then decoded step by step beside another sequence."""
    tokens = _tokens(30, 1)
    ref = gpt_oss.hf_logits(tokens)
    drv = PagedDriver(gpt_oss, block_size=BS)
    assert_close(drv.run_chunks(drv.new_seq(tokens), [30]), ref, "one shot")
    for chunks in ([7, 9, 1, 13], [13, 17]):
        drv = PagedDriver(gpt_oss, block_size=BS, seed=3)
        assert_close(drv.run_chunks(drv.new_seq(tokens), chunks), ref, f"chunks {chunks}")
    other = _tokens(17, 2)
    got_a, got_b = PagedDriver(gpt_oss, block_size=BS, seed=1).decode_side_by_side(tokens, other)
    assert_close(got_a, ref, "step-by-step decode")
    assert_close(got_b, gpt_oss.hf_logits(other), "decode next to another sequence")


def test_sinks_windows_and_yarn_each_change_the_logits(gpt_oss):
    """The oracle's match means something: without the sink logits, without the windows, or with plain rotary
    petrel's logits move far from transformers'."""
    tokens = _tokens(30, 1)
    ref = gpt_oss.hf_logits(tokens)

    def logits(model) -> torch.Tensor:
        drv = PagedDriver(Tiny(gpt_oss.hf, model, gpt_oss.cfg, gpt_oss.path), block_size=BS)
        return drv.run_chunks(drv.new_seq(tokens), [30])

    no_sinks, no_windows, plain_rotary = (copy.deepcopy(gpt_oss.model) for _ in range(3))
    for layer in no_sinks.model.layers:
        layer.self_attn.sink_logits.data.fill_(float("-inf"))  # weight 0: a softmax over the keys alone
    for layer in no_windows.model.layers:
        layer.self_attn.sliding_window = None
    cfg = copy.deepcopy(gpt_oss.cfg)
    cfg.rope_scaling = None
    plain_rotary.model.rotary = type(gpt_oss.model.model.rotary)(cfg.head_dim, 256, cfg.rope_theta, None)
    for what, model in (("sinks", no_sinks), ("windows", no_windows), ("yarn", plain_rotary)):
        assert (logits(model) - ref).abs().max() > 0.05, what


def _core(t: Tiny, num_blocks: int = 200, **engine_kwargs) -> EngineCore:
    from petrel.engine.model_runner import kv_bytes_per_block

    per_block = kv_bytes_per_block(t.cfg, BS, torch.float32, layers_per_block=2)
    config = EngineConfig(
        dtype="float32", device="cpu", block_size=BS, kv_cache_memory=num_blocks * per_block, **engine_kwargs
    )
    return EngineCore(config, t.model, t.cfg)


def test_engine_with_sliding_and_full_kv_groups_matches_transformers(gpt_oss):
    """A long prompt, then (once it has finished) the same prompt and one sharing its first 24 tokens: chunked by a
    16-token budget, served from the prefix cache as far as both groups hold what they read; the sliding group's
    tables stay within the window while the full group's hold every block."""
    core = _core(gpt_oss, max_num_batched_tokens=16)
    assert core.block_manager.windows == [None, W] and core.runner.kv_groups.layers == ((1, 3), (0, 2))
    prompt = _tokens(34, 5)
    shared = prompt[:24] + _tokens(7, 6)
    waves = [{"cold": prompt}, {"same": prompt, "shared": shared}]
    got, most_held = {}, [0, 0]
    for wave in waves:
        for rid, p in wave.items():
            params = SamplingParams(temperature=0.0, max_tokens=16)
            core.add_request(EngineRequest(rid, list(p), params, eos_token_ids=tuple(gpt_oss.cfg.eos_token_ids)))
        for _ in range(500):
            if not core.has_work:
                break
            for out in core.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
            core.block_manager.check_integrity()
            for s in core.scheduler.running:
                held = [len(held_blocks(table)) for table in s.block_tables]
                most_held = [max(a, b) for a, b in zip(most_held, held)]
        assert not core.has_work
    assert core.scheduler.prefix_hit_tokens >= 24 + 20
    assert most_held[1] <= -(-W // BS) + 2 < -(-(34 + 14) // BS) <= most_held[0]
    for rid, p in (("cold", prompt), ("same", prompt), ("shared", shared)):
        assert got[rid] == hf_greedy(gpt_oss, p, 16), rid


def test_logprobs_match_transformers_across_a_prefix_hit(gpt_oss, tokenizer_dir):
    """Prompt and output logprobs within 1e-4 of transformers' (float32), every prompt chunked at 16 tokens; then
    the output logprobs of a prompt continuing a cached prefix longer than the window (prompt logprobs would
    recompute the prompt)."""
    first = _tokens(29, 8)
    second = first[:20] + _tokens(9, 9)
    llm = LLM(gpt_oss.path, tokenizer=tokenizer_dir, kv_cache_memory=1 << 20, block_size=BS, max_num_batched_tokens=16)
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1, prompt_logprobs=1)
        outs = [llm.generate([first], params, use_tqdm=False)[0]]
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
        outs.append(llm.generate([second], params, use_tqdm=False)[0])
    finally:
        llm.shutdown()
    assert outs[1].num_cached_tokens >= 16
    for p, out in zip((first, second), outs):
        tokens = out.outputs[0].token_ids
        ref = torch.log_softmax(gpt_oss.hf_logits(p + tokens), dim=-1)
        assert tokens == ref[len(p) - 1 : -1].argmax(-1).tolist()
        for i, (tok, entry) in enumerate(zip(tokens, out.outputs[0].logprobs)):
            assert entry[tok].logprob == pytest.approx(ref[len(p) - 1 + i, tok].item(), abs=1e-4)
    ref = torch.log_softmax(gpt_oss.hf_logits(first), dim=-1)
    for pos in range(1, len(first)):
        assert outs[0].prompt_logprobs[pos][first[pos]].logprob == pytest.approx(
            ref[pos - 1, first[pos]].item(), abs=1e-4
        )


def test_every_path_gives_transformers_tokens(gpt_oss, monkeypatch):
    """Every step as one kernel call for the whole stack (dense_kernels.decode_layers: the windowed and the full
    layers' KV groups, the q/k/v and o biases, the sink logits, and moe.c's router bias, top-k-then-softmax, biased
    experts and clamped SwiGLU); a layer at a time (decode_layer, the stack off); and everything in torch
    (PETREL_MOE_KERNEL=0): transformers' tokens every way; spies show which ran."""
    prompts = [_tokens(21, 61), _tokens(30, 60)]
    expected = [hf_greedy(gpt_oss, p, 12) for p in prompts]
    stack_calls, layer_calls, kernel_calls = [], [], []
    stack, decode_layer, experts = dense_kernels.DecoderStack.__call__, dense_kernels.decode_layer, moe_kernels.experts
    monkeypatch.setattr(dense_kernels.DecoderStack, "__call__", lambda *a: stack_calls.append(out := stack(*a)) or out)
    monkeypatch.setattr(dense_kernels, "decode_layer", lambda *a: layer_calls.append(out := decode_layer(*a)) or out)
    monkeypatch.setattr(moe_kernels, "experts", lambda *a: kernel_calls.append(out := experts(*a)) or out)
    for path in ("stack", "layers", "torch"):
        monkeypatch.setenv("PETREL_MOE_KERNEL", "0" if path == "torch" else "1")
        if path == "layers":
            monkeypatch.setattr(GptOssForCausalLM, "_step_in_one_call", lambda *a: None)
        stack_calls.clear(), layer_calls.clear(), kernel_calls.clear()
        results, _ = _engine_generate(gpt_oss, prompts, 12, block_size=BS, max_num_batched_tokens=16)
        assert [results[f"req{i}"] for i in range(len(prompts))] == expected, path
        if path == "stack":
            assert stack_calls and all(c is not None for c in stack_calls) and not layer_calls
        elif path == "layers":
            assert not stack_calls and layer_calls and all(c is not None for c in layer_calls)
            assert kernel_calls and all(c is not None for c in kernel_calls)
        else:
            assert not layer_calls and kernel_calls and not any(c is not None for c in kernel_calls)
