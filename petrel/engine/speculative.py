"""Draft proposers for speculative decoding: each proposes up to k next tokens per decoding sequence.

Drafts are proposed greedily (a point mass on one token), so the verifying sampler's rule is simple and
exact: a greedy row keeps a draft token while it equals the target's argmax; a sampled row accepts draft d
with probability p(d) and otherwise draws from p with d removed, which leaves every emitted token
distributed exactly as p (see Sampler). The engine core verifies all drafts of a step in one forward pass.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from petrel.config import SpeculativeConfig
from petrel.engine.model_runner import ModelRunner, QuerySpan
from petrel.engine.sequence import Sequence


class NgramProposer:
    """Prompt lookup: continue the latest earlier occurrence of the sequence's last n tokens (n = max..min)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        return [self.lookup(seq.token_ids, k) for seq, k in zip(seqs, num_tokens)]

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        tokens = np.asarray(token_ids)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # windows that start at 0 .. len-1-n: every earlier n-gram, not the sequence's own last one
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start:start + k].tolist()
        return []


class ModelDrafter:
    """Drafts greedily with a model: a separate draft model with its own KV cache (indexed by the target's
    block tables), or the target's own first layers (self-speculation, early exit).

    A draft model first catches its cache up on the tokens it has not seen (the whole prompt the first time),
    then runs one token at a time. The early-exit drafter writes the K/V of the target's first layers for the
    draft positions; the verifying pass rewrites them (same values for accepted tokens, stale slots otherwise,
    which the next steps overwrite)."""

    def __init__(self, runner: ModelRunner, num_layers: int | None, own_cache: bool):
        self.runner, self.num_layers, self.own_cache = runner, num_layers, own_cache

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        spans = []
        for seq in seqs:
            start = seq.num_draft_computed if self.own_cache else seq.num_computed_tokens
            spans.append(QuerySpan.of(seq, seq.token_ids[start:], start))
        active = list(range(len(seqs)))
        while active:
            tokens = self.runner.last_token_logits(spans, self.num_layers).argmax(dim=-1).tolist()
            for i, token in zip(active, tokens):
                drafts[i].append(token)
            active = [i for i in active if len(drafts[i]) < num_tokens[i]]
            spans = [QuerySpan.of(seqs[i], [drafts[i][-1]], seqs[i].num_tokens + len(drafts[i]) - 1) for i in active]
        if self.own_cache:
            for seq, draft in zip(seqs, drafts):
                seq.num_draft_computed = seq.num_tokens + len(draft) - 1   # the last draft token is not fed back
        return drafts


def build_proposer(cfg: SpeculativeConfig, target: ModelRunner, draft: ModelRunner | None = None):
    if cfg.method == "ngram":
        return NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    if cfg.method == "self":
        layers = target.cfg.num_hidden_layers
        num_layers = cfg.draft_num_layers or max(1, layers // 4)
        if num_layers >= layers:
            raise ValueError(f"speculative_config.draft_num_layers must be below the model's {layers} layers, "
                             f"got {num_layers}")
        return ModelDrafter(target, num_layers, own_cache=False)
    if draft is None:
        raise ValueError("speculative method 'draft_model' needs a loaded draft model")
    return ModelDrafter(draft, None, own_cache=True)
