"""Seeded random operations on the Scheduler and BlockManager, with every invariant checked after each operation.

No model: a fake core does what EngineCore does around the scheduler (schedule; the runner's copy-on-write
copies; compute the scheduled tokens; publish full blocks; fork n > 1 children when the prompt is done; append
sampled tokens; finish; verify speculative drafts; give back blocks behind a sliding window; pin a context-only
prompt's blocks; beam-search steps that fork and drop beams). Between steps it adds requests (shared prefixes,
cache salts, LoRA adapters, priorities, prompt_logprobs, imported KV), aborts requests, ends sequences on a
stop string, releases pins and resets the prefix cache. A small cache makes preemption frequent.

Besides the ref counts, the fake core keeps a shadow of what each KV slot holds (the token whose K/V was written
there), so the checks cover what the bookkeeping is for: every computed position of a running sequence reads its
own token, a block published in the prefix cache holds the tokens its hash claims, and a pinned prompt's blocks
are never overwritten.

Invariants (check_invariants): each block is exactly one of free / cached / used; its ref count equals the number
of (running sequence, group, table position) entries plus pin entries that hold it; waiting and finished sequences
hold nothing; the hash maps are each other's inverse and every cached hash matches the sequence chain of each
holder; sliding-window tables free only a prefix and keep every position the next query sees; and at the end, with
everything finished or aborted, every block is free.
"""

from __future__ import annotations

import functools
import itertools
import random
import time

import pytest

from petrel.engine.block_manager import (
    FREED,
    BlockManager,
    held_blocks,
    num_freed_blocks,
)
from petrel.engine.scheduler import Scheduler
from petrel.engine.sequence import EngineRequest, Sequence, SequenceStatus
from petrel.lora import LoRARequest
from petrel.sampling_params import SamplingParams

BS = 4
VOCAB = 50
WINDOW = 10


def cache_key(group: int, block_hash: bytes):
    """The key BlockManager publishes a group's block under (its documented scheme: the hash, or (group, hash))."""
    return block_hash if group == 0 else (group, block_hash)


class FakeCore:
    """EngineCore's bookkeeping around Scheduler and BlockManager, with a shadow of the KV cache's contents."""

    def __init__(
        self,
        rng: random.Random,
        *,
        num_blocks: int,
        windows: list[int | None],
        prefix_caching: bool,
        chunked: bool,
        budget: int,
        max_num_seqs: int,
        watermark: float,
        max_loras: int | None,
        spec_k: int,
    ):
        self.rng = rng
        self.bm = BlockManager(
            num_blocks, BS, enable_prefix_caching=prefix_caching, watermark=watermark, group_windows=windows
        )
        self.sched = Scheduler(self.bm, max_num_seqs, budget, chunked, max_loras=max_loras)
        self.max_loras = max_loras
        self.spec_k = spec_k
        self.requests: dict[str, EngineRequest] = {}  # unfinished
        self.request_ids = itertools.count()
        self.all_seqs: list[Sequence] = []
        self.pins: list[dict] = []  # {"tables": [[block]], "tokens": [...]}
        self.kv: list[list[int | None]] = [[None] * BS for _ in range(num_blocks)]
        self.prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(8, 20))] for _ in range(4)]
        self.prompts: list[list[int]] = []
        self.stats = dict.fromkeys(
            [
                "steps",
                "forks",
                "beam_forks",
                "beam_drops",
                "copies",
                "preemptions",
                "prefix_hit_tokens",
                "pins",
                "aborts",
                "stops",
                "drafts_accepted",
                "freed_behind_window",
                "imported",
                "resets",
                "preempt_all",
            ],
            0,
        )

    # ------------------------------------------------------------------ requests
    def make_prompt(self) -> list[int]:
        r = self.rng.random()
        if r < 0.45:  # a shared prefix, cut anywhere, and a few tokens of its own
            base = self.rng.choice(self.prefixes)
            prompt = base[: self.rng.randint(1, len(base))] + [
                self.rng.randrange(1, VOCAB) for _ in range(self.rng.randint(0, 5))
            ]
        elif r < 0.65 and self.prompts:
            prompt = list(self.rng.choice(self.prompts))  # the same prompt again
        else:
            prompt = [self.rng.randrange(1, VOCAB) for _ in range(self.rng.randint(1, 22))]
        prompt = prompt[:22]
        self.prompts.append(prompt)
        return prompt

    def add_request(self) -> None:
        rng = self.rng
        kind = rng.choices(["plain", "n", "beam", "context_only", "imported"], [5, 2, 1.5, 1, 1])[0]
        prompt = self.make_prompt()
        max_tokens = rng.randint(1, 16)
        kwargs = dict(max_tokens=max_tokens)
        if kind == "n":
            kwargs["n"] = rng.randint(2, 3)
        elif kind == "beam":
            # every beam must fit the cache at once, or the beams preempt one another forever
            prompt = prompt[:12]
            kwargs.update(
                use_beam_search=True, beam_width=rng.randint(2, 3), temperature=0.0, max_tokens=min(max_tokens, 8)
            )
        elif kind == "imported":
            kwargs["max_tokens"] = max(2, max_tokens)
        if kind in ("plain", "n") and rng.random() < 0.1:
            kwargs["prompt_logprobs"] = 1  # needs every prompt position: no prefix hit
        lora = None
        if self.max_loras and kind in ("plain", "n", "beam") and rng.random() < 0.5:
            lora_id = rng.randint(1, 3)
            lora = LoRARequest(f"adapter-{lora_id}", lora_id, f"/adapters/{lora_id}")
        req = EngineRequest(
            f"r{next(self.request_ids)}",
            prompt,
            SamplingParams(**kwargs),
            cache_salt=rng.choice([None, None, None, "a", "b"]),
            lora_request=lora,
            priority=rng.choice([0.5, 0.5, 0.2, 0.9]),
            context_only=kind == "context_only",
        )
        tokens = list(prompt)
        if kind == "imported":  # a generation-only request: the prompt's KV comes with it, and the first token
            req.imported_kv = object()
            req.first_gen_tokens = [rng.randrange(1, VOCAB)]
            tokens += req.first_gen_tokens
        self.submit(req, tokens)

    def submit(self, req: EngineRequest, tokens: list[int] | None = None) -> None:
        """Queue a request's first sequence (tokens: the prompt, or prompt + first tokens of an imported one)."""
        seq = self.new_seq(req, 0, req.prompt_token_ids if tokens is None else tokens)
        self.requests[req.request_id] = req
        self.sched.add(seq)

    def new_seq(self, req: EngineRequest, index: int, tokens: list[int]) -> Sequence:
        seq = Sequence(req, index, tokens, len(req.prompt_token_ids))
        req.seqs.append(seq)
        self.all_seqs.append(seq)
        return seq

    @staticmethod
    def true_token(seq: Sequence, position: int) -> int:
        """What the fake model samples at a position: fixed per (request, sequence, position), so drafts can be
        right or wrong and a recomputed sequence sees the same tokens."""
        rid = int(seq.request.request_id[1:])
        return (rid * 7919 + seq.index * 104729 + position * 31 + (rid * position) % 17) % (VOCAB - 1) + 1

    def finish(self, seq: Sequence) -> None:
        self.sched.finish(seq)
        self.drop_if_done(seq.request)

    def drop_if_done(self, req: EngineRequest) -> None:
        if all(s.is_finished for s in req.seqs):
            self.requests.pop(req.request_id, None)

    def abort(self) -> None:
        if not self.requests:
            return
        req = self.requests.pop(self.rng.choice(sorted(self.requests)))
        for seq in req.seqs:
            if not seq.is_finished:
                self.sched.finish(seq)
        self.stats["aborts"] += 1

    def stop_string(self) -> None:
        """The front found a stop string in one sequence's text: it ends now (beam requests have none)."""
        seqs = [
            s
            for s in self.sched.running + list(self.sched.waiting)
            if not s.params.use_beam_search and not s.request.context_only and s.num_output_tokens > 0
        ]
        if seqs:
            self.finish(self.rng.choice(seqs))
            self.stats["stops"] += 1

    def release_pin(self) -> None:
        if self.pins:
            pin = self.pins.pop(self.rng.randrange(len(self.pins)))
            for table in pin["tables"]:
                self.bm.release(table)

    def reset_prefix_cache(self) -> None:
        self.bm.reset_prefix_cache()
        self.stats["resets"] += 1

    # ------------------------------------------------------------------ the step
    def lookahead(self, seq: Sequence) -> int:
        """EngineCore's rule for how many draft tokens a running sequence may verify next step."""
        p = seq.params
        if (
            not self.spec_k
            or p.use_beam_search
            or seq.num_output_tokens == 0
            or seq.num_computed_tokens != seq.num_tokens - 1
        ):
            return 0
        return max(0, min(self.spec_k, p.max_tokens - seq.num_output_tokens - 1))

    def write(self, seq: Sequence, start: int, tokens: list[int]) -> None:
        """The runner writes K/V of `tokens` at positions start.. into every group's blocks."""
        for offset, token in enumerate(tokens):
            p = start + offset
            for table in seq.block_tables:
                block = table[p // BS]
                assert block != FREED, f"{seq}: position {p} is written into a block given back behind the window"
                assert self.bm.ref_counts[block] == 1, (
                    f"{seq}: writes into block {block} that another holder shares (missing copy-on-write)"
                )
                assert block not in self.bm.block_hash, f"{seq}: writes into block {block} of the prefix cache"
                self.kv[block][p % BS] = token

    def step(self) -> None:
        sched, bm = self.sched, self.bm
        for seq in sched.running:
            seq.spec.num_lookahead = self.lookahead(seq)
        preemptions = sched.num_preemptions
        idle_before = [s for s in sched.running if s.num_computed_tokens == s.num_tokens]
        batch = sched.schedule()
        self.stats["preemptions"] += sched.num_preemptions - preemptions
        if idle_before and len(batch.preempted) >= len(idle_before) and all(s in batch.preempted for s in idle_before):
            self.stats["preempt_all"] += 1
        for src, dst in batch.block_copies:  # the runner copies first
            self.kv[dst] = list(self.kv[src])
            self.stats["copies"] += 1
        self.stats["steps"] += 1
        if not batch.seqs:
            return
        # the proposer: drafts for sequences given lookahead room (right with probability 0.6 each)
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if n > 1 and seq.num_computed_tokens == seq.num_tokens - 1:
                k = self.rng.randint(0, n - 1)
                seq.spec.draft_token_ids = [
                    self.true_token(seq, seq.num_tokens + j)
                    if self.rng.random() < 0.6
                    else self.rng.randrange(1, VOCAB)
                    for j in range(k)
                ]
                batch.num_new_tokens[i] = 1 + k
        batch.put_decodes_first()
        # the runner: imported prompt KV, then this step's tokens
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.request.imported_kv is not None:
                self.write(seq, 0, seq.token_ids[: seq.num_tokens - 1])
                seq.request.imported_kv = None
                self.stats["imported"] += 1
            self.write(seq, seq.num_computed_tokens, seq.pending_token_ids(n))
        sample = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n - len(seq.spec.draft_token_ids)
            bm.cache_computed_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                sample.append(seq)
        # n > 1: the prompt's sequence forks its siblings when its prompt is done
        for seq in list(sample):
            req = seq.request
            if (
                req.params.n > 1
                and not req.params.use_beam_search
                and len(req.seqs) == 1
                and seq.num_output_tokens == 0
            ):
                prev = seq
                for i in range(1, req.params.n):
                    child = self.new_seq(req, i, seq.token_ids)
                    bm.fork(seq, child)
                    sched.add_running(child, after=prev)
                    sample.append(child)
                    prev = child
                    self.stats["forks"] += 1
        beam_requests = {}
        for seq in sample:
            if seq.params.use_beam_search:
                beam_requests[seq.request.request_id] = seq.request  # it has its candidates now
                continue
            self.append_tokens(seq)
        for req in beam_requests.values():
            if req.request_id in self.requests:
                self.beam_step(req)
        for seq in batch.seqs:  # speculative verification done
            if seq.spec.draft_token_ids:
                seq.spec.draft_token_ids = []
                if not seq.is_finished:
                    seq.num_computed_tokens = seq.num_tokens - 1
                    bm.cache_computed_blocks(seq)
        if bm.frees_blocks:
            for seq in sched.running:
                self.stats["freed_behind_window"] += bm.free_behind_window(seq)

    def append_tokens(self, seq: Sequence) -> None:
        """The sampled token, after each accepted draft; stops at max_tokens, at an 'eos' (5%), and a context-only
        request stops after its first token with its prompt's blocks pinned."""
        drafts = list(seq.spec.draft_token_ids)
        while True:
            token = self.true_token(seq, seq.num_tokens)
            seq.token_ids.append(token)
            if seq.request.context_only:
                bs = BS
                tables = [list(t[: -(-seq.num_prompt_tokens // bs)]) for t in seq.block_tables]
                for table in tables:
                    self.bm.retain(table)
                self.pins.append({"tables": tables, "tokens": seq.token_ids[: seq.num_prompt_tokens]})
                self.stats["pins"] += 1
                self.finish(seq)
                return
            if seq.num_output_tokens >= seq.params.max_tokens or self.rng.random() < 0.05:
                self.finish(seq)
                return
            if not drafts or drafts.pop(0) != token:
                return
            self.stats["drafts_accepted"] += 1

    def beam_step(self, req: EngineRequest) -> None:
        """Once every live beam has its candidates: drop some beams, fork others, append a token to each."""
        beams = [s for s in req.seqs if not s.is_finished]
        if any(s.status is not SequenceStatus.RUNNING or s.num_computed_tokens != s.num_tokens for s in beams):
            return  # some beam is still being (re)computed
        width = req.params.num_beams
        if beams[0].num_output_tokens + 1 >= req.params.max_tokens or self.rng.random() < 0.1:
            for seq in beams:
                self.sched.finish(seq)
            self.requests.pop(req.request_id, None)
            return
        counts = [0] * len(beams)
        for _ in range(self.rng.randint(1, width)):
            counts[self.rng.randrange(len(beams))] += 1
        new_beams = []
        for parent, c in zip(beams, counts):
            if c == 0:
                self.sched.finish(parent)
                req.seqs.remove(parent)
                self.stats["beam_drops"] += 1
                continue
            for _ in range(c - 1):
                child = self.new_seq(req, len(req.seqs), parent.token_ids)
                self.bm.fork(parent, child)
                self.sched.add_running(child, after=parent)
                new_beams.append(child)
                self.stats["beam_forks"] += 1
            new_beams.append(parent)
        for j, seq in enumerate(new_beams):
            seq.token_ids.append((self.true_token(seq, seq.num_tokens) + j) % (VOCAB - 1) + 1)

    # ------------------------------------------------------------------ the invariant
    def check_invariants(self) -> None:
        bm, sched = self.bm, self.sched
        bm.check_integrity()
        n = bm.num_blocks
        free, cached = list(bm.free_blocks), list(bm.evictable)
        assert len(set(free)) == len(free), "a block is free twice"
        assert not set(free) & set(cached), "a block is both free and cached"
        assert all(r >= 0 for r in bm.ref_counts), "a negative ref count"
        used = [b for b in range(n) if bm.ref_counts[b] > 0]
        assert len(free) + len(cached) + len(used) == n, "block states do not add up"
        assert all(b not in bm.block_hash for b in free), "a free block still has a hash"
        assert all(b in bm.block_hash for b in cached), "a cached block has no hash"

        counts = [0] * n
        running = set(map(id, sched.running))
        assert len(running) == len(sched.running), "a sequence runs twice"
        for seq in sched.waiting:
            assert seq.status is SequenceStatus.WAITING and id(seq) not in running
            assert not any(seq.block_tables) and seq.num_computed_tokens == 0, f"waiting {seq} holds blocks"
        for seq in self.all_seqs:
            if seq.is_finished:
                assert not any(seq.block_tables), f"finished {seq} holds blocks"
                assert id(seq) not in running and seq not in sched.waiting
        for seq in sched.running:
            assert seq.status is SequenceStatus.RUNNING
            tables = seq.block_tables
            assert len(tables) == bm.num_groups and len({len(t) for t in tables}) == 1, "tables out of step"
            assert len(tables[0]) * BS >= seq.num_computed_tokens
            assert seq.num_computed_tokens <= seq.num_tokens
            held_by_seq = []
            for g, table in enumerate(tables):
                k = num_freed_blocks(table)
                assert all(b == FREED for b in table[:k]) and all(b >= 0 for b in table[k:]), "FREED not a prefix"
                window = bm.windows[g]
                if window is None:
                    assert k == 0, "a global group gave blocks back"
                else:  # the next query (at num_computed_tokens) sees the positions back to c - window + 1
                    c = seq.num_computed_tokens
                    assert all(table[p // BS] != FREED for p in range(max(0, c - window + 1), c)), (
                        f"{seq}: a position inside the window was given back"
                    )
                for i, block in enumerate(table):
                    if block == FREED:
                        continue
                    counts[block] += 1
                    held_by_seq.append(block)
                    if block in bm.block_hash and i < len(seq.block_hashes):
                        assert bm.block_hash[block] == cache_key(g, seq.block_hashes[i]), (
                            f"{seq}: block {block} is cached under another chain's hash"
                        )
                for p in range(seq.num_computed_tokens):  # every computed position reads its own token
                    block = table[p // BS]
                    if block != FREED:
                        assert self.kv[block][p % BS] == seq.token_ids[p], (
                            f"{seq}: group {g} position {p} holds {self.kv[block][p % BS]}, not {seq.token_ids[p]}"
                        )
            assert len(set(held_by_seq)) == len(held_by_seq), f"{seq} holds a block twice"
        for pin in self.pins:
            for table in pin["tables"]:
                for block in held_blocks(table):
                    counts[block] += 1
                for p, token in enumerate(pin["tokens"]):
                    block = table[p // BS]
                    if block != FREED:
                        assert self.kv[block][p % BS] == token, "a pinned prompt's block was overwritten"
        assert counts == bm.ref_counts, "ref counts differ from the references held: " + str(
            {b: (counts[b], bm.ref_counts[b]) for b in range(n) if counts[b] != bm.ref_counts[b]}
        )

        assert {h: b for b, h in bm.block_hash.items()} == bm.hash_to_block, "hash maps are not each other's inverse"
        assert set(bm.block_tokens) == set(bm.block_hash)
        for block, tokens in bm.block_tokens.items():
            assert self.kv[block] == list(tokens), f"cached block {block} does not hold the tokens its hash claims"

    def check_all_free(self) -> None:
        bm = self.bm
        assert not self.sched.has_work and not self.requests and not self.pins
        assert all(s.is_finished for s in self.all_seqs)
        assert not any(bm.ref_counts), "a block is still referenced with nothing running"
        assert bm.num_free_blocks == bm.num_blocks
        bm.reset_prefix_cache()
        assert len(bm.free_blocks) == bm.num_blocks and not bm.block_hash and not bm.hash_to_block
        bm.check_integrity()


def make_core(seed: int) -> FakeCore:
    """A seeded configuration: one group, one sliding-window group, or a global and a windowed group; prefix
    caching mostly on; chunked prefill on or off; LoRA slots or none; speculative lookahead or none."""
    rng = random.Random(seed)
    windows = [[None], [WINDOW], [None, WINDOW]][seed % 3]
    return FakeCore(
        rng,
        num_blocks=rng.randint(16, 22) * len(windows),
        windows=windows,
        prefix_caching=seed % 7 != 6,
        chunked=rng.random() < 0.75,
        budget=rng.choice([12, 24, 48]),
        max_num_seqs=rng.choice([4, 8, 12]),
        watermark=rng.choice([0.0, 0.05]),
        max_loras=rng.choice([None, 1, 2]),
        spec_k=rng.choice([0, 0, 3]),
    )


OPERATIONS = [
    ("add", 30),
    ("step", 55),
    ("abort", 4),
    ("stop_string", 3),
    ("release_pin", 6),
    ("reset_prefix_cache", 1),
]


@functools.cache
def run_seed(seed: int, num_ops: int = 500) -> FakeCore:
    """num_ops random operations, each followed by the invariant check, then a drain to nothing (cached: the
    coverage test reads the runs of the per-seed tests)."""
    core = make_core(seed)
    names, weights = zip(*OPERATIONS)
    core.check_invariants()
    for _ in range(num_ops):
        op = core.rng.choices(names, weights)[0]
        {
            "add": core.add_request,
            "step": core.step,
            "abort": core.abort,
            "stop_string": core.stop_string,
            "release_pin": core.release_pin,
            "reset_prefix_cache": core.reset_prefix_cache,
        }[op]()
        core.check_invariants()
    # drain: every pin given back, then steps (and a few aborts) until nothing is left; no step may stall
    while core.pins:
        core.release_pin()
        core.check_invariants()
    for _ in range(2000):
        if not core.sched.has_work:
            break
        if core.rng.random() < 0.03:
            core.abort()
        else:
            steps = core.stats["steps"]
            before = [(s.num_computed_tokens, s.num_tokens, s.status) for s in core.all_seqs]
            core.step()
            assert core.stats["steps"] == steps + 1
            assert before != [(s.num_computed_tokens, s.num_tokens, s.status) for s in core.all_seqs], (
                "a step made no progress"
            )
        core.check_invariants()
        while core.pins:
            core.release_pin()
            core.check_invariants()
    else:
        raise AssertionError("the requests did not finish")
    core.stats["prefix_hit_tokens"] = core.sched.prefix_hit_tokens
    core.check_all_free()
    return core


SEEDS = list(range(12))


@pytest.mark.parametrize("seed", SEEDS)
def test_random_operations_keep_the_invariants(seed):
    """500 random operations and the drain, the invariants checked after each; everything ends free."""
    core = run_seed(seed)
    assert core.stats["steps"] > 150
    assert core.stats["forks"] + core.stats["beam_forks"] > 0 and core.stats["copies"] > 0


def test_the_operations_cover_every_path():
    """Over all seeds, every kind of operation the invariants are meant to survive actually happened, and most
    seeds preempted and hit the prefix cache (a seed's cache size, budget and resets decide how often)."""
    start = time.monotonic()
    runs = [run_seed(seed) for seed in SEEDS]
    total = {name: sum(core.stats[name] for core in runs) for name in runs[0].stats}
    missing = [name for name, value in total.items() if value == 0]
    assert not missing, f"never exercised: {missing} ({total})"
    assert sum(core.stats["preemptions"] > 0 for core in runs) >= len(SEEDS) // 2, total
    assert sum(core.stats["prefix_hit_tokens"] > 0 for core in runs) >= len(SEEDS) // 2, total
    assert time.monotonic() - start < 60


def test_forked_sequences_count_against_max_num_seqs():
    """max_num_seqs caps the sequences decoded together (README: "sequences decoded together"; the server counts
    a request's n against it). A request with n=2 is admitted as one sequence and runs as two once its prompt is
    done, so admission has to count its n: four such requests under max_num_seqs=4 must not run as eight."""
    core = FakeCore(
        random.Random(0),
        num_blocks=64,
        windows=[None],
        prefix_caching=True,
        chunked=True,
        budget=64,
        max_num_seqs=4,
        watermark=0.0,
        max_loras=None,
        spec_k=0,
    )
    for i in range(4):
        core.submit(EngineRequest(f"r{i}", [10 * i + 1, 10 * i + 2, 10 * i + 3], SamplingParams(n=2, max_tokens=6)))
    most = 0
    for _ in range(100):
        if not core.sched.has_work:
            break
        core.step()
        core.check_invariants()
        most = max(most, len(core.sched.running))
    assert not core.sched.has_work
    core.check_all_free()
    assert most <= 4, f"{most} sequences ran at once under max_num_seqs=4"
