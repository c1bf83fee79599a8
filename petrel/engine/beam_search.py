"""Beam search for one request: which (beam, token) pairs live on, which hypotheses are finished, when to stop.

Pure Python over per-beam candidate lists, so it is tested without a model. The engine core turns the
chosen (parent, token) pairs into sequences: the first child of a parent takes the parent's sequence,
further children fork it (sharing its KV blocks by ref count, copy-on-write for the partial block), and
parents with no child are freed.

Scoring follows the usual definition: a beam's score is its sum of token logprobs; a finished hypothesis
is ranked by sum / (number of output tokens) ** length_penalty. At each step the 2 * width best candidates
per beam are merged; an end token among the `width` best candidates closes a hypothesis, the others
continue, until `width` beams continue. `early_stopping`: True stops as soon as `width` hypotheses are
finished; False stops when the best running beam, scored at its current length, cannot beat the worst
kept hypothesis; 'never' scores it at the longest length it could reach.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Hypothesis:
    output_token_ids: list[int]
    cum_logprob: float
    score: float
    finish_reason: str                 # 'stop' | 'length'
    stop_reason: int | None = None
    token_logprobs: list = field(default_factory=list)   # per output token, what the sampler recorded
    extras: dict = field(default_factory=dict)            # generation logits / hidden states per token


@dataclass
class Candidate:
    beam: int            # index of the parent beam in the list given to `step`
    token_id: int
    cum_logprob: float   # parent's cum + this token's logprob
    logprob: float


class BeamSearch:
    def __init__(self, width: int, length_penalty: float = 1.0, early_stopping: bool | str = False,
                 max_output_tokens: int | None = None):
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
        del self.finished[self.width:]

    def select(self, candidates: list[list[tuple[int, float]]], beam_cums: list[float], num_output_tokens: int,
               is_end: callable) -> tuple[list[Candidate], list[Candidate]]:
        """candidates[b]: (token, logprob) best-first for beam b (at least 2 * width of them when the vocabulary
        allows). num_output_tokens: tokens each beam has now (before this step's token). Returns the beams that
        continue (up to `width`, best first) and the candidates that end here (to become hypotheses)."""
        merged = [Candidate(b, tok, beam_cums[b] + lp, lp)
                  for b, cands in enumerate(candidates) for tok, lp in cands[:2 * self.width]]
        merged.sort(key=lambda c: c.cum_logprob, reverse=True)
        keep, ended = [], []
        for rank, cand in enumerate(merged):
            if is_end(cand.token_id):
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
