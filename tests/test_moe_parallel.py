"""Mixtures of experts over tensor-parallel ranks: a slice of every expert per rank (tensor parallelism), or whole
experts, E / ranks of them (enable_expert_parallel: the router replicated, each rank's experts' sums all-reduced).
Ranks as threads give the unsharded logits (uneven expert counts included); two gloo processes with
enable_expert_parallel give one process's greedy tokens; too many ranks are refused naming the option."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_tensor_parallel import _greedy, _on_ranks, _prefill_then_decode, _tokenizer_dir
from tiny_llama import _tokens
from tiny_moe import build_hf

from petrel import LLM
from petrel.config import EngineConfig
from petrel.model.loader import load_model, resolve_model
from petrel.model.moe import SparseMoeBlock
from petrel.model.parallel import TensorParallel, check_tensor_parallel

CASES = {  # id -> (family, ranks, expert parallel, config overrides)
    "mixtral-tp2": ("mixtral", 2, False, {}),
    "qwen2_moe-tp2": ("qwen2_moe", 2, False, {}),  # the shared expert and the dense layer split too
    "qwen2_moe-ep2": ("qwen2_moe", 2, True, {}),
    "qwen3_moe-ep2": ("qwen3_moe", 2, True, {}),
    "qwen3_moe-ep3": ("qwen3_moe", 3, True, dict(num_key_value_heads=4)),  # 8 experts as 3 + 3 + 2
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cache = {}

    def build(family: str, **overrides) -> str:
        key = (family, tuple(sorted(overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(family)
            build_hf(family, 1, **overrides).save_pretrained(path, safe_serialization=True)
            cache[key] = str(path)
        return cache[key]

    return build


@pytest.mark.parametrize("case", list(CASES))
def test_ranks_give_the_unsharded_logits(checkpoint, case):
    family, size, expert_parallel, overrides = CASES[case]
    source = resolve_model(checkpoint(family, **overrides))
    full, cfg = load_model(source, torch.float32, "cpu")
    prompt, steps = _tokens(11, seed=1), _tokens(3, seed=2)
    expected = _prefill_then_decode(full, cfg, TensorParallel(), prompt, steps)

    def rank(tp):
        tp.expert_parallel = expert_parallel
        model, _ = load_model(source, torch.float32, "cpu", tp=tp)
        experts = [b.experts for b in model.moe_blocks() if b is not None]
        held = [(e.first, e.num_local, e.local_intermediate) for e in experts[:1]]
        return held, _prefill_then_decode(model, cfg, tp, prompt, steps)

    results = _on_ranks(size, rank)
    shares = [held[0] for held, _ in results]
    if expert_parallel:  # whole experts, every one on exactly one rank
        assert [n for _, n, _ in shares] == [len(range(r * 8 // size, (r + 1) * 8 // size)) for r in range(size)]
        assert sum(n for _, n, _ in shares) == cfg.num_experts and {i for *_, i in shares} == {32}
    else:  # every expert, a slice of its width each
        assert {n for _, n, _ in shares} == {cfg.num_experts} and sum(i for *_, i in shares) == 32
    for _, got in results:
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, atol=2e-4, rtol=1e-4)


def test_too_many_ranks_for_the_experts_are_refused(checkpoint):
    cfg = load_model(resolve_model(checkpoint("mixtral")), torch.float32, "cpu")[1]
    cfg = replace(cfg, num_key_value_heads=64)  # the attention would take that many ranks: the experts refuse
    with pytest.raises(ValueError, match="enable_expert_parallel is larger than the model's 4 experts"):
        check_tensor_parallel(cfg, 5, expert_parallel=True)
    with pytest.raises(ValueError, match="larger than the model's expert width 32"):
        check_tensor_parallel(cfg, 33)
    with pytest.raises(TypeError, match="enable_expert_parallel must be bool"):
        EngineConfig(enable_expert_parallel="yes")


def test_two_processes_with_expert_parallelism_give_one_processes_tokens(checkpoint):
    path, prompts = checkpoint("qwen3_moe"), [_tokens(9, 5), _tokens(14, 6), _tokens(3, 7)]
    with LLM(path, tokenizer=_tokenizer_dir()) as single:
        expected = _greedy(single, prompts, 12)
    llm = LLM(
        path, tokenizer=_tokenizer_dir(), tensor_parallel_size=2, enable_expert_parallel=True, kv_cache_memory=1 << 22
    )
    try:
        model = llm.engine.core.runner.model
        block = next(layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock))
        assert (block.experts.first, block.experts.num_local) == (0, 4)  # rank 0 holds experts 0-3
        assert _greedy(llm, prompts, 12) == expected
    finally:
        llm.shutdown()
