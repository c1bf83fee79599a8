"""Continuous batching: which sequences run this step and how many tokens each. No torch here.

Admission (who may hold KV memory) and batching (what runs this step, within a token budget) are
separate decisions. Running sequences go first, oldest first; then waiting ones are admitted while
blocks and the budget last. A decoding sequence with a lookahead (speculative decoding) is given room for
that many draft tokens after its next one when the budget and the blocks allow; else it decodes plainly. A prompt
that does not fit the budget is prefilled in chunks across steps.
With LoRA, a waiting request whose adapter is not running is admitted only while fewer distinct adapters
than there are LoRA slots run (else it waits, and the queue behind it, until one finishes).
When blocks run out, the newest running sequence is preempted: its blocks are freed and it goes back
to the front of the queue, to be recomputed later (its full blocks stay in the prefix cache).
With lower KV tiers, a waiting sequence whose blocks are being read from a slow tier (fetch_pending) stays in the
queue while the ones behind it are admitted; it is admitted once its fetch is settled.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from petrel.engine.block_manager import BlockManager
from petrel.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)  # decodes first (by context length), then prefill chunks
    num_new_tokens: list[int] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)

    def put_decodes_first(self) -> None:
        """Single-token queries (decodes) first, by context length, so the runner's decode groups pad little."""

        def key(i: int) -> tuple[bool, int]:
            decode = self.num_new_tokens[i] == 1
            return not decode, self.seqs[i].num_computed_tokens if decode else 0

        order = sorted(range(len(self.seqs)), key=key)
        self.seqs = [self.seqs[i] for i in order]
        self.num_new_tokens = [self.num_new_tokens[i] for i in order]


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        max_loras: int | None = None,
    ):
        self.block_manager = block_manager
        self.max_loras = max_loras  # with LoRA: distinct adapters running at once at most
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_queried_tokens = 0  # prompt tokens admitted, and how many of them the prefix cache served
        self.prefix_hit_tokens = 0
        # lower KV tiers (petrel/engine/kv_tier_io.py): whether a waiting sequence waits for its blocks' fetch
        self.fetch_pending: Callable[[Sequence], bool] | None = None

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence behind every waiting one of equal or higher priority."""
        seq.status = SequenceStatus.WAITING
        priority = seq.request.priority
        for i, other in enumerate(self.waiting):
            if other.request.priority < priority:
                self.waiting.insert(i, seq)
                return
        self.waiting.append(seq)

    def add_running(self, seq: Sequence, after: Sequence) -> None:
        """A forked sequence joins right after its parent (it already holds blocks)."""
        seq.status = SequenceStatus.RUNNING
        self.running.insert(self.running.index(after) + 1, seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence wherever it is and free its blocks. Idempotent."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.beam.candidates = None  # a beam recomputes its next-token candidates with its KV
        seq.spec.num_draft_computed = 0  # a draft model recomputes its K/V too
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)
        self.num_preemptions += 1

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n == 0:  # a beam that has its candidates and waits for its other beams
                i += 1
                continue
            lookahead = (
                min(seq.spec.num_lookahead, budget - n) if n == seq.num_tokens - seq.num_computed_tokens == 1 else 0
            )
            if lookahead > 0 and bm.allocate_slots(seq, n + lookahead):  # room for draft tokens to verify
                scheduled.append((seq, n + lookahead))
                budget -= n + lookahead
                i += 1
                continue
            while not bm.allocate_slots(seq, n):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is seq:
                    break
            else:
                scheduled.append((seq, n))
                budget -= n
                i += 1

        running_loras = {s.request.lora_int_id for s in self.running} - {0} if self.max_loras else set()
        committed = sum(_width(s) for s in self.running)  # running sequences, and the forks they will make
        held = 0  # waiting sequences passed over while their blocks are read from a slow KV tier
        while len(self.waiting) > held and budget > 0 and len(self.running) < self.max_num_seqs and not batch.preempted:
            seq = self.waiting[held]  # a waiting sequence holds no blocks
            if seq.request.imported_kv is None and self.fetch_pending is not None and self.fetch_pending(seq):
                held += 1
                continue
            width = _width(seq)
            if self.running and committed + width > self.max_num_seqs:
                break  # its n sequences (or beams) would run past max_num_seqs
            lora = seq.request.lora_int_id
            if lora and self.max_loras and lora not in running_loras and len(running_loras) >= self.max_loras:
                break  # every LoRA slot is taken by running adapters: wait for one to finish
            if lora and self.max_loras:
                running_loras.add(lora)
            if seq.request.imported_kv is not None:
                # disaggregated decode: blocks for the imported prompt and the first token, which runs now
                if not bm.allocate_slots(seq, seq.num_tokens, admitting=bool(self.running)):
                    break
                seq.num_computed_tokens, n = seq.num_tokens - 1, 1
            else:
                bm.match_prefix(seq)
                remaining = seq.num_tokens - seq.num_computed_tokens
                n = min(remaining, budget)
                chunk_refused = n < remaining and not self.enable_chunked_prefill and scheduled
                if chunk_refused or not bm.allocate_slots(seq, n, admitting=bool(self.running)):
                    bm.free(seq)  # give the prefix hit back until it is admitted
                    seq.num_cached_tokens = 0
                    break
            del self.waiting[held]
            self.prefix_queried_tokens += seq.num_prompt_tokens
            self.prefix_hit_tokens += seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            committed += width
            scheduled.append((seq, n))
            budget -= n

        if not scheduled and len(self.waiting) > held and self.running:
            # only idle beams run, and they hold the blocks their other (preempted) beams need: recompute them too
            for seq in list(self.running):
                self._preempt(seq, batch)
            return self.schedule()

        batch.seqs = [s for s, _ in scheduled]
        batch.num_new_tokens = [n for _, n in scheduled]
        batch.put_decodes_first()
        batch.block_copies = bm.take_pending_copies()
        return batch


def _width(seq: Sequence) -> int:
    """Sequences admitting `seq` will run: a request's first sequence forks into n (or its beams) once its prompt
    is done, and max_num_seqs counts them all. A request wider than max_num_seqs still runs when nothing else does."""
    req = seq.request
    if len(req.seqs) <= 1 and seq.num_output_tokens == 0:
        return req.params.num_beams if req.params.use_beam_search else req.params.n
    return 1
