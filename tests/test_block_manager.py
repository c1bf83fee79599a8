"""BlockManager unit tests: pure Python, no model, no tensors.

Every test calls ``check_integrity()`` (and a stricter local check) after each operation.
"""

from __future__ import annotations

import itertools

import pytest

from petrel.engine.block_manager import BlockManager
from petrel.engine.sequence import EngineRequest, Sequence
from petrel.sampling_params import SamplingParams

BS = 4
_ids = itertools.count()


def make_seq(tokens, *, salt=None, prompt_logprobs=None, index=0):
    req = EngineRequest(
        f"req-{next(_ids)}",
        list(tokens),
        SamplingParams(max_tokens=16, prompt_logprobs=prompt_logprobs),
        cache_salt=salt,
    )
    seq = Sequence(req, index, req.prompt_token_ids, len(req.prompt_token_ids))
    req.seqs.append(seq)
    return seq


def check(bm: BlockManager, *seqs: Sequence) -> None:
    """check_integrity plus: each block's ref count equals the number of given block tables holding it
    (pass every sequence that holds blocks), and the free / cached / used sets are disjoint."""
    bm.check_integrity()
    free, cached = list(bm.free_blocks), list(bm.evictable)
    assert len(set(free)) == len(free), "a block is free twice"
    assert not set(free) & set(cached), "a block is both free and cached"
    assert all(b in bm.block_hash for b in cached), "a cached block has no hash"
    assert all(b not in bm.block_hash for b in free), "a free block still has a hash"
    counts = [0] * bm.num_blocks
    for s in seqs:
        for b in s.block_table:
            counts[b] += 1
    assert counts == bm.ref_counts
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks


def run_prefill(bm: BlockManager, seq: Sequence, n: int | None = None) -> None:
    """What a step does for one sequence: allocate, compute, publish."""
    n = seq.num_tokens - seq.num_computed_tokens if n is None else n
    assert bm.allocate_slots(seq, n)
    seq.num_computed_tokens += n
    bm.cache_computed_blocks(seq)


def prompt(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


# ---------------------------------------------------------------------------- construction and counts


def test_rejects_empty_pool():
    with pytest.raises(ValueError):
        BlockManager(0, BS)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


def test_initial_state():
    bm = BlockManager(8, BS)
    check(bm)
    assert bm.num_free_blocks == 8
    assert bm.num_used_blocks == 0
    assert bm.num_cached_blocks == 0


def test_allocation_counts_and_ref_counts():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    seq = make_seq(prompt(1, 10))
    assert bm.allocate_slots(seq, 10)
    check(bm, seq)
    assert len(seq.block_table) == 3  # ceil(10 / 4)
    assert len(set(seq.block_table)) == 3
    assert all(bm.ref_counts[b] == 1 for b in seq.block_table)
    assert bm.num_free_blocks == 5 and bm.num_used_blocks == 3

    other = make_seq(prompt(100, 5))
    assert bm.allocate_slots(other, 5)
    check(bm, seq, other)
    assert not set(seq.block_table) & set(other.block_table)
    assert bm.num_free_blocks == 3

    bm.free(seq)
    check(bm, other)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 0  # caching off: nothing is kept
    bm.free(other)
    check(bm)
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0


def test_incremental_allocation_only_adds_blocks_at_boundaries():
    bm = BlockManager(8, BS)
    seq = make_seq(prompt(1, 4))
    run_prefill(bm, seq)
    check(bm, seq)
    assert len(seq.block_table) == 1
    for expected_blocks in (2, 2, 2, 2, 3):  # tokens 5..9
        seq.token_ids.append(1000 + seq.num_tokens)
        run_prefill(bm, seq, 1)
        check(bm, seq)
        assert len(seq.block_table) == expected_blocks
    assert seq.num_computed_tokens == 9
    assert bm.num_used_blocks == 3


def test_zero_new_tokens_allocates_nothing():
    bm = BlockManager(4, BS)
    seq = make_seq(prompt(1, 4))
    assert bm.allocate_slots(seq, 0)
    check(bm, seq)
    assert seq.block_table == [] and bm.num_free_blocks == 4


def test_free_keeps_full_computed_blocks_cached():
    bm = BlockManager(8, BS)
    seq = make_seq(prompt(1, 10))
    run_prefill(bm, seq)
    check(bm, seq)
    assert len(seq.block_hashes) == 2  # only full blocks are hashed
    assert sum(1 for b in seq.block_table if b in bm.block_hash) == 2
    assert seq.block_table[2] not in bm.block_hash  # the partial block is never published
    bm.free(seq)
    check(bm)
    assert bm.num_cached_blocks == 2
    assert bm.num_free_blocks == 8  # cached blocks still count as allocatable
    assert bm.num_used_blocks == 0


# ---------------------------------------------------------------------------- prefix hits


def test_prefix_hit_while_first_sequence_still_running():
    bm = BlockManager(16, BS)
    toks = prompt(1, 10)
    a = make_seq(toks)
    run_prefill(bm, a)
    b = make_seq(toks)
    bm.match_prefix(b)
    check(bm, a, b)
    assert b.block_table == a.block_table[:2]
    assert b.num_computed_tokens == b.num_cached_tokens == 8
    assert [bm.ref_counts[x] for x in a.block_table] == [2, 2, 1]
    assert bm.allocate_slots(b, 2)
    check(bm, a, b)
    assert len(b.block_table) == 3 and b.block_table[2] != a.block_table[2]
    assert bm.num_used_blocks == 4


def test_prefix_hit_from_cached_blocks_after_free():
    bm = BlockManager(16, BS)
    toks = prompt(1, 10)
    a = make_seq(toks)
    run_prefill(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)
    check(bm)
    assert bm.num_cached_blocks == 2

    b = make_seq(toks)
    bm.match_prefix(b)
    check(bm, b)
    assert b.block_table == a_blocks[:2]
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8
    assert bm.num_cached_blocks == 0  # taken back out of the evictable set
    assert all(bm.ref_counts[x] == 1 for x in b.block_table)
    assert bm.num_free_blocks == 14


def test_partial_prefix_hit_stops_at_first_difference():
    bm = BlockManager(16, BS)
    a = make_seq(prompt(1, 13))
    run_prefill(bm, a)  # publishes 3 full blocks
    toks = a.token_ids[:8] + [999, 998, 997, 996, 995]
    b = make_seq(toks)
    bm.match_prefix(b)
    check(bm, a, b)
    assert b.block_table == a.block_table[:2]
    assert b.num_cached_tokens == 8


@pytest.mark.parametrize("length,expected_hit", [(1, 0), (4, 0), (5, 4), (8, 4), (9, 8), (12, 8), (13, 12)])
def test_match_never_covers_the_whole_prompt(length, expected_hit):
    bm = BlockManager(16, BS)
    toks = prompt(1, length)
    a = make_seq(toks)
    run_prefill(bm, a)
    assert len(a.block_hashes) == length // BS  # every full block is published
    b = make_seq(toks)
    bm.match_prefix(b)
    check(bm, a, b)
    assert b.num_computed_tokens == expected_hit
    assert b.num_tokens - b.num_computed_tokens >= 1  # a token is left to compute


def test_hash_chain_same_tokens_different_parent_is_not_a_hit():
    bm = BlockManager(16, BS)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    run_prefill(bm, a)
    # block 1 has the same tokens as a's block 1, but block 0 differs
    b = make_seq([11, 12, 13, 14, 5, 6, 7, 8, 9])
    bm.match_prefix(b)
    check(bm, a, b)
    assert b.block_table == [] and b.num_cached_tokens == 0
    assert b.block_hashes[1] != a.block_hashes[1]
    assert b.block_hashes[1] not in bm.hash_to_block
    # the hashes of identical chains agree
    c = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.match_prefix(c)
    assert c.block_hashes == a.block_hashes[:2]


def test_hash_depends_on_block_tokens():
    bm = BlockManager(16, BS)
    a = make_seq([1, 2, 3, 4, 5])
    b = make_seq([1, 2, 3, 5, 5])
    bm.match_prefix(a)
    bm.match_prefix(b)
    assert a.block_hashes[0] != b.block_hashes[0]


def test_token_equality_check_rejects_a_hash_collision():
    bm = BlockManager(16, BS)
    a = make_seq(prompt(1, 9))
    run_prefill(bm, a)
    b = make_seq(prompt(50, 9))
    bm.match_prefix(b)  # computes b's hashes, no hit
    assert b.block_table == []
    # forge a collision: b's first-block hash now points at a's first block (different tokens)
    bm.hash_to_block[b.block_hashes[0]] = a.block_table[0]
    b2 = make_seq(prompt(50, 9))
    bm.match_prefix(b2)
    check(bm, a, b2)
    assert b2.block_table == [] and b2.num_computed_tokens == 0
    assert bm.ref_counts[a.block_table[0]] == 1


def test_token_equality_check_after_block_tokens_tampered():
    bm = BlockManager(16, BS)
    a = make_seq(prompt(1, 9))
    run_prefill(bm, a)
    bm.block_tokens[a.block_table[1]] = (0, 0, 0, 0)
    b = make_seq(prompt(1, 9))
    bm.match_prefix(b)
    check(bm, a, b)
    assert b.block_table == a.block_table[:1]  # stops at the block whose tokens differ
    assert b.num_computed_tokens == 4


def test_same_content_computed_twice_keeps_the_first():
    bm = BlockManager(16, BS)
    toks = prompt(1, 9)
    a, b = make_seq(toks), make_seq(toks)
    assert bm.allocate_slots(a, 9) and bm.allocate_slots(b, 9)
    a.num_computed_tokens = b.num_computed_tokens = 9
    bm.cache_computed_blocks(a)
    bm.cache_computed_blocks(b)
    check(bm, a, b)
    assert bm.hash_to_block[a.block_hashes[0]] == a.block_table[0]
    assert all(x not in bm.block_hash for x in b.block_table)
    bm.free(b)
    check(bm, a)
    assert bm.num_cached_blocks == 0  # b's duplicates were never published: plain free
    bm.free(a)
    check(bm)
    assert bm.num_cached_blocks == 2


def test_prefix_caching_disabled():
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    toks = prompt(1, 9)
    a = make_seq(toks)
    run_prefill(bm, a)
    assert bm.block_hash == {} and bm.hash_to_block == {}
    b = make_seq(toks)
    bm.match_prefix(b)
    check(bm, a, b)
    assert b.block_table == [] and b.num_cached_tokens == 0
    bm.free(a)
    check(bm, b)
    assert bm.num_cached_blocks == 0


def test_prompt_logprobs_request_skips_the_prefix_cache():
    bm = BlockManager(16, BS)
    toks = prompt(1, 9)
    a = make_seq(toks)
    run_prefill(bm, a)
    b = make_seq(toks, prompt_logprobs=1)
    bm.match_prefix(b)
    check(bm, a, b)
    assert b.block_table == [] and b.num_computed_tokens == 0


# ---------------------------------------------------------------------------- isolation


def test_cache_salt_isolation():
    bm = BlockManager(32, BS)
    toks = prompt(1, 9)
    a = make_seq(toks, salt="tenant-a")
    run_prefill(bm, a)
    bm.free(a)
    check(bm)

    for other_salt in ("tenant-b", None):
        b = make_seq(toks, salt=other_salt)
        bm.match_prefix(b)
        check(bm, b)
        assert b.block_table == [] and b.num_cached_tokens == 0
        assert b.block_hashes[0] != a.block_hashes[0]

    same = make_seq(toks, salt="tenant-a")
    bm.match_prefix(same)
    check(bm, same)
    assert same.num_cached_tokens == 8
    assert same.block_hashes[:2] == a.block_hashes


def test_unsalted_requests_share():
    bm = BlockManager(32, BS)
    toks = prompt(1, 9)
    a = make_seq(toks)
    run_prefill(bm, a)
    b = make_seq(toks)
    bm.match_prefix(b)
    assert b.num_cached_tokens == 8


def test_hash_seed_isolation():
    toks = prompt(1, 9)
    assert BlockManager(4, BS, hash_seed="x").root_hash(None) != BlockManager(4, BS, hash_seed="y").root_hash(None)
    assert BlockManager(4, BS, hash_seed="x").root_hash("s") != BlockManager(4, BS, hash_seed="x").root_hash("t")
    # a salt that spells another salt's adapter or prompt table is still another salt
    bm = BlockManager(4, BS)
    assert bm.root_hash("s:lora=1") != bm.root_hash("s", lora_int_id=1)
    assert bm.root_hash("s:prompt_table=ab") != bm.root_hash("s", prompt_table="ab")
    assert bm.root_hash("\ud800") != bm.root_hash(None)  # any string is a salt (a lone surrogate too)

    def hashes(seed):
        bm = BlockManager(16, BS, hash_seed=seed)
        s = make_seq(toks)
        run_prefill(bm, s)
        return s.block_hashes

    assert hashes("x") == hashes("x")  # deterministic for one seed
    assert hashes("x") != hashes("y")
    hx, hy = hashes("x"), hashes("y")
    assert not set(hx) & set(hy)

    # a manager with another seed does not hit on hashes produced under the first seed
    bm_y = BlockManager(16, BS, hash_seed="y")
    producer = make_seq(toks)
    run_prefill(bm_y, producer)
    assert all(h not in bm_y.hash_to_block for h in hx)


# ---------------------------------------------------------------------------- LRU eviction


def test_lru_eviction_least_recently_released_first_and_tail_before_head():
    bm = BlockManager(6, BS)
    a = make_seq(prompt(1, 8))
    b = make_seq(prompt(100, 8))
    run_prefill(bm, a)
    run_prefill(bm, b)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.free(a)  # released first: least recently used
    bm.free(b)
    check(bm)
    assert list(bm.evictable) == [a_blocks[1], a_blocks[0], b_blocks[1], b_blocks[0]]
    assert bm.num_cached_blocks == 4 and len(bm.free_blocks) == 2

    # 3 blocks: the 2 free ones first, then a's tail
    c = make_seq(prompt(500, 12))
    assert bm.allocate_slots(c, 12)
    check(bm, c)
    assert a_blocks[1] in c.block_table and a_blocks[0] not in c.block_table
    assert not set(b_blocks) & set(c.block_table)
    assert a.block_hashes[1] not in bm.hash_to_block
    assert a.block_hashes[0] in bm.hash_to_block

    # a's head is still a hit, its tail is not
    a2 = make_seq(prompt(1, 9))
    bm.match_prefix(a2)
    check(bm, c, a2)
    assert a2.block_table == [a_blocks[0]] and a2.num_cached_tokens == 4
    bm.free(a2)

    # b's blocks are the least recently released now; the next eviction takes b's tail
    d = make_seq(prompt(900, 4))
    assert bm.allocate_slots(d, 4)
    check(bm, c, d)
    assert d.block_table == [b_blocks[1]]
    b2 = make_seq(prompt(100, 9))
    bm.match_prefix(b2)
    check(bm, c, d, b2)
    assert b2.block_table == [b_blocks[0]]


def test_a_hit_refreshes_recency():
    bm = BlockManager(4, BS)
    a = make_seq(prompt(1, 4))
    b = make_seq(prompt(100, 4))
    run_prefill(bm, a)
    run_prefill(bm, b)
    a_block, b_block = a.block_table[0], b.block_table[0]
    bm.free(a)
    bm.free(b)
    # reuse a's block (a hit), then release it: a is now the most recently released
    a2 = make_seq(prompt(1, 5))
    bm.match_prefix(a2)
    assert a2.block_table == [a_block]
    bm.free(a2)
    check(bm)
    assert list(bm.evictable) == [b_block, a_block]
    c = make_seq(prompt(500, 12))  # 3 blocks: 2 free, then b's (LRU) block
    assert bm.allocate_slots(c, 12)
    check(bm, c)
    assert b_block in c.block_table and a_block not in c.block_table
    assert bm.hash_to_block.get(a.block_hashes[0]) == a_block
    assert b.block_hashes[0] not in bm.hash_to_block
    assert b_block not in bm.block_hash and b_block not in bm.block_tokens


def test_free_blocks_are_used_before_cached_ones():
    bm = BlockManager(4, BS)
    a = make_seq(prompt(1, 8))
    run_prefill(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)
    b = make_seq(prompt(100, 8))
    assert bm.allocate_slots(b, 8)
    check(bm, b)
    assert bm.num_cached_blocks == 2  # a's blocks were not evicted
    assert not set(a_blocks) & set(b.block_table)
    a2 = make_seq(prompt(1, 9))
    bm.match_prefix(a2)
    assert a2.num_cached_tokens == 8


# ---------------------------------------------------------------------------- fork and copy-on-write


def fork(bm, parent):
    child = Sequence(parent.request, len(parent.request.seqs), parent.token_ids, parent.num_prompt_tokens)
    parent.request.seqs.append(child)
    bm.fork(parent, child)
    return child


def test_fork_shares_blocks_and_copies_partial_block_on_first_write():
    bm = BlockManager(8, BS)
    parent = make_seq(prompt(1, 6))
    run_prefill(bm, parent)
    child = fork(bm, parent)
    check(bm, parent, child)
    assert child.block_table == parent.block_table
    assert child.num_computed_tokens == 6
    assert all(bm.ref_counts[b] == 2 for b in parent.block_table)
    assert bm.num_used_blocks == 2

    shared_full, shared_partial = parent.block_table
    parent.token_ids.append(7)
    child.token_ids.append(8)

    assert bm.allocate_slots(parent, 1)
    check(bm, parent, child)
    fresh = parent.block_table[1]
    assert fresh != shared_partial
    assert parent.block_table[0] == shared_full
    assert bm.pending_copies == [(shared_partial, fresh)]
    assert bm.ref_counts[shared_partial] == 1 and bm.ref_counts[fresh] == 1
    assert bm.ref_counts[shared_full] == 2

    assert bm.take_pending_copies() == [(shared_partial, fresh)]
    assert bm.take_pending_copies() == []
    assert bm.pending_copies == []

    # the child is now the only owner of the partial block: no copy
    assert bm.allocate_slots(child, 1)
    check(bm, parent, child)
    assert child.block_table == [shared_full, shared_partial]
    assert bm.take_pending_copies() == []
    parent.num_computed_tokens += 1
    child.num_computed_tokens += 1

    # the next write into the same block is not copied again
    parent.token_ids.append(9)
    assert bm.allocate_slots(parent, 1)
    assert bm.take_pending_copies() == []
    assert parent.block_table[1] == fresh

    bm.free(parent)
    bm.free(child)
    check(bm)
    assert bm.num_used_blocks == 0


def test_fork_at_block_boundary_needs_no_copy():
    bm = BlockManager(8, BS)
    parent = make_seq(prompt(1, 8))
    run_prefill(bm, parent)
    child = fork(bm, parent)
    parent.token_ids.append(9)
    child.token_ids.append(10)
    assert bm.allocate_slots(parent, 1) and bm.allocate_slots(child, 1)
    check(bm, parent, child)
    assert bm.take_pending_copies() == []
    assert parent.block_table[:2] == child.block_table[:2]
    assert parent.block_table[2] != child.block_table[2]


def test_fork_with_three_children_copies_for_all_but_the_last_writer():
    bm = BlockManager(8, BS)
    parent = make_seq(prompt(1, 6))
    run_prefill(bm, parent)
    seqs = [parent, fork(bm, parent), fork(bm, parent)]
    partial = parent.block_table[1]
    assert bm.ref_counts[partial] == 3
    copies = []
    for i, s in enumerate(seqs):
        s.token_ids.append(100 + i)
        assert bm.allocate_slots(s, 1)
        check(bm, *seqs)
        copies += bm.take_pending_copies()
    assert len(copies) == 2 and all(src == partial for src, _ in copies)
    assert seqs[2].block_table[1] == partial
    assert len({s.block_table[1] for s in seqs}) == 3


def test_copy_on_write_fails_cleanly_without_a_free_block():
    bm = BlockManager(2, BS)
    parent = make_seq(prompt(1, 6))
    run_prefill(bm, parent)  # both blocks used
    child = fork(bm, parent)
    parent.token_ids.append(7)
    before = (list(bm.ref_counts), list(parent.block_table), list(bm.free_blocks), list(bm.evictable))
    assert not bm.allocate_slots(parent, 1)
    check(bm, parent, child)
    assert (list(bm.ref_counts), list(parent.block_table), list(bm.free_blocks), list(bm.evictable)) == before
    assert bm.pending_copies == []


# ---------------------------------------------------------------------------- running out


def test_allocate_slots_returns_false_and_changes_nothing():
    bm = BlockManager(4, BS)
    a = make_seq(prompt(1, 12))
    run_prefill(bm, a)
    b_seed = make_seq(prompt(200, 4))
    run_prefill(bm, b_seed)
    bm.free(b_seed)  # one cached block left
    check(bm, a)
    assert bm.num_free_blocks == 1

    b = make_seq(prompt(100, 8))  # needs 2
    state = (
        list(bm.ref_counts),
        list(bm.free_blocks),
        list(bm.evictable),
        dict(bm.hash_to_block),
        dict(bm.block_hash),
        dict(bm.block_tokens),
    )
    assert not bm.allocate_slots(b, 8)
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert (
        list(bm.ref_counts),
        list(bm.free_blocks),
        list(bm.evictable),
        dict(bm.hash_to_block),
        dict(bm.block_hash),
        dict(bm.block_tokens),
    ) == state
    check(bm, a)
    # exactly what is left still fits
    assert bm.allocate_slots(b, 4)
    check(bm, a, b)
    assert bm.num_free_blocks == 0
    b.num_computed_tokens = 4
    assert not bm.allocate_slots(b, 1)
    assert len(b.block_table) == 1
    check(bm, a, b)


def test_admission_watermark():
    bm = BlockManager(10, BS, watermark=0.2)
    assert bm.watermark_blocks == 2
    a = make_seq(prompt(1, 28))
    run_prefill(bm, a)  # 7 blocks, 3 left
    assert bm.num_free_blocks == 3

    b = make_seq(prompt(100, 8))  # 2 blocks: 3 - 2 reserved < 2
    assert not bm.allocate_slots(b, 8, admitting=True)
    check(bm, a)
    assert b.block_table == [] and bm.num_free_blocks == 3
    assert bm.allocate_slots(make_seq(prompt(200, 4)), 4, admitting=True)  # 1 block fits above the mark
    assert bm.num_free_blocks == 2
    assert not bm.allocate_slots(b, 4, admitting=True)
    # a running sequence may dig into the reserve
    a.token_ids.extend([7, 7, 7, 7, 7])
    assert bm.allocate_slots(a, 5)
    assert bm.num_free_blocks == 0


def test_default_watermark_is_zero_for_tiny_pools():
    assert BlockManager(8, BS).watermark_blocks == 0
    assert BlockManager(1000, BS).watermark_blocks == 10


# ---------------------------------------------------------------------------- reset


def test_reset_prefix_cache():
    bm = BlockManager(16, BS)
    running_toks, done_toks = prompt(1, 9), prompt(100, 9)
    running = make_seq(running_toks)
    done = make_seq(done_toks)
    run_prefill(bm, running)
    run_prefill(bm, done)
    bm.free(done)
    assert bm.num_cached_blocks == 2
    bm.reset_prefix_cache()
    check(bm, running)
    assert bm.num_cached_blocks == 0
    assert len(bm.free_blocks) == 13
    assert all(h not in bm.hash_to_block for h in done.block_hashes)

    miss = make_seq(done_toks)
    bm.match_prefix(miss)
    check(bm, running, miss)
    assert miss.block_table == []

    # blocks still in use keep their hashes and can still be shared
    hit = make_seq(running_toks)
    bm.match_prefix(hit)
    check(bm, running, miss, hit)
    assert hit.block_table == running.block_table[:2]

    bm.free(hit)
    bm.free(running)
    check(bm)
    assert bm.num_free_blocks == 16
    assert bm.num_cached_blocks == 2


def test_reset_on_empty_and_idle_manager():
    bm = BlockManager(4, BS)
    bm.reset_prefix_cache()
    check(bm)
    assert bm.num_free_blocks == 4
