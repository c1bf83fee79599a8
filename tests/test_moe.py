"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) on tiny random-weight models built with transformers'
own classes, the oracle: configs and both checkpoint layouts load; prefill, paged decode and chunked prefill equal
transformers' logits; the engine's greedy tokens equal `generate` through a prefix-cache hit, chunked prefill and
preemption; logprobs within 1e-4; bfloat16 weights within the bf16 bound; beams, n > 1 and speculative decoding
run on them; bad configs, missing experts and LoRA on experts are refused by name."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_model_tiny import PagedDriver, _engine_generate, assert_close, hf_greedy  # noqa: E402
from tiny_llama import _tokens  # noqa: E402
from tiny_moe import FAMILY_IDS, build_hf, moe_factory  # noqa: E402

from petrel import LLM, LoRARequest, SamplingParams  # noqa: E402
from petrel.engine.model_runner import kv_bytes_per_block  # noqa: E402
from petrel.model.loader import hf_weights, load_model, resolve_model  # noqa: E402
from petrel.model.moe import Experts, MoeForCausalLM, SparseMoeBlock  # noqa: E402


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return moe_factory(tmp_path_factory)


def argmax_tokens(t, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation with eos an ordinary token (petrel's ignore_eos)."""
    tokens = list(ids)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(t.hf(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(ids) :]


def _hf_is_sparse(hf) -> list[bool]:
    return [hasattr(layer.mlp, "experts") for layer in hf.model.layers]


# ---------------------------------------------------------------- configs and checkpoints


def test_configs_and_structure(moe):
    mixtral, qwen2, qwen3 = moe("mixtral").cfg, moe("qwen2_moe").cfg, moe("qwen3_moe").cfg
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (4, 2, 32)
    assert mixtral.norm_topk_prob and mixtral.shared_expert_intermediate_size == 0 and not mixtral.qkv_bias
    assert (qwen2.num_experts, qwen2.num_experts_per_tok, qwen2.shared_expert_intermediate_size) == (8, 2, 48)
    assert not qwen2.norm_topk_prob and qwen2.qkv_bias and qwen2.dense_layers == [1]
    assert qwen3.qk_norm and qwen3.norm_topk_prob and qwen3.num_experts_per_tok == 3 and qwen3.head_dim == 32
    for name in FAMILY_IDS:
        t = moe(name)
        assert isinstance(t.model, MoeForCausalLM)
        assert [isinstance(layer.mlp, SparseMoeBlock) for layer in t.model.model.layers] == _hf_is_sparse(t.hf)
    assert hasattr(moe("qwen2_moe").model.model.layers[0].mlp, "shared_expert")


def test_decoder_sparse_step_and_mlp_only_layers_pick_the_dense_layers_transformers_does():
    from petrel.model.config import ModelConfig

    for step, only in ((2, []), (1, [0, 3]), (3, [2])):
        hf = build_hf("qwen2_moe", num_hidden_layers=5, decoder_sparse_step=step, mlp_only_layers=only)
        cfg = ModelConfig.from_hf_config({**hf.config.to_dict(), "architectures": ["Qwen2MoeForCausalLM"]})
        assert [cfg.is_moe_layer(i) for i in range(5)] == _hf_is_sparse(hf), (step, only)


@pytest.mark.parametrize("name", FAMILY_IDS)
def test_both_checkpoint_layouts_load_the_same_experts(moe, name):
    """One tensor per expert (the published layout) and the fused 3-D one (transformers 5's) load alike."""
    per_expert, fused = moe(name), moe(name, fused=True)
    names = [n for n, _ in hf_weights(per_expert.path)]
    assert any(".experts.3." in n for n in names) and not any(n.endswith("gate_up_proj") for n in names)
    fused_names = [n for n, _ in hf_weights(fused.path)]
    assert any(n.endswith(".mlp.experts.gate_up_proj") for n in fused_names)
    assert not any(".experts.3." in n for n in fused_names)
    for layer, hf_layer, other in zip(
        per_expert.model.model.layers, per_expert.hf.model.layers, fused.model.model.layers
    ):
        if not isinstance(layer.mlp, SparseMoeBlock):
            continue
        ref = hf_layer.mlp.experts
        for e in range(ref.gate_up_proj.shape[0]):
            for mine in (layer.mlp.experts, other.mlp.experts):
                gate_up, down = (_dense(w) for w in mine.expert_weights(e))
                torch.testing.assert_close(gate_up, ref.gate_up_proj[e], atol=0, rtol=0)
                torch.testing.assert_close(down, ref.down_proj[e], atol=0, rtol=0)
        torch.testing.assert_close(layer.mlp.gate.weight, hf_layer.mlp.gate.weight, atol=0, rtol=0)
        assert layer.mlp.gate.weight.dtype == torch.float32


def _dense(weight) -> torch.Tensor:
    return weight if isinstance(weight, torch.Tensor) else weight.dequantize()


# ---------------------------------------------------------------- logits against transformers


@pytest.mark.parametrize("name", FAMILY_IDS)
def test_prefill_and_decode_match_transformers(moe, name):
    """Three prompts prefilled in one step, then two sequences decoded side by side through the paged cache."""
    t = moe(name)
    drv = PagedDriver(t, block_size=4)
    prompts = [_tokens(23, 1), _tokens(9, 2), _tokens(1, 3)]
    seqs = [drv.new_seq(p) for p in prompts]
    for p, out in zip(prompts, drv.step([(s, s.num_tokens) for s in seqs])):
        assert_close(out, t.hf_logits(p), f"{name}: prefill of {len(p)} tokens")
    tokens, other = _tokens(26, 10), _tokens(14, 11)
    got_a, got_b = PagedDriver(t, block_size=4, seed=1).decode_side_by_side(tokens, other)
    assert_close(got_a, t.hf_logits(tokens), f"{name}: step-by-step decode")
    assert_close(got_b, t.hf_logits(other), f"{name}: decode next to another sequence")


@pytest.mark.parametrize("name", FAMILY_IDS)
def test_chunked_prefill_matches_one_shot(moe, name):
    t = moe(name, fused=True)
    tokens = _tokens(30, 30)
    one = PagedDriver(t, block_size=4)
    one_shot = one.run_chunks(one.new_seq(tokens), [30])
    assert_close(one_shot, t.hf_logits(tokens), f"{name}: one shot vs transformers")
    for chunks in ([8, 12, 10], [5, 1, 17, 7]):
        drv = PagedDriver(t, block_size=4, seed=3)
        assert_close(drv.run_chunks(drv.new_seq(tokens), chunks), one_shot, f"{name}: chunks {chunks}")


# ---------------------------------------------------------------- the whole engine


@pytest.mark.parametrize(
    "engine_kwargs,expect_preemption",
    [
        (dict(block_size=4, max_num_batched_tokens=16), False),  # chunked prefill mixed with decodes
        (dict(block_size=4, max_num_batched_tokens=2048), False),  # all prompts in one step
        (dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=3), True),  # tight memory: recomputation
    ],
    ids=["chunked", "one-shot", "preempting"],
)
@pytest.mark.parametrize("name", FAMILY_IDS)
def test_engine_greedy_matches_transformers_generate(moe, name, engine_kwargs, expect_preemption):
    t = moe(name)
    shared = _tokens(9, 60)
    # the last two share a 2-block prefix: with a 16-token budget the third is served 8 tokens from the cache
    prompts = [_tokens(21, 61), shared + _tokens(5, 62), shared]
    max_tokens = 20
    blocks = 12 if expect_preemption else 64
    per_block = kv_bytes_per_block(t.cfg, 4, torch.float32)
    results, core = _engine_generate(t, prompts, max_tokens, kv_cache_memory=blocks * per_block, **engine_kwargs)
    if engine_kwargs["max_num_batched_tokens"] == 16:
        hits = core.scheduler.prefix_hit_tokens
        assert hits >= 8 if expect_preemption else hits == 8
    assert (core.scheduler.num_preemptions > 0) == expect_preemption
    for i, p in enumerate(prompts):
        expected = hf_greedy(t, p, max_tokens)
        assert results[f"req{i}"] == expected, f"{name} prompt {i}: petrel {results[f'req{i}']} != {expected}"


@pytest.mark.parametrize("name", FAMILY_IDS)
def test_every_path_gives_the_same_tokens(moe, name, monkeypatch):
    """The whole decoder stack as one kernel call (plain layers: Mixtral's, Qwen3-MoE's q/k norms included; the
    router, top-k and experts in C), each layer as its modules with the experts' kernel (Qwen2-MoE's biases, or the
    stack switched off), and the torch loop (no compiler or AVX2; PETREL_MOE_KERNEL=0): transformers' tokens
    through chunked prefill and decode; spies show which ran."""
    from petrel.model import moe_kernels
    from petrel.model.llama import LlamaForCausalLM

    t = moe(name)
    prompts = [_tokens(21, 61), _tokens(9, 60)]
    expected = [hf_greedy(t, p, 12) for p in prompts]
    stack_steps, kernel_calls = [], []
    step, experts = LlamaForCausalLM._step_in_one_call, moe_kernels.experts
    monkeypatch.setattr(moe_kernels, "experts", lambda *a: kernel_calls.append(out := experts(*a)) or out)
    plain = name != "qwen2_moe"  # Qwen2-MoE's q/k/v biases keep it out of the one-call stack
    for path in ("stack", "layers", "torch"):
        monkeypatch.setenv("PETREL_MOE_KERNEL", "0" if path == "torch" else "1")
        monkeypatch.setattr(
            LlamaForCausalLM,
            "_step_in_one_call",
            (lambda self, *a: stack_steps.append(out := step(self, *a)) or out)
            if path != "layers"
            else (lambda *a: None),
        )
        stack_steps.clear(), kernel_calls.clear()
        results, _ = _engine_generate(t, prompts, 12, block_size=4, max_num_batched_tokens=16)
        assert [results[f"req{i}"] for i in range(len(prompts))] == expected, path
        took_stack = [s is not None for s in stack_steps]
        took_kernel = [c is not None for c in kernel_calls]
        if path == "stack" and plain:
            assert took_stack and all(took_stack) and not kernel_calls, (took_stack, took_kernel)
        elif path == "torch":
            assert not any(took_stack) and kernel_calls and not any(took_kernel)
        else:  # layer by layer: prompt steps through the experts' kernel (decode steps: decode_layer, also C)
            assert not any(took_stack) and any(took_kernel) and all(took_kernel)


def _llm(t, tokenizer_dir, **options) -> LLM:
    return LLM(t.path, tokenizer=tokenizer_dir, kv_cache_memory=1 << 20, **options)


@pytest.mark.parametrize("name", FAMILY_IDS)
def test_logprobs_match_transformers(moe, tokenizer_dir, name):
    """Prompt and output logprobs of a batch of prompts within 1e-4 of transformers' log-softmax (float32)."""
    t = moe(name)
    prompts = [_tokens(13, 80), _tokens(7, 81), _tokens(20, 82)]
    llm = _llm(t, tokenizer_dir)
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1, prompt_logprobs=1)
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    for p, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        assert tokens == argmax_tokens(t, p, 6)
        ref = torch.log_softmax(t.hf_logits(p + tokens), dim=-1)
        for i, (tok, entry) in enumerate(zip(tokens, out.outputs[0].logprobs)):
            assert entry[tok].logprob == pytest.approx(ref[len(p) - 1 + i, tok].item(), abs=1e-4)
        for pos in range(1, len(p)):
            assert out.prompt_logprobs[pos][p[pos]].logprob == pytest.approx(ref[pos - 1, p[pos]].item(), abs=1e-4)


def _bf16_reference(hf):
    """transformers' float32 model with every projection, head, embedding and expert matrix rounded to bfloat16
    (the router's weight is no nn.Linear: float32, as petrel keeps it)."""
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for module in ref.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                module.weight.copy_(module.weight.bfloat16().float())
            elif hasattr(module, "gate_up_proj") and hasattr(module, "down_proj"):
                for p in (module.gate_up_proj, module.down_proj):
                    if isinstance(p, torch.nn.Parameter):
                        p.copy_(p.bfloat16().float())
    return ref


@pytest.mark.parametrize("name", FAMILY_IDS)
def test_bfloat16_matches_transformers_on_rounded_weights(moe, tokenizer_dir, name, monkeypatch):
    """dtype='bfloat16' on the CPU holds every expert's matrices in bfloat16 too (float32 activations, the router
    float32): logits within the bf16 test's 1e-3 of transformers' on the rounded weights."""
    from petrel.model.quantization import QuantizedWeight

    monkeypatch.setenv("PETREL_BF16_ACTIVATIONS", "0")  # exact products: the weights widened to float32
    t = moe(name)
    ref = _bf16_reference(t.hf)
    llm = _llm(t, tokenizer_dir, dtype="bfloat16", kv_cache_dtype="float32")
    try:
        assert llm.engine.config.quantization == "bf16"
        experts = next(b.experts for b in llm.engine.core.runner.model.moe_blocks() if b is not None)
        gate_up, _ = experts.expert_weights(0)
        assert isinstance(gate_up, QuantizedWeight) and gate_up.codes.dtype == torch.bfloat16
        ids = _tokens(11, 90)
        params = SamplingParams(
            temperature=0, max_tokens=5, ignore_eos=True, return_context_logits=True, return_generation_logits=True
        )
        out = llm.generate(ids, params, use_tqdm=False)
    finally:
        llm.shutdown()
    tokens = out.outputs[0].token_ids
    with torch.no_grad():
        expected = ref(torch.tensor([ids + tokens])).logits[0].float()
    torch.testing.assert_close(out.context_logits, expected[: len(ids)], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(
        out.outputs[0].generation_logits, expected[len(ids) - 1 : len(ids) + len(tokens) - 1], atol=1e-3, rtol=1e-3
    )


def test_beams_match_transformers(moe):
    from test_beam_search import beam_params, hf_beams, run_engine

    t = moe("qwen2_moe")
    prompts = [_tokens(5 + s, 100 + s) for s in range(3)]
    results, _ = run_engine(t, [(p, beam_params(3, 2, 6), ()) for p in prompts])
    for i, prompt in enumerate(prompts):
        expected, _ = hf_beams(t, prompt, 3, 2, 6, (), 1.0, False)
        assert [results[i][k].new_token_ids for k in range(2)] == expected


def test_n_and_speculative_decoding_run_on_a_moe_model(moe, tokenizer_dir):
    """n > 1 sampling, and n-gram and draft-model speculation (the model its own draft: every draft accepted) give
    plain greedy decoding's tokens: verification rows run through the experts like any other rows."""
    t = moe("qwen3_moe")
    repeat = _tokens(6, 120)
    prompts = [repeat * 3, _tokens(15, 121)]  # a repeated pattern gives the n-gram drafter something to propose
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [argmax_tokens(t, p, 12) for p in prompts]
    llm = _llm(t, tokenizer_dir)
    try:
        sampled = llm.generate(prompts[1], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5), use_tqdm=False)
        assert len(sampled.outputs) == 3 and all(len(o.token_ids) == 5 for o in sampled.outputs)
    finally:
        llm.shutdown()
    for spec in ({"method": "ngram", "num_speculative_tokens": 3}, {"method": "draft_model", "draft_model": t.path}):
        llm = _llm(t, tokenizer_dir, speculative_config={**spec, "num_speculative_tokens": 3})
        try:
            outs = llm.generate(prompts, greedy, use_tqdm=False)
            drafted, accepted = llm.engine.call(lambda core: (core.num_draft_tokens, core.num_accepted_tokens))
        finally:
            llm.shutdown()
        assert [o.outputs[0].token_ids for o in outs] == expected, spec["method"]
        assert drafted > 0 and (accepted == drafted or spec["method"] == "ngram"), (spec, drafted, accepted)


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "name,overrides,field",
    [
        ("mixtral", dict(num_experts_per_tok=5), "num_experts_per_tok"),
        ("qwen3_moe", dict(num_experts_per_tok=9), "num_experts_per_tok"),
        ("qwen2_moe", dict(scoring_func="sigmoid"), "scoring_func"),
        ("qwen3_moe", dict(hidden_act="gelu"), "hidden_act"),
        ("qwen2_moe", dict(mlp_only_layers=[7]), "mlp_only_layers"),
    ],
)
def test_bad_configs_are_refused_naming_the_field(moe, tmp_path, name, overrides, field):
    t = moe(name)
    for f in os.listdir(t.path):
        os.symlink(os.path.join(t.path, f), tmp_path / f) if f != "config.json" else None
    with open(os.path.join(t.path, "config.json")) as f:
        config = json.load(f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({**config, **overrides}, f)
    with pytest.raises(ValueError, match=field):
        load_model(resolve_model(str(tmp_path)), torch.float32, "cpu")


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
def test_missing_or_misshapen_expert_tensors_are_refused(moe, tmp_path, fused):
    from safetensors.torch import load_file, save_file

    t = moe("mixtral", fused=fused)
    tensors = load_file(os.path.join(t.path, "model.safetensors"))
    victim = "model.layers.1.mlp.experts.down_proj" if fused else "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    for f in ("config.json", "generation_config.json"):
        os.symlink(os.path.join(t.path, f), tmp_path / f)
    save_file({k: v for k, v in tensors.items() if k != victim}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing weights.*experts"):
        load_model(resolve_model(str(tmp_path)), torch.float32, "cpu")
    tensors[victim] = tensors[victim][..., :-1].contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="has shape"):
        load_model(resolve_model(str(tmp_path)), torch.float32, "cpu")


def _write_adapter(path, keys: dict[str, tuple[int, int]], targets: list[str], seed: int = 0) -> None:
    """A PEFT LoRA adapter of rank 4: key prefix -> (in, out) for lora_A [4, in] and lora_B [out, 4]."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for prefix, (n_in, n_out) in keys.items():
        tensors[f"base_model.model.{prefix}.lora_A.weight"] = torch.randn(4, n_in, generator=g) * 0.3
        tensors[f"base_model.model.{prefix}.lora_B.weight"] = torch.randn(n_out, 4, generator=g) * 0.3
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": targets}, f)


def test_lora_on_experts_is_refused_and_attention_lora_works(moe, tokenizer_dir, tmp_path):
    t = moe("qwen2_moe")
    h, q, kv = 64, 64, 32
    attention = {
        f"model.layers.{i}.self_attn.{p}": (h, q if p == "q_proj" else kv)
        for i in range(3)
        for p in ("q_proj", "v_proj")
    }
    _write_adapter(tmp_path / "attn", attention, ["q_proj", "v_proj"])
    _write_adapter(tmp_path / "experts", {"model.layers.0.mlp.experts.3.gate_proj": (h, 32)}, ["gate_proj"])
    _write_adapter(tmp_path / "sparse-mlp", {"model.layers.0.mlp.gate_proj": (h, 96)}, ["gate_proj"])
    # the reference: transformers with the attention adapter merged (W + (alpha / r) B A)
    from safetensors.torch import load_file

    merged = copy.deepcopy(t.hf)
    adapter = load_file(str(tmp_path / "attn" / "adapter_model.safetensors"))
    with torch.no_grad():
        for prefix in attention:
            a, b = (
                adapter[f"base_model.model.{prefix}.lora_A.weight"],
                adapter[f"base_model.model.{prefix}.lora_B.weight"],
            )
            merged.get_submodule(prefix).weight += 2.0 * b @ a
    ids = _tokens(12, 140)
    llm = _llm(t, tokenizer_dir, enable_lora=True, max_lora_rank=8)
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        out = llm.generate(ids, params, lora_request=LoRARequest("attn", 1, str(tmp_path / "attn")), use_tqdm=False)
        assert out.outputs[0].token_ids == argmax_tokens(type(t)(merged, None, t.cfg, t.path), ids, 6)
        assert out.outputs[0].token_ids != argmax_tokens(t, ids, 6)  # the adapter changes the output
        for name, what in (("experts", "mlp.experts.3.gate_proj"), ("sparse-mlp", "mixture of experts")):
            with pytest.raises(ValueError, match=what):
                llm.generate(ids, params, lora_request=LoRARequest(name, 2, str(tmp_path / name)), use_tqdm=False)
        assert llm.generate(ids, params, use_tqdm=False).outputs[0].token_ids == argmax_tokens(t, ids, 6)
    finally:
        llm.shutdown()


def test_experts_hold_only_this_ranks_share():
    """Unit check of the sharding arithmetic the tensor- and expert-parallel ranks use."""
    from petrel.model.parallel import TensorParallel

    tp = TensorParallel(1, 2)
    sliced = Experts(8, 16, 32, tp)
    assert (sliced.first, sliced.num_local, sliced.columns) == (0, 8, (16, 32))
    tp.expert_parallel = True
    whole = Experts(8, 16, 32, tp)
    assert (whole.first, whole.num_local, whole.columns) == (4, 4, (0, 32))
    assert tuple(whole.gate_up_proj.shape) == (4, 64, 16) and tuple(sliced.down_proj.shape) == (8, 16, 16)


# ---------------------------------------------------------------- statistics


def _hf_routed(t, tokens: list[int], layer: int) -> list[int]:
    """Tokens transformers' router sends to each expert of a layer over a prompt."""
    with torch.no_grad():
        out = t.hf(torch.tensor([tokens]), output_router_logits=True)
    sparse = [i for i, s in enumerate(_hf_is_sparse(t.hf)) if s]
    logits = out.router_logits[sparse.index(layer)]
    picks = torch.softmax(logits.float(), -1).topk(t.cfg.num_experts_per_tok, -1).indices
    return torch.bincount(picks.reshape(-1), minlength=t.cfg.num_experts).tolist()


def test_expert_load_per_step_and_on_metrics(moe, tokenizer_dir):
    """IterationStats.expert_load: each MoE layer's tokens per expert of the step (a prompt's prefill: transformers'
    router's counts); /metrics: petrel_moe_expert_tokens{layer, expert}, the totals since start."""
    from fastapi.testclient import TestClient

    from petrel.serve.app import build_app

    t = moe("qwen2_moe")
    prompt = _tokens(17, 150)
    llm = _llm(t, tokenizer_dir)
    try:
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
        history = list(llm.engine.stats_history)
        prefill = next(s for s in history if s.num_prompt_tokens == 17)
        assert sorted(prefill.expert_load) == [0, 2]  # layer 1 is dense
        for layer in (0, 2):
            assert prefill.expert_load[layer] == _hf_routed(t, prompt, layer)
        decodes = [s for s in history if s.num_prompt_tokens == 0 and s.expert_load]
        assert decodes and all(sum(s.expert_load[0]) == 2 for s in decodes)  # one token, top 2
        text = TestClient(build_app(llm)).get("/metrics").text
    finally:
        llm.shutdown()
    series = [line for line in text.splitlines() if line.startswith("petrel_moe_expert_tokens{")]
    assert len(series) == 2 * 8  # two MoE layers of 8 experts
    totals = {}
    for line in series:
        labels, value = line.rsplit(" ", 1)
        layer = labels.split('layer="')[1].split('"')[0]
        totals[layer] = totals.get(layer, 0) + float(value)
    assert totals == {"0": 2 * (17 + 2), "2": 2 * (17 + 2)}  # 17 prompt tokens and 2 decode steps, top 2 each


def test_benchmarks_count_only_the_experts_a_token_takes(moe):
    """petrel bench's W2 arithmetic counts a mixture of experts' router, its top-k experts and shared expert per
    token in sparse layers, the dense MLP in dense ones."""
    from petrel.bench.flops import mlp_multiply_adds

    cfg = moe("qwen2_moe").cfg  # layers 0 and 2 sparse: router 8, top 2 of 32, shared 48 and its gate; layer 1 dense
    sparse = 64 * 8 + 3 * 64 * 32 * 2 + 3 * 64 * 48 + 64
    assert mlp_multiply_adds(cfg) == (3 * 64 * 96 + 2 * sparse) / 3
    mixtral = moe("mixtral").cfg
    assert mlp_multiply_adds(mixtral) == 64 * 4 + 3 * 64 * 32 * 2


# ---------------------------------------------------------------- the rest of the stack


@pytest.fixture(scope="module")
def moe_with_vocabulary(tmp_path_factory, tokenizer_dir):
    """A tiny Qwen3-MoE over the default model's whole vocabulary (49,152 ids), its tokenizer saved beside it: text
    prompts, guided decoding and the server need a vocabulary the tokenizer covers."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    hf = build_hf("qwen3_moe", vocab_size=len(tokenizer))
    path = tmp_path_factory.mktemp("qwen3-moe-vocab")
    hf.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


def test_guided_decoding_the_server_and_the_executor_run_on_a_moe_model(moe_with_vocabulary):
    """Guided decoding (a regex, a JSON schema) constrains a MoE model's output; petrel serve's /v1/completions and
    /v1/chat/completions answer; the Executor's greedy tokens are LLM's."""
    import re

    from fastapi.testclient import TestClient

    from petrel import GuidedDecodingParams
    from petrel.executor import Executor, OutputConfig, Request
    from petrel.serve.app import build_app

    path = moe_with_vocabulary
    llm = LLM(path, kv_cache_memory=4 << 20)
    try:
        regex = SamplingParams(
            temperature=0, max_tokens=20, guided_decoding=GuidedDecodingParams(regex=r"[0-9]{3}-[a-z]{2}")
        )
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", llm.generate("Code:", regex, use_tqdm=False).outputs[0].text)
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        params = SamplingParams(temperature=0, max_tokens=40, guided_decoding=GuidedDecodingParams(json=schema))
        assert isinstance(json.loads(llm.generate("JSON:", params, use_tqdm=False).outputs[0].text)["n"], int)
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        ids = llm.engine.tokenizer("The sea is")["input_ids"]
        expected = llm.generate(ids, greedy, use_tqdm=False).outputs[0].token_ids
        with TestClient(build_app(llm, "tiny-moe")) as client:
            r = client.post("/v1/completions", json={"model": "tiny-moe", "prompt": "The sea is", "max_tokens": 8})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
            chat = {"model": "tiny-moe", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}
            assert client.post("/v1/chat/completions", json=chat).status_code == 200
    finally:
        llm.shutdown()
    executor = Executor(path, kv_cache_memory=4 << 20)
    try:
        request = Request(ids, 8, output_config=OutputConfig(exclude_input_from_output=True))
        request_id = executor.enqueue_request(request)
        responses = []
        while not responses or not (responses[-1].has_error() or responses[-1].result.is_final):
            responses.extend(executor.await_responses(request_id, timeout=30.0))
        assert not responses[-1].has_error() and responses[-1].result.output_token_ids[0] == list(expected)
    finally:
        executor.shutdown()
