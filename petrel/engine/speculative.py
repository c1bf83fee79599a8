"""Speculative decoding: the draft proposers, and the `Speculator` that runs them in the engine step.

Each proposer proposes up to k next tokens per decoding sequence. The Speculator decides before scheduling how
many drafts each running sequence may verify (the scheduler reserves that room), fills the drafts once the batch
is known, and after the step counts what was verified; the sampler verifies the drafts row by row, and each
accepted one is appended (and stop-checked) like a sampled token.

Drafts are proposed greedily (a point mass on one token), so the verifying sampler's rule is simple and
exact: a greedy row keeps a draft token while it equals the target's argmax; a sampled row accepts draft d
with probability p(d) and otherwise draws from p with d removed, which leaves every emitted token
distributed exactly as p (see Sampler). The engine core verifies all drafts of a step in one forward pass.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from petrel.config import EngineConfig, SpeculativeConfig
from petrel.engine.engine_output import EngineOutput
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
                return tokens[start : start + k].tolist()
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
            start = seq.spec.num_draft_computed if self.own_cache else seq.num_computed_tokens
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
                seq.spec.num_draft_computed = seq.num_tokens + len(draft) - 1  # the last draft token is not fed back
        return drafts


def build_proposer(cfg: SpeculativeConfig, target: ModelRunner, draft: ModelRunner | None = None):
    if cfg.method == "ngram":
        return NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    if cfg.method == "self":
        layers = target.cfg.num_hidden_layers
        num_layers = cfg.draft_num_layers or max(1, layers // 4)
        if num_layers >= layers:
            raise ValueError(
                f"speculative_config.draft_num_layers must be below the model's {layers} layers, got {num_layers}"
            )
        return ModelDrafter(target, num_layers, own_cache=False)
    if draft is None:
        raise ValueError("speculative method 'draft_model' needs a loaded draft model")
    return ModelDrafter(draft, None, own_cache=True)


MAX_EXTERNAL_DRAFTS = 32  # external draft tokens verified per step (a verify round): the rest wait for the next


def external_drafts(seq: Sequence) -> list[int]:
    """What is left of the request's external_draft_tokens (the caller's proposed continuation) after the tokens
    generated so far; [] once the output has left it (a draft was rejected) or used it up."""
    proposed = seq.params.external_draft_tokens
    m = seq.num_output_tokens
    if not proposed or m >= len(proposed) or seq.token_ids[seq.num_prompt_tokens :] != proposed[:m]:
        return []
    return proposed[m:]


class Speculator:
    """Speculative decoding in the engine step (petrel/engine/engine_core.py): lookahead, drafts, bookkeeping.

    Without a speculative_config (config.speculative_config None) it has no proposer and only verifies the
    external_draft_tokens that requests bring; a request's external drafts take precedence over the proposer's
    while its output follows them."""

    def __init__(
        self,
        config: EngineConfig,
        target: ModelRunner,
        draft_model,
        num_blocks: int,
        max_model_len: int,
        vocab_size: int | None = None,
    ):
        """draft_model: (model, model_config) for method 'draft_model'; it gets a cache of num_blocks blocks,
        indexed by the target's block tables. vocab_size: drafts are cut before an id outside it (a prompt's
        virtual token, which prompt lookup could propose)."""
        self.config = config.speculative_config
        draft = None
        if draft_model is not None:
            draft = ModelRunner(
                draft_model[0],
                draft_model[1],
                num_blocks,
                config.block_size,
                config.torch_dtype,
                config.device,
                kv_cache_dtype=config.kv_cache_torch_dtype,
            )
        self.proposer = None if self.config is None else build_proposer(self.config, target, draft)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def reserve_lookahead(self, running: list[Sequence]) -> None:
        """Before scheduling: the draft slots each running sequence may use this step."""
        if self.proposer is None:  # external drafts only
            for seq in running:
                seq.spec.num_lookahead = self._lookahead(seq) if seq.params.external_draft_tokens else 0
            return
        for seq in running:
            seq.spec.num_lookahead = self._lookahead(seq)

    def _lookahead(self, seq: Sequence) -> int:
        """How many draft tokens a running sequence may verify next step (0: decode plainly)."""
        p = seq.params
        if p.use_beam_search or seq.num_output_tokens == 0 or seq.num_computed_tokens != seq.num_tokens - 1:
            return 0
        external = external_drafts(seq)
        if external:
            k = min(len(external), MAX_EXTERNAL_DRAFTS)
        elif self.proposer is not None:
            k = self.config.num_speculative_tokens
        else:
            return 0
        k = min(k, self.max_model_len - seq.num_tokens)
        if p.max_tokens is not None:
            k = min(k, p.max_tokens - seq.num_output_tokens - 1)  # the step emits at most drafts + 1 tokens
        return max(k, 0)

    def propose(self, batch) -> None:
        """Fill the draft tokens of the sequences the scheduler gave lookahead room, and fit the batch to them."""
        picked = [
            i
            for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))
            if n > 1 and seq.num_computed_tokens == seq.num_tokens - 1
        ]
        if not picked:
            return
        drafts = {i: external_drafts(batch.seqs[i]) for i in picked}
        proposed = [i for i in picked if not drafts[i]]
        if proposed and self.proposer is not None:
            seqs = [batch.seqs[i] for i in proposed]
            for i, draft in zip(proposed, self.proposer.propose(seqs, [batch.num_new_tokens[i] - 1 for i in proposed])):
                if self.vocab_size is not None:  # prompt lookup may continue into a prompt's virtual tokens
                    draft = draft[: next((j for j, t in enumerate(draft) if t >= self.vocab_size), len(draft))]
                drafts[i] = draft
        for i in picked:
            seq = batch.seqs[i]
            seq.spec.draft_token_ids = drafts[i][: batch.num_new_tokens[i] - 1]
            batch.num_new_tokens[i] = 1 + len(seq.spec.draft_token_ids)
        batch.put_decodes_first()  # a sequence left without drafts is a plain decode again

    @staticmethod
    def report(out: EngineOutput, seq: Sequence) -> None:
        """The sequence's verify rounds so far (this step's included) on its output; on its final output, the
        drafts accepted per round."""
        out.spec_verify_ct = seq.spec.num_verify_rounds + (1 if seq.spec.draft_token_ids else 0)
        if out.finish_reason is not None:
            out.accept_draft_tokens = seq.spec.num_accepted / out.spec_verify_ct if out.spec_verify_ct else 0.0

    @staticmethod
    def finish_verification(batch, block_manager) -> int:
        """After the step: accepted drafts are computed K/V; clear the drafts. Returns the number of drafts."""
        num_draft = 0
        for seq in batch.seqs:
            spec = seq.spec
            if not spec.draft_token_ids:
                continue
            num_draft += len(spec.draft_token_ids)
            spec.num_verify_rounds += 1
            spec.num_drafted += len(spec.draft_token_ids)
            spec.draft_token_ids = []
            if not seq.is_finished:
                seq.num_computed_tokens = seq.num_tokens - 1
                spec.num_draft_computed = min(spec.num_draft_computed, seq.num_computed_tokens)
                block_manager.cache_computed_blocks(seq)
        return num_draft
