"""DeepSeek-V2 / V3 on tiny random-weight models built with transformers' own classes, the oracle (transformers caches
the expanded keys and values, petrel the latent: outputs are compared, not caches): configs load; prompt steps
(decompressed keys and values) and decode steps (absorbed, over the latent cache alone) equal transformers' logits;
the engine's greedy tokens equal `generate` through a prefix-cache hit, chunked prefill and preemption; logprobs
within 1e-4; the router and YaRN against transformers' own functions; FP8 block checkpoints; refusals by name."""

from __future__ import annotations

import copy
import json
import os
import re
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_model_tiny import PagedDriver, _engine_generate, assert_close, hf_greedy  # noqa: E402
from tiny_deepseek import FAMILY_IDS, build_hf, deepseek_factory  # noqa: E402
from tiny_llama import _tokens  # noqa: E402

from petrel import LLM, SamplingParams  # noqa: E402
from petrel.engine.model_runner import kv_bytes_per_block  # noqa: E402
from petrel.model.deepseek import DeepseekForCausalLM, DeepseekMoE, DeepseekRouter  # noqa: E402
from petrel.model.kv_layout import kv_layout_of  # noqa: E402
from petrel.model.loader import load_model, resolve_model  # noqa: E402
from petrel.model.mla import MLAttention  # noqa: E402
from petrel.model.quantization import quantize_int8  # noqa: E402


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return deepseek_factory(tmp_path_factory)


# ---------------------------------------------------------------- configs and the latent cache


def test_configs_structure_and_the_latent_cache_layout(deepseek):
    v2, grouped, v3 = (deepseek(n).cfg for n in FAMILY_IDS)
    for cfg in (v2, grouped, v3):
        assert (cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (32, 16, 8, 16)
        assert cfg.dense_layers == [0] and cfg.num_experts == 8 and cfg.rope_interleave
    assert v2.q_lora_rank == 0 and v2.shared_expert_intermediate_size == 64 and v2.topk_method == "greedy"
    assert (grouped.topk_method, grouped.n_group, grouped.topk_group, grouped.routed_scaling_factor) == (
        "group_limited_greedy",
        2,
        1,
        2.0,
    )
    assert (v3.scoring_func, v3.topk_method, v3.routed_scaling_factor, v3.norm_topk_prob) == (
        "sigmoid",
        "noaux_tc",
        2.5,
        True,
    )
    assert v3.rope_scaling["rope_type"] == "yarn" and v3.q_lora_rank == 32
    for name in FAMILY_IDS:
        t = deepseek(name)
        assert isinstance(t.model, DeepseekForCausalLM)
        sparse = [isinstance(layer.mlp, DeepseekMoE) for layer in t.model.model.layers]
        assert sparse == [hasattr(layer.mlp, "experts") for layer in t.hf.model.layers] == [False, True, True]
        torch.testing.assert_close(
            t.model.model.layers[1].self_attn.scale, t.hf.model.layers[1].self_attn.scaling, atol=1e-7, rtol=0
        )
    # the cache holds the latent and the rotary key once a token: 32 + 8 values a layer, not 2 x 4 heads x 24
    layout = kv_layout_of(v3)
    assert (layout.kind, layout.planes, layout.heads, layout.width) == ("latent", 1, 1, 40)
    assert kv_bytes_per_block(v3, 4, torch.float32) == 3 * 4 * 40 * 4
    drv = PagedDriver(deepseek("deepseek_v3"), num_blocks=8)
    assert [tuple(c.shape) for c in drv.runner.kv_caches] == [(1, 8, 4, 1, 40)] * 3


# ---------------------------------------------------------------- logits against transformers


@pytest.mark.parametrize("prefill", ["decompressed", "absorbed"])
@pytest.mark.parametrize("path", ["stack", "kernel", "torch"])
@pytest.mark.parametrize("name", FAMILY_IDS)
def test_prefill_and_decode_match_transformers(deepseek, name, path, prefill, monkeypatch):
    """Three prompts prefilled in one step; then two sequences decoded side by side (absorbed over the latent
    cache: every layer in one call, latent_layers.c; the layers' modules with latent_attention.c's kernel; or the
    torch path with PETREL_MLA_KERNEL=0), and a prompt run in chunks over its cached prefix; prompt chunks
    decompressed or absorbed (forced either way)."""
    from petrel.model import dense_kernels, mla_kernels
    from petrel.model.latent_stack import LatentStack

    if path != "torch" and dense_kernels.library() is None:
        pytest.skip("petrel's float32 kernels cannot run here (no AVX2/FMA or no C compiler)")
    monkeypatch.setenv("PETREL_MLA_KERNEL", "0" if path == "torch" else "1")
    monkeypatch.setattr(MLAttention, "absorbs", lambda self, n: prefill == "absorbed")
    if path == "kernel":  # the decode steps through the layers' modules
        monkeypatch.setattr(DeepseekForCausalLM, "_step_in_one_call", lambda *a: None)
    ran, kernel = [], mla_kernels.latent_decode_attention
    monkeypatch.setattr(mla_kernels, "latent_decode_attention", lambda *a: ran.append(out := kernel(*a)) or out)
    stacked, stack_call = [], LatentStack.__call__
    monkeypatch.setattr(LatentStack, "__call__", lambda *a: stacked.append(out := stack_call(*a)) or out)
    t = deepseek(name)
    drv = PagedDriver(t, block_size=4)
    prompts = [_tokens(23, 1), _tokens(9, 2), _tokens(2, 3)]
    seqs = [drv.new_seq(p) for p in prompts]
    for p, out in zip(prompts, drv.step([(s, s.num_tokens) for s in seqs])):
        assert_close(out, t.hf_logits(p), f"{name}: prefill of {len(p)} tokens")
    tokens, other = _tokens(26, 10), _tokens(14, 11)
    got_a, got_b = PagedDriver(t, block_size=4, seed=1).decode_side_by_side(tokens, other)
    assert_close(got_a, t.hf_logits(tokens), f"{name}: step-by-step decode")
    assert_close(got_b, t.hf_logits(other), f"{name}: decode next to another sequence")
    drv = PagedDriver(t, block_size=4, seed=3)
    chunks = drv.run_chunks(drv.new_seq(tokens), [8, 5, 1, 12])
    assert_close(chunks, t.hf_logits(tokens), f"{name}: chunked prefill")
    if path == "stack":  # every decode step in one call; no decode row through the modules
        assert stacked and all(out is not None for out in stacked) and not ran
    else:
        assert not stacked and ran and all((out is not None) == (path == "kernel") for out in ran)


@pytest.mark.parametrize(
    "rows,heads,rank,rope,block_size,lens,dtype",
    [
        (3, 4, 32, 8, 4, [5, 17, 40], torch.float32),  # the tiny models' shape
        (2, 16, 512, 64, 16, [300, 1000], torch.float32),  # DeepSeek-V3's latent: contexts split into parts
        (1, 16, 512, 64, 16, [2047], torch.bfloat16),
        (5, 6, 64, 16, 8, [1, 2, 9, 33, 70], torch.bfloat16),
    ],
)
def test_latent_decode_kernel_matches_float64(rows, heads, rank, rope, block_size, lens, dtype):
    """latent_attention.c against a float64 softmax over each row's gathered cache rows, blocks scrambled."""
    from petrel.model import dense_kernels, mla_kernels

    if dense_kernels.library() is None:
        pytest.skip("petrel's float32 kernels cannot run here (no AVX2/FMA or no C compiler)")
    g = torch.Generator().manual_seed(rows)
    width = rank + rope
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    cache = torch.randn(num_blocks, block_size, 1, width, generator=g).to(dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(rows, max(-(-n // block_size) for n in lens), dtype=torch.long)
    for s, n in enumerate(lens):
        for b in range(-(-n // block_size)):
            tables[s, b] = free.pop()
    q = torch.randn(rows, heads, width, generator=g)
    out = mla_kernels.latent_decode_attention(q, cache, tables, torch.tensor(lens), rank, 0.1)
    for s, n in enumerate(lens):
        context = cache[tables[s]].reshape(-1, width)[:n].double()
        expected = torch.softmax(q[s].double() @ context.t() * 0.1, dim=-1) @ context[:, :rank]
        torch.testing.assert_close(out[s].double(), expected, atol=1e-5, rtol=1e-5)


def test_decode_steps_read_the_latent_cache_without_expanding_it(deepseek, monkeypatch):
    """A decode step multiplies the queries by W_UK and the outputs by W_UV (in the one-call stack, or the layers'
    modules' _decode); nothing decompresses the cache. A prompt
    chunk decompresses its context where that costs less than absorbing its queries (the tiny shape: from 32
    queries), and absorbs them below."""
    t = deepseek("deepseek_v3")
    calls = []
    for method in ("_prefill", "_absorbed", "_decode"):
        original = getattr(MLAttention, method)
        monkeypatch.setattr(MLAttention, method, lambda self, *a, m=method, f=original: calls.append(m) or f(self, *a))
    attn = t.model.model.layers[0].self_attn
    assert [attn.absorbs(n) for n in (1, 31, 32, 200)] == [True, True, False, False]
    drv = PagedDriver(t, block_size=4)
    seq = drv.new_seq(_tokens(49, 5))
    drv.step([(seq, 40)])
    assert calls == ["_prefill"] * 3
    calls.clear()
    drv.step([(seq, 7)])
    assert calls == ["_absorbed"] * 3
    calls.clear()
    drv.step([(seq, 1)])  # every layer in one call where the kernels run (they absorb, never decompress)
    one_call = t.model.__dict__.get("_decode_stack", (None, None))[1] is not None
    assert calls == ([] if one_call else ["_decode"] * 3)
    monkeypatch.setattr(DeepseekForCausalLM, "_step_in_one_call", lambda *a: None)
    calls.clear()
    drv.step([(seq, 1)])
    assert calls == ["_decode"] * 3


@pytest.mark.parametrize("variant", ["float32", "bfloat16-cache", "int8"])
@pytest.mark.parametrize("name", FAMILY_IDS)
def test_one_call_decode_steps_equal_the_layers_modules(deepseek, name, variant, monkeypatch):
    """Three sequences of different lengths decoded side by side, every layer in one call (latent_layers.c: the
    router and experts in moe.c) and through the layers' modules: the same logits (float32 sums in another order),
    with a bfloat16 latent cache and with int8 projections too; the one call ran every decode step."""
    from petrel.model import dense_kernels
    from petrel.model.latent_stack import LatentStack

    if dense_kernels.library() is None:
        pytest.skip("petrel's float32 kernels cannot run here (no AVX2/FMA or no C compiler)")
    t = deepseek(name)
    model = t.model
    if variant == "int8":
        model = copy.deepcopy(t.model)
        quantize_int8(model)
    tiny = SimpleNamespace(model=model, cfg=t.cfg)
    kv_dtype = torch.bfloat16 if variant == "bfloat16-cache" else torch.float32
    prompts = [_tokens(13, 21), _tokens(5, 22), _tokens(30, 23)]

    def decode_steps() -> torch.Tensor:
        drv = PagedDriver(tiny, block_size=4, kv_cache_dtype=kv_dtype)
        seqs = [drv.new_seq(p + _tokens(4, 30 + i)) for i, p in enumerate(prompts)]
        drv.step([(s, len(p)) for s, p in zip(seqs, prompts)])
        return torch.cat([torch.cat(drv.step([(s, 1) for s in seqs])) for _ in range(4)])

    calls, stack_call = [], LatentStack.__call__
    monkeypatch.setattr(LatentStack, "__call__", lambda *a: calls.append(out := stack_call(*a)) or out)
    one_call = decode_steps()
    assert len(calls) == 4 and all(out is not None for out in calls)
    monkeypatch.setattr(DeepseekForCausalLM, "_step_in_one_call", lambda *a: None)
    torch.testing.assert_close(one_call, decode_steps(), atol=2e-4, rtol=1e-4)


# ---------------------------------------------------------------- the whole engine


@pytest.mark.parametrize(
    "engine_kwargs,expect_preemption",
    [
        (dict(block_size=4, max_num_batched_tokens=16), False),  # chunked prefill mixed with decodes
        (dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=3), True),  # tight memory: recomputation
    ],
    ids=["chunked", "preempting"],
)
@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_engine_greedy_matches_transformers_generate(deepseek, name, engine_kwargs, expect_preemption):
    t = deepseek(name)
    shared = _tokens(9, 60)
    # the last two share a 2-block prefix: with a 16-token budget the third is served 8 tokens from the cache
    prompts = [_tokens(21, 61), shared + _tokens(5, 62), shared]
    max_tokens = 20
    blocks = 12 if expect_preemption else 64
    per_block = kv_bytes_per_block(t.cfg, 4, torch.float32)
    results, core = _engine_generate(t, prompts, max_tokens, kv_cache_memory=blocks * per_block, **engine_kwargs)
    hits = core.scheduler.prefix_hit_tokens
    assert hits >= 8 if expect_preemption else hits == 8
    assert (core.scheduler.num_preemptions > 0) == expect_preemption
    for i, p in enumerate(prompts):
        expected = hf_greedy(t, p, max_tokens)
        assert results[f"req{i}"] == expected, f"{name} prompt {i}: petrel {results[f'req{i}']} != {expected}"


def _llm(t, tokenizer_dir, **options) -> LLM:
    return LLM(t.path, tokenizer=tokenizer_dir, kv_cache_memory=1 << 20, **options)


@pytest.mark.parametrize("name", FAMILY_IDS)
def test_logprobs_match_transformers_after_a_prefix_hit_and_across_chunks(deepseek, tokenizer_dir, name):
    """Prompt and output logprobs within 1e-4 of transformers' log-softmax (float32), for a prompt prefilled in
    8-token chunks, and output logprobs for one that reuses its first 4 blocks from the prefix cache (prompt
    logprobs would recompute them)."""
    t = deepseek(name)
    first = _tokens(17, 80)
    second = first[:16] + _tokens(13, 81)
    llm = _llm(t, tokenizer_dir, block_size=4, max_num_batched_tokens=8)
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
        with_prompt = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1, prompt_logprobs=1)
        outs = [llm.generate(first, with_prompt, use_tqdm=False), llm.generate(second, params, use_tqdm=False)]
        assert llm.engine.kv_bytes_per_token == 3 * 40 * 4
    finally:
        llm.shutdown()
    assert outs[0].num_cached_tokens == 0 and outs[1].num_cached_tokens == 16
    refs = [torch.log_softmax(t.hf_logits(p + o.outputs[0].token_ids), dim=-1) for p, o in zip((first, second), outs)]
    for p, out, ref in zip((first, second), outs, refs):
        tokens = out.outputs[0].token_ids
        assert tokens == ref[len(p) - 1 :].argmax(-1)[: len(tokens)].tolist()
        for i, (tok, entry) in enumerate(zip(tokens, out.outputs[0].logprobs)):
            assert entry[tok].logprob == pytest.approx(ref[len(p) - 1 + i, tok].item(), abs=1e-4)
    for pos in range(1, len(first)):
        logprob = outs[0].prompt_logprobs[pos][first[pos]].logprob
        assert logprob == pytest.approx(refs[0][pos - 1, first[pos]].item(), abs=1e-4)


# ---------------------------------------------------------------- the router and the rotary embedding


@pytest.mark.parametrize("name", FAMILY_IDS)
def test_router_picks_and_weighs_as_transformers(deepseek, name):
    t = deepseek(name)
    mine, theirs = t.model.model.layers[1].mlp.gate, t.hf.model.layers[1].mlp.gate
    assert isinstance(mine, DeepseekRouter)
    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(0))
    ids, weights = mine.route(x, 2, t.cfg.norm_topk_prob)
    with torch.no_grad():
        _, their_weights, their_ids = theirs(x)
    order, their_order = ids.argsort(-1), their_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), their_ids.gather(1, their_order))
    torch.testing.assert_close(weights.gather(1, order), their_weights.gather(1, their_order))
    if name != "deepseek_v2":  # groups limit the choice: some token's top 2 by score alone are not both taken
        method, mine.method = mine.method, "greedy"
        try:
            greedy_ids, _ = mine.route(x, 2, t.cfg.norm_topk_prob)
        finally:
            mine.method = method
        assert (greedy_ids.sort(-1).values != ids.sort(-1).values).any()


@pytest.mark.parametrize(
    "scaling",
    [
        {"factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 1.0},
        {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 1.0},
        {"factor": 8.0, "original_max_position_embeddings": 128, "mscale": 0.707, "mscale_all_dim": 0.707},
        {"factor": 8.0, "original_max_position_embeddings": 128, "beta_fast": 16, "truncate": False},
        {"factor": 2.0, "original_max_position_embeddings": 256, "attention_factor": 0.9, "mscale_all_dim": 0.5},
    ],
)
def test_yarn_matches_transformers(scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale

    from petrel.model.yarn import rotary_parameters, softmax_scale

    params = {"rope_type": "yarn", "rope_theta": 10000.0, **scaling}
    config = transformers.DeepseekV3Config(
        qk_rope_head_dim=64, qk_nope_head_dim=128, max_position_embeddings=4096, rope_parameters=params
    )
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](config)
    mine, my_attention = rotary_parameters(64, 10000.0, params)
    torch.testing.assert_close(mine.float(), inv_freq.float(), atol=0, rtol=1e-6)
    assert my_attention == pytest.approx(attention, rel=1e-12)
    assert softmax_scale(192, params) == pytest.approx(yarn_apply_mscale(params, 192**-0.5), rel=1e-12)


# ---------------------------------------------------------------- checkpoints


def test_fp8_block_checkpoint_dequantizes_and_multi_token_prediction_layers_are_skipped(deepseek, tmp_path):
    """DeepSeek-V3's published form: matrices float8_e4m3 with a float32 weight_scale_inv per block, and a
    multi-token prediction layer past num_hidden_layers (model.layers.3 here). Logits equal transformers' on the
    dequantized weights."""
    from safetensors.torch import load_file, save_file

    from petrel.model.fp8_blocks import dequantize

    t = deepseek("deepseek_v3")
    tensors = load_file(os.path.join(t.path, "model.safetensors"))
    hf = build_hf("deepseek_v3", seed=1)
    block = 16
    for name in [n for n, v in tensors.items() if v.dim() == 2 and "layers" in n and "gate.weight" not in n]:
        w = tensors[name]
        rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
        padded = torch.zeros(rows * block, cols * block)
        padded[: w.shape[0], : w.shape[1]] = w
        scale = padded.view(rows, block, cols, block).abs().amax((1, 3)).clamp(min=1e-6) / 448.0
        fp8 = (w / scale.repeat_interleave(block, 0)[: w.shape[0]].repeat_interleave(block, 1)[:, : w.shape[1]]).to(
            torch.float8_e4m3fn
        )
        tensors[name], tensors[name + "_scale_inv"] = fp8, scale
        _set_hf_weight(hf, name, dequantize(fp8, scale))
    tensors["model.layers.3.self_attn.q_a_proj.weight"] = torch.zeros(32, 64)  # a prediction layer: not ours
    with open(os.path.join(t.path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block]}
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model, cfg = load_model(resolve_model(str(tmp_path)), torch.float32, "cpu")
    from tiny_llama import Tiny

    ref = Tiny(hf, model, cfg, str(tmp_path))
    tokens = _tokens(15, 90)
    drv = PagedDriver(ref)
    seq = drv.new_seq(tokens)
    got = torch.cat([drv.step([(seq, 10)])[0], *(drv.step([(seq, 1)])[0] for _ in range(5))])
    assert_close(got, ref.hf_logits(tokens), "fp8 blocks")
    assert not torch.equal(hf.model.layers[1].self_attn.o_proj.weight, t.hf.model.layers[1].self_attn.o_proj.weight)


def _set_hf_weight(hf, name: str, value: torch.Tensor) -> None:
    """Write a checkpoint tensor into transformers' model (its experts fused: gate_up_proj [E, 2I, H], down_proj)."""
    if (m := re.match(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)) is not None:
        experts, e, kind = hf.get_submodule(m.group(1)), int(m.group(2)), m.group(3)
        inter = experts.down_proj.shape[2]
        target = experts.down_proj[e] if kind == "down" else experts.gate_up_proj[e, (kind == "up") * inter :][:inter]
        target.data.copy_(value)
        return
    hf.get_parameter(name).data.copy_(value)


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "name,overrides,field",
    [
        ("deepseek_v3", dict(scoring_func="tanh"), "scoring_func"),
        ("deepseek_v2", dict(topk_method="bogus"), "topk_method"),
        ("deepseek_v3", dict(n_group=3), "n_group"),
        ("deepseek_v3", dict(topk_group=5), "topk_group"),
        ("deepseek_v3", dict(num_experts_per_tok=9), "num_experts_per_tok"),
        ("deepseek_v3", dict(hidden_act="gelu"), "hidden_act"),
        ("deepseek_v2", dict(kv_lora_rank=None), "kv_lora_rank"),
        ("deepseek_v2", dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
        ("deepseek_v3", dict(quantization_config={"quant_method": "awq"}), "quantization_config"),
        ("deepseek_v3", dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "rope_scaling"),
    ],
)
def test_bad_configs_are_refused_naming_the_field(deepseek, tmp_path, name, overrides, field):
    t = deepseek(name)
    for f in os.listdir(t.path):
        os.symlink(os.path.join(t.path, f), tmp_path / f) if f != "config.json" else None
    with open(os.path.join(t.path, "config.json")) as f:
        config = json.load(f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({**config, **overrides}, f)
    with pytest.raises(ValueError, match=field):
        load_model(resolve_model(str(tmp_path)), torch.float32, "cpu")


@pytest.mark.parametrize(
    "options,field",
    [
        (dict(tensor_parallel_size=2), "tensor_parallel_size"),
        (dict(enable_lora=True), "enable_lora"),
        (dict(max_attention_window=[16]), "max_attention_window"),
    ],
)
def test_engine_options_latent_attention_cannot_honour_are_refused_by_name(deepseek, tokenizer_dir, options, field):
    with pytest.raises(ValueError, match=field):
        _llm(deepseek("deepseek_v2"), tokenizer_dir, **options)
