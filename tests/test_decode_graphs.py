"""Decode steps through DecodeGraphs' static, padded buffers (petrel/engine/decode_graphs.py), run eager on CPU: the
padding, bucket and buffer logic a CUDA graph replays. A padded step must give its rows the logits of the plain
forward (which transformers confirms) and leave every sequence's KV as the plain forward leaves it; an engine with
the graphs wired in must generate the tokens of one without."""

from __future__ import annotations

import pytest
import torch

from petrel.engine import decode_graphs, model_runner
from petrel.engine.decode_graphs import DecodeGraphs, batch_sizes_of, default_batch_sizes
from petrel.engine.model_runner import ModelRunner, QuerySpan

BLOCK = 16
NUM_BLOCKS = 12  # block 12, one past them, is the padded rows' scratch block
PROMPTS = [list(range(3, 8)), list(range(10, 30)), list(range(40, 77)), list(range(80, 83)), list(range(90, 108))]
TABLES = [[0], [1, 2], [3, 4, 5], [6], [7, 8]]  # each holds its prompt and two more tokens


def _runner(tiny) -> tuple[ModelRunner, object]:
    t = tiny(2, False)
    runner = ModelRunner(t.model, t.cfg, NUM_BLOCKS + 1, BLOCK, torch.float32, "cpu")
    runner.last_token_logits([QuerySpan(p, 0, table) for p, table in zip(PROMPTS, TABLES)])
    return runner, t


def _decode_inputs(rows: list[int], tokens: list[int], lengths: list[int]):
    """run()'s arguments for one decode token per row (sequence `rows[i]` at position lengths[i])."""
    slots = [TABLES[r][n // BLOCK] * BLOCK + n % BLOCK for r, n in zip(rows, lengths)]
    return tokens, lengths, slots, [TABLES[r] for r in rows], [n + 1 for n in lengths]


def _plain_step(runner: ModelRunner, rows: list[int], tokens: list[int], lengths: list[int]) -> torch.Tensor:
    return runner.last_token_logits([QuerySpan([tok], n, TABLES[r]) for r, tok, n in zip(rows, tokens, lengths)])


def test_padded_steps_match_the_plain_forward_and_keep_every_sequence_kv(tiny):
    """Two steps in one captured size (4): 3 rows with tables up to 3 blocks wide, then 2 narrower rows (stale
    columns and rows in the buffers from the first step); each step's logits equal the plain forward's, the KV of
    every real block equals the plain forward's, and the first step's logits equal transformers'."""
    runner, t = _runner(tiny)
    start = [c.clone() for c in runner.cache_tensors]
    steps = [([0, 1, 2], [50, 60, 70]), ([3, 4], [51, 61])]

    plain = []
    lengths = {r: len(PROMPTS[r]) for r in range(len(PROMPTS))}
    for rows, tokens in steps:
        plain.append(_plain_step(runner, rows, tokens, [lengths[r] for r in rows]))
    plain_kv = [c[:, :NUM_BLOCKS].clone() for c in runner.cache_tensors]

    for cache, saved in zip(runner.cache_tensors, start):
        cache.copy_(saved)
    graphs = DecodeGraphs(t.model, runner.kv_caches, [4], max_blocks=4, scratch_block=NUM_BLOCKS, capture=False)
    for (rows, tokens), expected in zip(steps, plain):
        got = graphs.run(*_decode_inputs(rows, tokens, [lengths[r] for r in rows]))
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for cache, expected in zip(runner.cache_tensors, plain_kv):
        torch.testing.assert_close(cache[:, :NUM_BLOCKS], expected, atol=1e-6, rtol=1e-6)

    for row, (prompt, token) in enumerate(zip(PROMPTS, steps[0][1])):
        reference = t.hf_logits(prompt + [token])[-1]
        torch.testing.assert_close(plain[0][row], reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_rows, size", [(1, 1), (3, 4), (5, 8)])
def test_a_step_takes_the_smallest_size_that_holds_it(tiny, num_rows, size):
    runner, t = _runner(tiny)
    rows = list(range(num_rows))
    tokens = [100 + r for r in rows]
    lengths = [len(PROMPTS[r]) for r in rows]
    graphs = DecodeGraphs(t.model, runner.kv_caches, [1, 2, 4, 8], 4, NUM_BLOCKS, capture=False)
    used = []
    forward = graphs._forward
    graphs._forward = lambda slot, lens: used.append(slot.size) or forward(slot, lens)
    start = [c.clone() for c in runner.cache_tensors]
    got = graphs.run(*_decode_inputs(rows, tokens, lengths))
    for cache, saved in zip(runner.cache_tensors, start):
        cache.copy_(saved)
    torch.testing.assert_close(got, _plain_step(runner, rows, tokens, lengths), atol=1e-5, rtol=1e-5)
    assert used == [size]
    assert graphs.fits(8, 4) and not graphs.fits(9, 4) and not graphs.fits(2, 5)


def test_batch_sizes_from_the_config():
    from petrel.config import EngineConfig

    assert default_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert default_batch_sizes(3) == [1, 2, 3]
    assert batch_sizes_of(EngineConfig(max_num_seqs=20)) == [1, 2, 4, 8, 16, 20]
    assert batch_sizes_of(EngineConfig(cuda_graph_batch_sizes=[8, 2, 8])) == [2, 8]
    assert batch_sizes_of(EngineConfig(enforce_eager=True)) == []
    with pytest.raises(ValueError, match="cuda_graph_batch_sizes"):
        EngineConfig(cuda_graph_batch_sizes=[0])


def test_engine_with_decode_graphs_generates_the_tokens_of_one_without(tiny, tokenizer_dir, monkeypatch):
    """The runner's wiring (decode-only steps to the graphs, the scratch block past the block manager's, other steps
    to forward) with eager DecodeGraphs standing in for captured ones: same greedy tokens as an engine without."""
    from petrel import LLM, SamplingParams

    t = tiny(2, False)
    prompts = PROMPTS[:3]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    options = dict(model=t.path, tokenizer=tokenizer_dir, kv_cache_memory=1 << 20, max_num_seqs=4)
    plain = LLM(**options)
    try:
        expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    finally:
        plain.shutdown()

    steps = []
    monkeypatch.setattr(model_runner, "graphs_supported", lambda device: True)

    def eager(*args):
        graphs = DecodeGraphs(*args, capture=False)
        run = graphs.run
        graphs.run = lambda *a: steps.append(len(a[0])) or run(*a)
        return graphs

    monkeypatch.setattr(model_runner, "capture_decode_graphs", eager)
    llm = LLM(**options, cuda_graph_batch_sizes=[1, 2, 4])
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        num_blocks, cache_blocks = llm.engine.call(
            lambda core: (core.block_manager.num_blocks, core.runner.cache_tensors[0].shape[1])
        )
    finally:
        llm.shutdown()
    assert got == expected
    assert steps == [3] * 11  # every decode step, none of the prefill
    assert cache_blocks == num_blocks + 1


def test_graphs_need_decode_attention_that_runs_in_a_graph():
    assert not decode_graphs.graphs_supported(torch.device("cpu"))
