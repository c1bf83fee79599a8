"""Beam search: the selection (`BeamSearch`, one per request) and its run in the engine (`BeamSearchDriver`).

`BeamSearch` is pure Python over per-beam candidate lists, so it is tested without a model: which (beam, token)
pairs live on, which hypotheses are finished, when to stop. `BeamSearchDriver` turns the chosen (parent, token)
pairs into sequences once every beam of a request has its candidates: the first child of a parent takes the
parent's sequence, further children fork it (sharing its KV blocks by ref count, copy-on-write for the partial
block), and parents with no child are freed. Whether a candidate token ends its beam is the stop check every
sequence uses (petrel/engine/stop.py).

Scoring follows the usual definition: a beam's score is its sum of token logprobs; a finished hypothesis
is ranked by sum / (number of output tokens) ** length_penalty. At each step the 2 * width best candidates
per beam are merged; an end token among the `width` best candidates closes a hypothesis, the others
continue, until `width` beams continue. `early_stopping`: True stops as soon as `width` hypotheses are
finished; False stops when the best running beam, scored at its current length, cannot beat the worst
kept hypothesis; 'never' scores it at the longest length it could reach.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from petrel.engine.engine_output import EngineOutput, build_output
from petrel.engine.sampler import token_logprobs
from petrel.engine.sequence import EngineRequest, Sequence
from petrel.engine.stop import check_stop


@dataclass
class Hypothesis:
    output_token_ids: list[int]
    cum_logprob: float
    score: float
    finish_reason: str  # 'stop' | 'length'
    stop_reason: int | None = None
    token_logprobs: list = field(default_factory=list)  # per output token, what the sampler recorded
    extras: dict = field(default_factory=dict)  # generation logits / hidden states per token


@dataclass
class Candidate:
    beam: int  # index of the parent beam in the list given to `step`
    token_id: int
    cum_logprob: float  # parent's cum + this token's logprob
    logprob: float


class BeamSearch:
    def __init__(
        self,
        width: int,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        max_output_tokens: int | None = None,
    ):
        self.width = width
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.max_output_tokens = max_output_tokens
        self.finished: list[Hypothesis] = []
        self.done = False

    def score(self, cum_logprob: float, num_output_tokens: int) -> float:
        return cum_logprob / max(num_output_tokens, 1) ** self.length_penalty

    def add_hypothesis(self, hyp: Hypothesis) -> None:
        """Keep the `width` best finished hypotheses."""
        self.finished.append(hyp)
        self.finished.sort(key=lambda h: h.score, reverse=True)
        del self.finished[self.width :]

    def select(
        self,
        candidates: list[list[tuple[int, float]]],
        beam_cums: list[float],
        num_output_tokens: int,
        is_end: Callable[[int, int], bool],
    ) -> tuple[list[Candidate], list[Candidate]]:
        """candidates[b]: (token, logprob) best-first for beam b (at least 2 * width of them when the vocabulary
        allows). num_output_tokens: tokens each beam has now (before this step's token). is_end(beam, token):
        whether that token ends that beam. Returns the beams that continue (up to `width`, best first) and the
        candidates that end here (to become hypotheses)."""
        merged = [
            Candidate(b, tok, beam_cums[b] + lp, lp)
            for b, cands in enumerate(candidates)
            for tok, lp in cands[: 2 * self.width]
        ]
        merged.sort(key=lambda c: c.cum_logprob, reverse=True)
        keep, ended = [], []
        for rank, cand in enumerate(merged):
            if is_end(cand.beam, cand.token_id):
                if rank < self.width:
                    ended.append(cand)
                continue
            keep.append(cand)
            if len(keep) == self.width:
                break
        return keep, ended

    def update_done(self, best_running_cum: float | None, num_output_tokens: int) -> bool:
        """After a step: are we done? num_output_tokens: the running beams' length now."""
        if best_running_cum is None:
            self.done = True
        elif len(self.finished) < self.width:
            self.done = False
        elif self.early_stopping is True:
            self.done = True
        else:
            worst = self.finished[-1].score
            length = num_output_tokens
            if self.early_stopping == "never" and self.length_penalty > 0 and self.max_output_tokens:
                length = self.max_output_tokens
            self.done = worst >= self.score(best_running_cum, length)
        return self.done

    def best(self, n: int) -> list[Hypothesis]:
        return self.finished[:n]


class BeamSearchDriver:
    """Runs the beam-search requests' sequences in the engine: their BeamSearch, the beams forked and freed each
    step, and the request's outputs (its best hypotheses) once it is done."""

    def __init__(self, scheduler, block_manager, max_model_len: int):
        self.scheduler, self.block_manager, self.max_model_len = scheduler, block_manager, max_model_len

    def start(self, req: EngineRequest, seq: Sequence) -> None:
        """A new request's beam search, its first sequence being `seq`."""
        p = req.params
        room = min(p.max_tokens or self.max_model_len, self.max_model_len - seq.num_tokens)
        req.beam_search = BeamSearch(p.num_beams, p.length_penalty, p.early_stopping, room)

    def advance(self, req: EngineRequest, now: float) -> list[EngineOutput]:
        """Advance a request's beams together once every live beam has its candidates (seq.beam.candidates).
        Returns the request's outputs when this step finished it, else []."""
        bs = req.beam_search
        beams = [s for s in req.seqs if not s.is_finished]
        if any(s.beam.candidates is None for s in beams):
            return []  # some beam is still being (re)computed
        num_out = beams[0].num_output_tokens

        def ends(b: int, token: int) -> bool:
            stop = self._stop(beams[b], token)
            return stop is not None and stop.finish_reason == "stop"

        keep, ended = bs.select(
            [s.beam.candidates[0] for s in beams], [s.beam.cum_logprob for s in beams], num_out, ends
        )
        for cand in ended:
            self._add_ended(bs, beams[cand.beam], cand, num_out)
        out_of_room = any(self._stop(beams[c.beam], c.token_id) is not None for c in keep)  # 'length': all beams
        new_beams = self._fork_children(req, beams, keep)
        for seq, cand in new_beams:
            self._append(seq, cand)
        for seq, _ in new_beams:
            seq.beam.candidates = None
        length = num_out + 1
        if out_of_room:
            for seq, _ in new_beams:
                bs.add_hypothesis(
                    Hypothesis(
                        seq.output_token_ids,
                        seq.beam.cum_logprob,
                        bs.score(seq.beam.cum_logprob, length),
                        "length",
                        None,
                        list(seq.beam.token_logprobs),
                        _generation_lists(seq),
                    )
                )
            bs.done = True
        else:
            bs.update_done(max((c.cum_logprob for c in keep), default=None), length)
        if bs.done:
            return self._finish(req, now)
        return self._snapshot(req, now) if req.stream_beams else []

    def _stop(self, beam: Sequence, token: int):
        return check_stop(beam, token, self.max_model_len)

    def _add_ended(self, bs: BeamSearch, parent: Sequence, cand: Candidate, num_out: int) -> None:
        """A candidate that ends its beam: a finished hypothesis, its token included."""
        lp, rows = _token_record(parent, cand.token_id)
        generation = _generation_lists(parent)
        for name, new in rows.items():
            generation.setdefault(name, []).extend(new)
        bs.add_hypothesis(
            Hypothesis(
                parent.output_token_ids + [cand.token_id],
                cand.cum_logprob,
                bs.score(cand.cum_logprob, num_out + 1),
                "stop",
                self._stop(parent, cand.token_id).stop_reason,
                parent.beam.token_logprobs + lp,
                generation,
            )
        )

    def _fork_children(self, req: EngineRequest, beams: list[Sequence], keep: list[Candidate]) -> list:
        """(sequence, candidate) of each beam that goes on: a parent's first child takes over its sequence, the
        others fork it first; a parent with no child is freed."""
        children: dict[int, list[Candidate]] = {}
        for cand in keep:
            children.setdefault(cand.beam, []).append(cand)
        new_beams = []
        for b, parent in enumerate(beams):
            cands = children.get(b, [])
            if not cands:
                self.scheduler.finish(parent)
                req.seqs.remove(parent)
                continue
            for cand in cands[1:]:
                child = Sequence(req, len(req.seqs), parent.token_ids, parent.num_prompt_tokens)
                self.block_manager.fork(parent, child)
                child.beam.cum_logprob = parent.beam.cum_logprob
                child.beam.token_logprobs = list(parent.beam.token_logprobs)
                child.beam.candidates = parent.beam.candidates
                child.extra_outputs = parent.extra_outputs.copy()
                child.grammar = parent.grammar.fork() if parent.grammar is not None else None
                self.scheduler.add_running(child, after=parent)
                req.seqs.append(child)
                new_beams.append((child, cand))
            new_beams.append((parent, cands[0]))
        return new_beams

    @staticmethod
    def _append(seq: Sequence, cand: Candidate) -> None:
        """The chosen token onto a beam that goes on: its tokens, grammar, score, logprobs and extra rows."""
        lp, rows = _token_record(seq, cand.token_id)
        seq.token_ids.append(cand.token_id)
        if seq.grammar is not None:
            seq.grammar.accept_token(cand.token_id)
        seq.beam.cum_logprob = cand.cum_logprob
        seq.beam.token_logprobs.extend(lp)
        for name, new in rows.items():
            seq.extra_outputs.generation.setdefault(name, []).extend(new)

    def _snapshot(self, req: EngineRequest, now: float) -> list[EngineOutput]:
        """A streamed beam request's update after a step: its best n running beams (by score so far), each whole,
        replacing the previous update's (beams reorder and fork, so a streamed output's tokens may change from one
        step to the next; the final outputs are the best finished hypotheses)."""
        p = req.params
        live = sorted((s for s in req.seqs if not s.is_finished), key=lambda s: s.beam.cum_logprob, reverse=True)
        return [
            build_output(
                req,
                i,
                seq.output_token_ids,
                now,
                seq=seq,
                logprobs=list(seq.beam.token_logprobs) if p.logprobs is not None else None,
                generation=_generation_lists(seq),
                with_context=i == 0 and seq.num_output_tokens == 1,
                cumulative_logprob=seq.beam.cum_logprob,
                replaces=True,
            )
            for i, seq in enumerate(live[: p.n])
        ]

    def _finish(self, req: EngineRequest, now: float) -> list[EngineOutput]:
        """The request's outputs: its best n hypotheses (fewer when a tiny vocabulary left fewer: the rest end
        empty); its sequences give their blocks back."""
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
        p = req.params
        first = req.seqs[0] if req.seqs else None
        outputs = [
            build_output(
                req,
                i,
                hyp.output_token_ids,
                now,
                seq=first,
                num_output_tokens=len(hyp.output_token_ids),
                logprobs=list(hyp.token_logprobs) if p.logprobs is not None else None,
                finish_reason=hyp.finish_reason,
                stop_reason=hyp.stop_reason,
                generation=hyp.extras,
                with_context=i == 0,
                cumulative_logprob=hyp.cum_logprob,
                replaces=True,
            )
            for i, hyp in enumerate(req.beam_search.best(p.n))
        ]
        outputs += [
            build_output(req, i, [], now, finish_reason="stop", replaces=True) for i in range(len(outputs), p.n)
        ]
        req.finished_indices.update(range(p.n))
        return outputs


def _token_record(seq: Sequence, token: int) -> tuple[list, dict]:
    """What a beam keeps for appending `token`: its logprob entry (when asked for) and the extra rows."""
    _, logp, extras = seq.beam.candidates
    lp = [token_logprobs(logp, token, seq.params.logprobs)] if logp is not None else []
    return lp, {name: [row] for name, row in extras.items()}


def _generation_lists(seq: Sequence) -> dict:
    return {name: list(rows) for name, rows in seq.extra_outputs.generation.items()}
