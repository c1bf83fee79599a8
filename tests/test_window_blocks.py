"""Sliding-window models give back the KV blocks behind the window (BlockManager.free_behind_window).

First the block manager alone (no model): which blocks are returned, placeholders skipped by free / fork / pins /
the prefix cache, ref counts, no leak. Then a tiny random-weight Mistral (every layer windowed, W = 24, blocks
of 4) generating well past the window through the whole engine: tokens equal the same engine with freeing off
and transformers, each sequence holds at most ceil(W / block) + 2 blocks, and a cache too small for the whole
sequence completes without preemption.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from petrel.engine.block_manager import FREED, BlockManager, held_blocks, num_freed_blocks
from petrel.engine.kv_export import gather_prompt_kv, scatter_prompt_kv
from petrel.engine.sequence import EngineRequest, Sequence
from petrel.sampling_params import SamplingParams

BS, W = 4, 8  # block manager tests
MAX_HELD = -(-W // BS) + 2
_ids = itertools.count()


def make_seq(tokens, context_only=False) -> Sequence:
    req = EngineRequest(f"w-{next(_ids)}", list(tokens), SamplingParams(max_tokens=64), context_only=context_only)
    seq = Sequence(req, 0, req.prompt_token_ids, len(req.prompt_token_ids))
    req.seqs.append(seq)
    return seq


def check(bm: BlockManager, *seqs: Sequence) -> None:
    """Integrity, ref counts = held entries over all tables, FREED only as a prefix, and the next query's window
    (positions num_computed - W + 1 .. num_computed - 1) all in held blocks."""
    bm.check_integrity()
    counts = [0] * bm.num_blocks
    for s in seqs:
        k = num_freed_blocks(s.block_table)
        assert all(b == FREED for b in s.block_table[:k]) and all(b >= 0 for b in s.block_table[k:])
        for b in held_blocks(s.block_table):
            counts[b] += 1
        c = s.num_computed_tokens
        assert all(s.block_table[p // bm.block_size] != FREED for p in range(max(0, c - bm.sliding_window + 1), c))
    assert counts == bm.ref_counts


def compute(bm: BlockManager, seq: Sequence, n: int) -> None:
    """What a step does for one sequence: allocate, compute, publish, give back what fell behind the window."""
    assert bm.allocate_slots(seq, n)
    seq.num_computed_tokens += n
    bm.cache_computed_blocks(seq)
    bm.free_behind_window(seq)


def decode(bm: BlockManager, seq: Sequence, steps: int, first_token: int = 1000) -> None:
    for i in range(steps):
        seq.token_ids.append(first_token + i)  # sampled last step; its K/V are computed now
        compute(bm, seq, 1)


@pytest.mark.parametrize("chunks", [[10], [5, 12, 3]], ids=["one-shot", "chunked"])
def test_blocks_behind_the_window_are_given_back(chunks):
    bm = BlockManager(32, BS, sliding_window=W)
    seq = make_seq(range(sum(chunks)))
    for n in chunks:
        compute(bm, seq, n)
        assert num_freed_blocks(seq.block_table) == max(0, (seq.num_computed_tokens - W) // BS)
        check(bm, seq)
    for _ in range(30):
        before = bm.num_free_blocks
        decode(bm, seq, 1)
        c = seq.num_computed_tokens
        assert num_freed_blocks(seq.block_table) == (c - W) // BS  # every block ending by c - W, no more
        assert len(held_blocks(seq.block_table)) <= MAX_HELD
        assert bm.num_free_blocks == bm.num_blocks - len(held_blocks(seq.block_table))
        if c % BS == 0 and c >= W + BS:  # a block fell behind the window: the free count rises
            assert bm.num_free_blocks == before + 1
        check(bm, seq)
    assert seq.num_computed_tokens == sum(chunks) + 30 and len(seq.block_table) == -(-seq.num_computed_tokens // BS)
    assert bm.num_cached_blocks > 0  # the given-back full blocks stay in the prefix cache
    bm.free(seq)
    check(bm)
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


def test_fork_and_free_skip_placeholders():
    bm = BlockManager(32, BS, sliding_window=W)
    parent = make_seq(range(14))
    compute(bm, parent, 14)
    decode(bm, parent, 7)  # 21 computed: blocks 0..2 behind the window
    assert num_freed_blocks(parent.block_table) == 3
    child = make_seq(range(14))
    child.token_ids = list(parent.token_ids)
    bm.fork(parent, child)  # n > 1 and beam search fork like this
    check(bm, parent, child)
    assert all(bm.ref_counts[b] == 2 for b in held_blocks(parent.block_table))
    decode(bm, parent, 9, first_token=2000)  # the shared partial block is copied on write, then both move on
    decode(bm, child, 9, first_token=3000)
    check(bm, parent, child)
    assert len(held_blocks(parent.block_table)) <= MAX_HELD and len(held_blocks(child.block_table)) <= MAX_HELD
    bm.free(parent)
    check(bm, child)
    bm.free(child)
    check(bm)
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


def test_prefix_hit_on_given_back_blocks():
    bm = BlockManager(32, BS, sliding_window=W)
    first = make_seq(range(30))
    compute(bm, first, 30)
    assert num_freed_blocks(first.block_table) == 5
    second = make_seq(range(30))
    bm.match_prefix(second)  # the chain runs through blocks `first` gave back: still valid
    assert second.num_computed_tokens == 28
    assert num_freed_blocks(second.block_table) == 5  # and the hit itself holds only the window
    check(bm, first, second)
    for s in (first, second):
        bm.free(s)
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


def test_nothing_given_back_without_a_window_or_for_a_context_only_prompt():
    plain = BlockManager(32, BS)
    seq = make_seq(range(30))
    compute(plain, seq, 30)
    assert plain.free_behind_window(seq) == 0 and FREED not in seq.block_table
    bm = BlockManager(32, BS, sliding_window=W)
    ctx = make_seq(range(30), context_only=True)  # its whole prompt is exported to a decode instance
    compute(bm, ctx, 30)
    assert FREED not in ctx.block_table


def test_pins_and_kv_export_skip_placeholders():
    bm = BlockManager(8, 2, sliding_window=4)
    seq = make_seq(range(9))
    compute(bm, seq, 9)  # blocks 0 and 1 (positions 0..3) given back
    assert seq.block_table[:2] == [FREED, FREED]
    bm.retain(seq.block_table)
    check_refs = [bm.ref_counts[b] for b in held_blocks(seq.block_table)]
    assert check_refs == [2, 2, 2]
    bm.release(seq.block_table)
    bm.free(seq)
    assert bm.num_free_blocks == bm.num_blocks
    # export: positions behind the window come out as zeros, the rest as written; import writes the held part
    caches = [torch.randn(2, 8, 2, 1, 3) for _ in range(2)]
    table = [FREED, FREED, 5, 3, 6]
    kv = gather_prompt_kv(caches, table, 9)
    assert kv.shape == (2, 2, 9, 1, 3) and not kv[:, :, :4].any()
    assert torch.equal(kv[0, :, 4:6], caches[0][:, 5].reshape(2, 2, 1, 3))
    fresh = [torch.zeros_like(c) for c in caches]
    scatter_prompt_kv(fresh, table, kv)
    assert torch.equal(gather_prompt_kv(fresh, table, 9), kv) and not fresh[0][:, [0, 1, 2, 4, 7]].any()


# ---------------------------------------------------------------------------- the whole engine, a tiny Mistral

transformers = pytest.importorskip("transformers")

from test_model_families import COMMON  # noqa: E402
from test_model_tiny import greedy, hf_greedy  # noqa: E402
from tiny_llama import Tiny, _tokens, redraw_weights  # noqa: E402

from petrel.config import EngineConfig  # noqa: E402
from petrel.engine.engine_core import EngineCore  # noqa: E402
from petrel.engine.kv_capacity import kv_groups_of  # noqa: E402
from petrel.engine.model_runner import kv_bytes_per_block  # noqa: E402
from petrel.model.loader import load_model, resolve_model  # noqa: E402

MW, MBS = 24, 4  # the model's window, the engine's block size
MODEL_MAX_HELD = -(-MW // MBS) + 2


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> Tiny:
    config = transformers.MistralConfig(**{**COMMON, "sliding_window": MW})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.MistralForCausalLM(config)
    redraw_weights(hf, 0)
    hf = hf.float().eval()
    path = tmp_path_factory.mktemp("mistral-w24")
    hf.save_pretrained(path, safe_serialization=True)
    model, cfg = load_model(resolve_model(str(path)), torch.float32, "cpu")
    assert cfg.uniform_sliding_window == MW
    return Tiny(hf, model, cfg, str(path))


def run_engine(t: Tiny, requests: dict, free: bool = True, num_blocks: int = 128, **engine_kwargs):
    """Run requests {id: (prompt, params)} to the end; returns ({(id, index): tokens}, core, max blocks held by
    one sequence after any step). free=False: the same engine with window freeing switched off."""
    config = EngineConfig(
        dtype="float32",
        device="cpu",
        block_size=MBS,
        kv_cache_memory=num_blocks * kv_bytes_per_block(t.cfg, MBS, torch.float32),
        **engine_kwargs,
    )
    core = EngineCore(config, t.model, t.cfg)
    assert core.block_manager.num_blocks == num_blocks
    if not free:
        core.block_manager.windows = [None]  # nothing is given back behind the window
    for rid, (prompt, params) in requests.items():
        core.add_request(EngineRequest(rid, list(prompt), params, eos_token_ids=tuple(t.cfg.eos_token_ids)))
    results, max_held = {}, 0
    for _ in range(1000):
        if not core.has_work:
            break
        for out in core.step():
            results.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
        core.block_manager.check_integrity()
        max_held = max([max_held] + [len(held_blocks(s.block_table)) for s in core.scheduler.running])
    assert not core.has_work
    bm = core.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)  # no leak
    return results, core, max_held


def test_engine_matches_no_freeing_and_transformers(mistral):
    requests = {
        "long": (_tokens(30, 1), greedy(70)),  # 100 tokens: 25 blocks, the window is 6
        "short": (_tokens(7, 2), greedy(60)),
        "n2": (_tokens(13, 3), greedy(50, n=2)),  # forked after the prompt
        "beam": (_tokens(11, 4), SamplingParams(use_beam_search=True, beam_width=2, n=2, max_tokens=40)),
    }
    # a 16-token budget: the prompts are prefilled in chunks, mixed with decodes
    freed, core, max_held = run_engine(mistral, requests, max_num_batched_tokens=16)
    kept, _, max_held_kept = run_engine(mistral, requests, free=False, max_num_batched_tokens=16)
    assert freed == kept
    assert max_held <= MODEL_MAX_HELD < max_held_kept
    assert core.scheduler.num_preemptions == 0
    assert len(freed[("long", 0)]) > 2 * MW, "the test needs a generation well past the window"
    for rid in ("long", "short", "n2"):
        expected = hf_greedy(mistral, requests[rid][0], requests[rid][1].max_tokens)
        for index in range(requests[rid][1].n):
            assert freed[(rid, index)] == expected, f"{rid}#{index}"


def test_speculative_decoding_with_freeing(mistral):
    prompt = _tokens(30, 1)
    spec = {"method": "self", "num_speculative_tokens": 3, "draft_num_layers": 1}  # lookahead and rollback
    got, core, max_held = run_engine(mistral, {"r": (prompt, greedy(40))}, speculative_config=spec)
    assert core.num_draft_tokens > 0 and core.num_accepted_tokens < core.num_draft_tokens  # drafts were rejected
    assert max_held <= MODEL_MAX_HELD
    assert got[("r", 0)] == hf_greedy(mistral, prompt, 70)[:40]  # greedy: a prefix of the longer generation


def test_lookahead_decoding_with_freeing(mistral):
    """A draft tree's rows see their window by the drafts' positions (not their cache slots), past blocks given
    back behind it."""
    prompt = _tokens(30, 1)
    spec = {"method": "lookahead", "max_window_size": 4, "max_ngram_size": 3, "max_verification_set_size": 4}
    got, core, max_held = run_engine(mistral, {"r": (prompt, greedy(60))}, speculative_config=spec)
    assert core.num_accepted_tokens > 0
    assert max_held <= MODEL_MAX_HELD + 4  # the tree's slots run a few blocks ahead of the sequence
    assert got[("r", 0)] == hf_greedy(mistral, prompt, 70)[:60]


def test_cache_smaller_than_the_sequence(mistral):
    prompt = _tokens(20, 5)
    # 16 blocks = 64 tokens for a 100-token sequence: it completes only because it gives blocks back
    got, core, max_held = run_engine(mistral, {"r": (prompt, greedy(80))}, num_blocks=16, max_num_batched_tokens=16)
    assert core.max_model_len == COMMON["max_position_embeddings"]  # not capped by the cache
    assert len(prompt) + len(got[("r", 0)]) > 16 * MBS
    assert core.scheduler.num_preemptions == 0 and max_held <= MODEL_MAX_HELD
    assert got[("r", 0)] == hf_greedy(mistral, prompt, 80)


def test_mixed_windows_get_a_block_table_per_group(mistral):
    cfg = mistral.cfg
    assert dataclasses.replace(cfg, sliding_windows=[None, MW]).uniform_sliding_window is None
    assert dataclasses.replace(cfg, sliding_windows=[MW, 8]).uniform_sliding_window is None
    assert dataclasses.replace(cfg, sliding_windows=[]).uniform_sliding_window is None
    config = EngineConfig(
        dtype="float32",
        device="cpu",
        block_size=MBS,
        max_model_len=200,
        kv_cache_memory=16 * kv_bytes_per_block(cfg, MBS, torch.float32),
    )
    mixed = EngineCore(config, mistral.model, dataclasses.replace(cfg, sliding_windows=[None, MW]))
    # (tests/test_hybrid_kv.py runs such a model) a block id holds one layer: twice the ids, each sequence
    # takes one per block in the global table, so the context is capped as before
    assert mixed.block_manager.windows == [None, MW] and mixed.block_manager.num_blocks == 32
    assert mixed.max_model_len == 16 * MBS
    # a draft model reads the target's block tables with one table of its own: everything stays in one, kept
    drafted = dataclasses.replace(config, speculative_config={"method": "draft_model", "draft_model": "x"})
    groups = kv_groups_of(drafted, dataclasses.replace(cfg, sliding_windows=[None, MW]))
    assert groups.windows == (None,) and groups.layers_per_block == 2
