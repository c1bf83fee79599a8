"""Partial reuse (KvCacheConfig.enable_partial_reuse / copy_on_partial_reuse; petrel/engine/block_manager.py): the
block after a prefix hit takes its first tokens from a cached block that shares them, copied into a fresh block or
taken over. First the block manager alone, then through the Executor on the tiny random Llama: the reused tokens
are counted, and the generation logits equal those of an engine that recomputes them."""

from __future__ import annotations

import itertools

import pytest
import torch

from petrel.config import EngineConfig
from petrel.engine.block_manager import BlockManager
from petrel.engine.sequence import EngineRequest, Sequence
from petrel.executor import Executor, ExecutorConfig, KvCacheConfig, OutputConfig, Request
from petrel.sampling_params import SamplingParams

BS = 4
_ids = itertools.count()


def make_seq(tokens) -> Sequence:
    req = EngineRequest(f"p-{next(_ids)}", list(tokens), SamplingParams(max_tokens=8))
    seq = Sequence(req, 0, req.prompt_token_ids, len(req.prompt_token_ids))
    req.seqs.append(seq)
    return seq


def computed(bm: BlockManager, tokens, free: bool = True) -> Sequence:
    seq = make_seq(tokens)
    bm.match_prefix(seq)
    assert bm.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed_blocks(seq)
    if free:
        bm.free(seq)
    return seq


def partial_manager(copy: bool) -> BlockManager:
    bm = BlockManager(16, BS)
    bm.partial_reuse, bm.copy_on_partial_reuse = True, copy
    return bm


FIRST = list(range(100, 110))  # blocks [100..103], [104..107] cached; 108, 109 in a partial block


def test_copy_on_partial_reuse_copies_the_matching_part_into_a_fresh_block():
    bm = partial_manager(copy=True)
    first = computed(bm, FIRST, free=False)  # still running: its blocks are in use
    second = make_seq(FIRST[:6] + [7, 8, 9])  # one whole block, then 2 of the next block's tokens
    bm.match_prefix(second)
    assert second.num_computed_tokens == 6 and second.num_cached_tokens == 6
    src = first.block_table[1]
    [(copied_from, fresh)] = bm.pending_copies
    assert copied_from == src and second.block_table == [first.block_table[0], fresh] and fresh != src
    assert bm.ref_counts[src] == 2  # held for the copy until the runner takes it
    bm.take_pending_copies()
    assert bm.ref_counts[src] == 1 and src in bm.block_hash  # still cached: the copy leaves it as it was
    assert bm.allocate_slots(second, 3)
    for s in (first, second):
        bm.free(s)
    bm.check_integrity()
    assert not any(bm.ref_counts)


def test_without_copy_a_block_is_taken_over_only_when_nobody_uses_it():
    bm = partial_manager(copy=False)
    first = computed(bm, FIRST, free=False)
    busy = make_seq(FIRST[:6] + [7, 8, 9])
    bm.match_prefix(busy)
    assert busy.num_computed_tokens == 4  # the matching block is in use: whole blocks only
    bm.free(busy)
    src, src_hash = first.block_table[1], first.block_hashes[1]
    bm.free(first)
    taker = make_seq(FIRST[:7] + [7, 8])
    bm.match_prefix(taker)
    assert taker.num_computed_tokens == 7 and taker.block_table[1] == src and not bm.pending_copies
    assert src not in bm.block_hash and bm.hash_to_block.get(src_hash) is None  # out of the cache
    bm.free(taker)
    bm.check_integrity()
    off = BlockManager(16, BS)  # partial reuse off: whole blocks only
    computed(off, FIRST)
    seq = make_seq(FIRST[:6] + [7, 8, 9])
    off.match_prefix(seq)
    assert seq.num_computed_tokens == 4


# ------------------------------------------------------------------------------------------- the Executor
def executor(tiny, tokenizer_dir, **kv) -> Executor:
    config = EngineConfig.from_kwargs(
        model=tiny(2, False).path, tokenizer=tokenizer_dir, kv_cache_memory=1 << 20, block_size=BS
    )
    return Executor(config, ExecutorConfig(kv_cache_config=KvCacheConfig(**kv)))


def generate(ex: Executor, ids) -> torch.Tensor:
    oc = OutputConfig(exclude_input_from_output=True, return_generation_logits=True)
    rid = ex.enqueue_request(Request(list(ids), 6, bad_words=[[2]], output_config=oc))
    r = ex.await_responses(rid, timeout=60)[-1]
    assert not r.has_error(), r.error_msg
    return r.result.generation_logits[0]


PROMPT = [(i * 29 + 3) % 250 + 3 for i in range(18)]
SIBLING = PROMPT[:14] + [5, 6, 7, 8, 9]  # shares 3 whole blocks and 2 tokens of the fourth


@pytest.mark.parametrize("copy", [True, False])
def test_partially_reused_tokens_give_the_logits_of_recomputing_them(tiny, tokenizer_dir, copy):
    with executor(tiny, tokenizer_dir, enable_block_reuse=False) as ex:
        want = generate(ex, SIBLING)
    with executor(tiny, tokenizer_dir, enable_partial_reuse=True, copy_on_partial_reuse=copy) as ex:
        generate(ex, PROMPT)
        before = ex.engine.call(lambda core: core.scheduler.prefix_hit_tokens)
        got = generate(ex, SIBLING)
        assert ex.engine.call(lambda core: core.scheduler.prefix_hit_tokens) - before == 14
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with executor(tiny, tokenizer_dir) as ex:  # petrel's default: whole blocks only
        generate(ex, PROMPT)
        before = ex.engine.call(lambda core: core.scheduler.prefix_hit_tokens)
        generate(ex, SIBLING)
        assert ex.engine.call(lambda core: core.scheduler.prefix_hit_tokens) - before == 12
