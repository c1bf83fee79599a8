"""Scheduler unit tests with a fake runner: pure Python, no model, no tensors.

The fake runner mimics EngineCore.step: every scheduled sequence advances ``num_computed_tokens`` by its
share, its full blocks are published, and a sequence that reached its last token gets one new token
(deterministic, so a recomputed sequence produces the same tokens); it finishes at ``max_tokens``.
"""

from __future__ import annotations

import itertools

from petrel.engine.block_manager import BlockManager
from petrel.engine.scheduler import ScheduledBatch, Scheduler
from petrel.engine.sequence import EngineRequest, Sequence, SequenceStatus
from petrel.sampling_params import SamplingParams

BS = 4
_ids = itertools.count()


def make_seq(tokens, max_tokens=4, salt=None):
    req = EngineRequest(f"req-{next(_ids)}", list(tokens), SamplingParams(max_tokens=max_tokens), cache_salt=salt)
    seq = Sequence(req, 0, req.prompt_token_ids, len(req.prompt_token_ids))
    req.seqs.append(seq)
    return seq


def next_token(seq: Sequence) -> int:
    """Deterministic in (request, position): recomputation after preemption yields the same tokens."""
    return (int(seq.request.request_id.split("-")[1]) * 7919 + seq.num_tokens * 31) % 50000


def expected_tokens(seq: Sequence) -> list[int]:
    toks = list(seq.request.prompt_token_ids)
    probe = Sequence(seq.request, 0, toks, len(toks))
    for _ in range(seq.params.max_tokens):
        probe.token_ids.append(next_token(probe))
    return probe.token_ids


def make_scheduler(
    num_blocks=64,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    enable_chunked_prefill=True,
    enable_prefix_caching=True,
    watermark=0.0,
):
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=enable_prefix_caching, watermark=watermark)
    return Scheduler(bm, max_num_seqs, max_num_batched_tokens, enable_chunked_prefill)


def check_state(sched: Scheduler) -> None:
    bm = sched.block_manager
    bm.check_integrity()
    counts = [0] * bm.num_blocks
    for s in sched.running:
        assert s.status is SequenceStatus.RUNNING
        for b in s.block_table:
            counts[b] += 1
    assert counts == bm.ref_counts, "ref counts do not match the running sequences' block tables"
    for s in sched.waiting:
        assert s.status is SequenceStatus.WAITING
        assert s.block_table == [] and s.num_computed_tokens == 0, "a waiting sequence holds blocks"
    assert len(sched.running) <= sched.max_num_seqs


def check_batch(sched: Scheduler, batch: ScheduledBatch) -> None:
    assert len(batch.seqs) == len(batch.num_new_tokens)
    assert len({id(s) for s in batch.seqs}) == len(batch.seqs), "a sequence is scheduled twice"
    assert batch.num_tokens <= sched.max_num_batched_tokens
    assert all(n >= 1 for n in batch.num_new_tokens)
    for s, n in zip(batch.seqs, batch.num_new_tokens):
        assert s in sched.running and s not in batch.preempted
        assert s.num_computed_tokens + n <= s.num_tokens
        assert len(s.block_table) * BS >= s.num_computed_tokens + n, "no room for the new KV entries"
    # decodes (single-token queries) first
    ns = batch.num_new_tokens
    first_multi = next((i for i, n in enumerate(ns) if n != 1), len(ns))
    assert all(n != 1 for n in ns[first_multi:]), f"a decode comes after a prefill chunk: {ns}"


def fake_execute(sched: Scheduler, batch: ScheduledBatch) -> list[Sequence]:
    """EngineCore.step without a model. Returns the sequences that finished."""
    bm = sched.block_manager
    sampled = []
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        reaches_end = seq.num_computed_tokens + n == seq.num_tokens
        seq.num_computed_tokens += n
        bm.cache_computed_blocks(seq)
        if reaches_end:
            sampled.append(seq)
    finished = []
    for seq in sampled:
        seq.token_ids.append(next_token(seq))
        if seq.num_output_tokens >= seq.params.max_tokens:
            sched.finish(seq)
            finished.append(seq)
    return finished


def step(sched: Scheduler) -> tuple[ScheduledBatch, list[Sequence]]:
    batch = sched.schedule()
    check_state(sched)
    check_batch(sched, batch)
    finished = fake_execute(sched, batch)
    check_state(sched)
    return batch, finished


def run_to_completion(sched: Scheduler, max_steps=1000) -> list[ScheduledBatch]:
    batches = []
    for _ in range(max_steps):
        if not sched.has_work:
            return batches
        batch, _ = step(sched)
        assert len(batch) > 0, "no progress while there is work"
        batches.append(batch)
    raise AssertionError("did not finish")


def scheduled_tokens(batches, seq) -> list[int]:
    return [n for b in batches for s, n in zip(b.seqs, b.num_new_tokens) if s is seq]


# ---------------------------------------------------------------------------- admission


def test_empty_scheduler():
    sched = make_scheduler()
    assert not sched.has_work
    batch = sched.schedule()
    assert len(batch) == 0 and batch.num_tokens == 0 and batch.block_copies == [] and batch.preempted == []


def test_admission_is_fifo():
    sched = make_scheduler(max_num_seqs=2)
    seqs = [make_seq([10 * i + j for j in range(1, 6)], max_tokens=2) for i in range(1, 5)]
    for s in seqs:
        sched.add(s)
    assert list(sched.waiting) == seqs
    batch, _ = step(sched)
    assert batch.seqs == seqs[:2]
    assert sched.running == seqs[:2]
    assert list(sched.waiting) == seqs[2:]
    order = list(batch.seqs)
    for b in run_to_completion(sched):
        for s in b.seqs:
            if s not in order:
                order.append(s)
    assert order == seqs  # first scheduled in arrival order
    assert all(s.is_finished and s.num_output_tokens == 2 for s in seqs)


def test_max_num_seqs_cap():
    sched = make_scheduler(max_num_seqs=3)
    seqs = [make_seq([i, i + 1, i + 2], max_tokens=3) for i in range(0, 700, 100)]
    for s in seqs:
        sched.add(s)
    saw_full = False
    while sched.has_work:
        batch, _ = step(sched)
        assert len(sched.running) <= 3 and len(batch) <= 3
        saw_full |= len(sched.running) == 3
    assert saw_full
    assert all(s.is_finished and s.num_output_tokens == 3 for s in seqs)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_token_budget_per_step():
    budget = 16
    sched = make_scheduler(max_num_batched_tokens=budget, max_num_seqs=6)
    seqs = [make_seq(list(range(100 * i, 100 * i + 7 + 3 * i)), max_tokens=5) for i in range(6)]
    for s in seqs:
        sched.add(s)
    batches = run_to_completion(sched)
    assert all(b.num_tokens <= budget for b in batches)
    assert max(b.num_tokens for b in batches) == budget  # the budget is actually used
    for s in seqs:
        # the prompt once, then one token per decode (the last sampled token is never fed back)
        assert sum(scheduled_tokens(batches, s)) == s.num_prompt_tokens + s.params.max_tokens - 1
        assert s.token_ids == expected_tokens(s)


# ---------------------------------------------------------------------------- chunked prefill


def test_chunked_prefill_alongside_decodes():
    budget = 16
    sched = make_scheduler(max_num_batched_tokens=budget)
    short = make_seq([1, 2, 3, 4], max_tokens=10)
    sched.add(short)
    step(sched)  # short prefilled, now decoding
    assert short.num_output_tokens == 1

    long = make_seq(list(range(100, 140)), max_tokens=2)  # 40 tokens > budget
    sched.add(long)
    chunks = []
    while long.num_output_tokens == 0:
        batch, _ = step(sched)
        assert short in batch.seqs, "the decode stalled during the chunked prefill"
        assert batch.seqs[0] is short and batch.num_new_tokens[0] == 1
        assert batch.num_tokens <= budget
        i = batch.seqs.index(long)
        chunks.append(batch.num_new_tokens[i])
    assert chunks == [15, 15, 10]
    assert sum(chunks) == long.num_prompt_tokens
    run_to_completion(sched)
    assert short.token_ids == expected_tokens(short) and long.token_ids == expected_tokens(long)


def test_long_prompt_alone_is_chunked_at_the_budget():
    sched = make_scheduler(max_num_batched_tokens=8)
    seq = make_seq(list(range(1, 21)), max_tokens=2)
    sched.add(seq)
    batches = run_to_completion(sched)
    assert [b.num_new_tokens for b in batches] == [[8], [8], [4], [1]]
    assert seq.num_output_tokens == 2


def test_decodes_are_ordered_first():
    sched = make_scheduler(max_num_batched_tokens=32)
    a = make_seq(list(range(1, 11)), max_tokens=5)
    sched.add(a)
    step(sched)
    b = make_seq(list(range(50, 60)), max_tokens=5)
    sched.add(b)
    batch, _ = step(sched)
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 10]

    # a running sequence still mid-prefill placed before decoding ones: the decodes still go first
    c = make_seq(list(range(200, 240)), max_tokens=2)  # 40 tokens, 30 fit beside the two decodes
    sched.add(c)
    batch, _ = step(sched)
    # decodes first, shortest context first (b's context is one token shorter than a's)
    assert b.num_computed_tokens < a.num_computed_tokens
    assert batch.seqs == [b, a, c] and batch.num_new_tokens == [1, 1, 30]
    sched.running = [c, a, b]  # as if c were the oldest
    batch = sched.schedule()
    check_batch(sched, batch)
    assert batch.seqs == [b, a, c] and batch.num_new_tokens == [1, 1, 10]


# ---------------------------------------------------------------------------- preemption


def test_preemption_when_blocks_run_out():
    # 8 blocks of 4: two sequences that grow to 20 tokens (5 blocks each) cannot both hold them
    sched = make_scheduler(num_blocks=8, max_num_seqs=2, max_num_batched_tokens=64)
    bm = sched.block_manager
    baseline = bm.num_free_blocks
    a = make_seq(list(range(1, 13)), max_tokens=8)
    b = make_seq(list(range(101, 113)), max_tokens=8)
    c = make_seq(list(range(201, 205)), max_tokens=2)
    for s in (a, b, c):
        sched.add(s)

    preempted_at = None
    steps = 0
    while sched.has_work:
        batch, _ = step(sched)
        steps += 1
        assert steps < 200
        if batch.preempted and preempted_at is None:
            preempted_at = steps
            assert batch.preempted == [b], "the newest running sequence is the victim"
            assert b not in batch.seqs and a in batch.seqs
            assert list(sched.waiting) == [b, c], "the victim goes to the front of the queue"
            assert b.status is SequenceStatus.WAITING
            assert b.block_table == [] and b.num_computed_tokens == 0
            assert b.num_output_tokens > 0  # it had generated tokens: they are kept
            assert sched.running == [a]
            assert len(batch) == 1  # nothing admitted in a step that preempted
    assert preempted_at is not None
    assert sched.num_preemptions >= 1
    for s in (a, b, c):
        assert s.is_finished
        assert s.num_output_tokens == s.params.max_tokens
        assert s.token_ids == expected_tokens(s)
    assert bm.num_free_blocks == baseline
    assert bm.num_used_blocks == 0
    bm.check_integrity()


def test_preempted_sequence_resumes_with_prefix_hits():
    sched = make_scheduler(num_blocks=8, max_num_seqs=2, max_num_batched_tokens=64)
    a = make_seq(list(range(1, 13)), max_tokens=8)
    b = make_seq(list(range(101, 113)), max_tokens=8)
    sched.add(a)
    sched.add(b)
    resumed_with = None
    while sched.has_work:
        batch, _ = step(sched)
        if b in batch.seqs and b.num_cached_tokens and resumed_with is None and sched.num_preemptions:
            resumed_with = b.num_cached_tokens
    assert sched.num_preemptions >= 1
    assert resumed_with is not None and resumed_with > 0  # its full blocks stayed cached
    assert b.token_ids == expected_tokens(b)
    assert 0 <= b.num_cached_tokens <= b.num_prompt_tokens


def test_cached_tokens_never_exceed_prompt_after_recompute():
    """After a preemption the sequence recomputes prompt + output; what it reports as cached stays
    a count of prompt tokens."""
    sched = make_scheduler(num_blocks=10, max_num_seqs=2, max_num_batched_tokens=64)
    a = make_seq(list(range(1, 9)), max_tokens=24)  # grows to 32 tokens = 8 blocks
    b = make_seq(list(range(101, 105)), max_tokens=20)  # grows to 24 tokens = 6 blocks
    sched.add(a)
    sched.add(b)
    admitted_prompt_tokens = 0
    while sched.has_work:
        waiting = list(sched.waiting)
        step(sched)
        admitted_prompt_tokens += sum(s.num_prompt_tokens for s in waiting if s not in sched.waiting)
        for s in (a, b):
            assert s.num_cached_tokens <= s.num_prompt_tokens
    assert sched.num_preemptions >= 1
    # the hit-rate counters count prompt tokens, re-admissions included
    assert sched.prefix_queried_tokens == admitted_prompt_tokens > a.num_prompt_tokens + b.num_prompt_tokens
    assert sched.prefix_hit_tokens <= sched.prefix_queried_tokens
    assert a.token_ids == expected_tokens(a) and b.token_ids == expected_tokens(b)


def test_sequence_that_cannot_fit_beside_others_preempts_itself_and_later_runs_alone():
    sched = make_scheduler(num_blocks=6, max_num_seqs=4, max_num_batched_tokens=64)
    seqs = [make_seq(list(range(100 * i, 100 * i + 8)), max_tokens=12) for i in range(1, 4)]
    for s in seqs:
        sched.add(s)
    run_to_completion(sched)
    assert sched.num_preemptions >= 1
    assert all(s.token_ids == expected_tokens(s) for s in seqs)
    assert sched.block_manager.num_used_blocks == 0


# ---------------------------------------------------------------------------- prefix reuse


def test_prefix_reuse_on_admission():
    sched = make_scheduler()
    toks = list(range(1, 21))
    first = make_seq(toks, max_tokens=2)
    sched.add(first)
    run_to_completion(sched)
    assert first.num_cached_tokens == 0

    second = make_seq(toks, max_tokens=2)
    sched.add(second)
    batch, _ = step(sched)
    assert second.num_cached_tokens == 16
    assert batch.seqs == [second] and batch.num_new_tokens == [4]
    assert sched.prefix_hit_tokens == 16 and sched.prefix_queried_tokens == 40
    run_to_completion(sched)
    assert second.token_ids == first.token_ids[:20] + expected_tokens(second)[20:]

    salted = make_seq(toks, max_tokens=1, salt="other")
    sched.add(salted)
    batch, _ = step(sched)
    assert salted.num_cached_tokens == 0 and batch.num_new_tokens == [20]


def test_prefix_reuse_between_concurrent_sequences():
    sched = make_scheduler(max_num_batched_tokens=64)
    toks = list(range(1, 14))
    a = make_seq(toks, max_tokens=6)
    sched.add(a)
    step(sched)
    b = make_seq(toks, max_tokens=6)
    sched.add(b)
    step(sched)
    assert b.num_cached_tokens == 12
    assert b.block_table[:3] == a.block_table[:3]
    assert all(sched.block_manager.ref_counts[x] == 2 for x in a.block_table[:3])
    run_to_completion(sched)
    assert sched.block_manager.num_used_blocks == 0


def test_failed_admission_gives_the_prefix_hit_back():
    sched = make_scheduler(num_blocks=6, max_num_seqs=4, max_num_batched_tokens=64)
    bm = sched.block_manager
    toks = list(range(1, 10))
    warm = make_seq(toks, max_tokens=1)
    sched.add(warm)
    run_to_completion(sched)
    assert bm.num_cached_blocks == 2
    warm_blocks = [bm.hash_to_block[h] for h in warm.block_hashes[:2]]

    hog = make_seq(list(range(100, 115)), max_tokens=4)  # 15 tokens: the 4 free blocks
    sched.add(hog)
    step(sched)
    assert bm.num_cached_blocks == 2 and len(bm.free_blocks) == 0

    blocked = make_seq(toks, max_tokens=1)  # hits 2 cached blocks, needs 1 more: none left
    sched.add(blocked)
    batch, _ = step(sched)
    assert batch.seqs == [hog]
    assert list(sched.waiting) == [blocked]
    assert blocked.block_table == [] and blocked.num_computed_tokens == 0 and blocked.num_cached_tokens == 0
    assert list(bm.evictable) == [warm_blocks[1], warm_blocks[0]]  # given back, tail first
    assert sched.prefix_queried_tokens == 9 + 15  # the failed try is not counted

    run_to_completion(sched)
    assert blocked.is_finished and blocked.num_output_tokens == 1
    assert hog.token_ids == expected_tokens(hog)
    assert bm.num_used_blocks == 0


# ---------------------------------------------------------------------------- finish


def test_finish_is_idempotent_and_frees_blocks():
    sched = make_scheduler()
    bm = sched.block_manager
    a = make_seq(list(range(1, 11)), max_tokens=8)
    b = make_seq(list(range(21, 31)), max_tokens=8)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert bm.num_used_blocks == 6
    sched.finish(a)
    check_state(sched)
    assert a.is_finished and a not in sched.running and a.block_table == []
    assert bm.num_used_blocks == 3
    free = bm.num_free_blocks
    sched.finish(a)
    check_state(sched)
    assert a.is_finished and bm.num_free_blocks == free
    run_to_completion(sched)
    assert b.num_output_tokens == 8
    assert bm.num_used_blocks == 0


def test_finish_a_waiting_sequence():
    sched = make_scheduler(max_num_seqs=1)
    a = make_seq([1, 2, 3], max_tokens=3)
    b = make_seq([4, 5, 6], max_tokens=3)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert list(sched.waiting) == [b]
    sched.finish(b)
    sched.finish(b)
    check_state(sched)
    assert not sched.waiting and b.is_finished
    batches = run_to_completion(sched)
    assert all(b not in batch.seqs for batch in batches)
    assert sched.block_manager.num_used_blocks == 0


# ---------------------------------------------------------------------------- chunked prefill disabled


def test_no_chunked_prefill_defers_a_prompt_that_does_not_fit_beside_others():
    budget = 16
    sched = make_scheduler(max_num_batched_tokens=budget, enable_chunked_prefill=False)
    a = make_seq([1, 2, 3, 4], max_tokens=3)
    sched.add(a)
    step(sched)
    b = make_seq(list(range(100, 116)), max_tokens=2)  # 16 tokens: fits only an empty step
    sched.add(b)
    while a.num_output_tokens < 3:
        batch, _ = step(sched)
        assert batch.seqs == [a] and batch.num_new_tokens == [1], "b must not be split beside a decode"
        assert list(sched.waiting) == [b] and b.block_table == []
    batch, _ = step(sched)
    assert batch.seqs == [b] and batch.num_new_tokens == [16]  # whole prompt in one step
    run_to_completion(sched)
    assert b.token_ids == expected_tokens(b)


def test_no_chunked_prefill_admits_whole_prompts_that_fit():
    sched = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    a = make_seq(list(range(1, 9)), max_tokens=2)
    b = make_seq(list(range(11, 17)), max_tokens=2)
    c = make_seq(list(range(21, 27)), max_tokens=2)  # 8 + 6 fit, + 6 would not
    for s in (a, b, c):
        sched.add(s)
    batch, _ = step(sched)
    assert batch.seqs == [a, b] and batch.num_new_tokens == [8, 6]
    assert list(sched.waiting) == [c]
    batches = run_to_completion(sched)
    for bt in batches:
        for s, n in zip(bt.seqs, bt.num_new_tokens):
            assert n in (1, s.num_prompt_tokens)  # never a partial prompt
    assert all(s.token_ids == expected_tokens(s) for s in (a, b, c))


def test_no_chunked_prefill_still_serves_a_prompt_longer_than_the_budget():
    sched = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    seq = make_seq(list(range(1, 21)), max_tokens=2)
    sched.add(seq)
    batches = run_to_completion(sched)  # no livelock
    assert seq.num_output_tokens == 2
    assert sum(scheduled_tokens(batches, seq)) == 21
