"""Speculative decoding: the draft proposers, and the `Speculator` that runs them in the engine step.

Each proposer proposes up to k next tokens per decoding sequence. The Speculator decides before scheduling how
many drafts each running sequence may verify (the scheduler reserves that room), fills the drafts once the batch
is known, and after the step counts what was verified; the sampler verifies the drafts row by row, and each
accepted one is appended (and stop-checked) like a sampled token.

Drafts are proposed greedily (a point mass on one token), so the verifying sampler's rule is simple and
exact: a greedy row keeps a draft token while it equals the target's argmax; a sampled row accepts draft d
with probability p(d) and otherwise draws from p with d removed, which leaves every emitted token
distributed exactly as p (see Sampler). A caller's drafts may come with the logits they were drawn from: a
sampled row then takes the speculative sampling rule (petrel/engine/draft_acceptance.py). The engine core
verifies all drafts of a step in one forward pass.

Lookahead decoding (petrel/engine/lookahead.py) proposes a tree instead of a chain: the sampled token picks the
child to go on with (no acceptance draw: a child is taken only when the ordinary draw lands on it), and the
accepted nodes' K/V are copied to their positions' cache slots after the step.
"""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from petrel.config import EngineConfig, SpeculativeConfig
from petrel.engine.draft_acceptance import Draft, draft_with_probs
from petrel.engine.draft_tree import DraftTree
from petrel.engine.engine_output import EngineOutput
from petrel.engine.lookahead import LookaheadProposer
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


def build_proposer(
    cfg: SpeculativeConfig, target: ModelRunner, draft: ModelRunner | None = None, vocab_size: int | None = None
):
    if cfg.method == "ngram":
        return NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    if cfg.method == "lookahead":
        return LookaheadProposer(*cfg.lookahead_sizes, vocab_size=vocab_size)
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
        self.proposer = None if self.config is None else build_proposer(self.config, target, draft, vocab_size)
        self.lookahead = self.proposer if isinstance(self.proposer, LookaheadProposer) else None
        self.runner = target
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def check_request(self, params) -> None:
        """A request's lookahead_config needs the engine's lookahead decoding, within its maximum sizes."""
        wanted = params.lookahead_config
        if wanted is None:
            return
        if self.lookahead is None:
            raise ValueError(
                "lookahead_config needs an engine with speculative_config method 'lookahead' (its maximum sizes)"
            )
        limit = self.lookahead.max_sizes
        if any(a > b for a, b in zip(wanted, limit)):
            raise ValueError(
                f"lookahead_config {tuple(wanted)} exceeds the engine's maximum (window, ngram, verification set) "
                f"sizes {limit}"
            )

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
        tree = False
        if external:
            k = min(len(external), MAX_EXTERNAL_DRAFTS)
        elif self.lookahead is not None:
            k, tree = self.lookahead.max_draft_tokens(seq), True
        elif self.proposer is not None:
            k = self.config.num_speculative_tokens
        else:
            return 0
        k = min(k, self.max_model_len - seq.num_tokens)  # a tree's nodes take that many cache slots too
        if p.max_tokens is not None:
            left = p.max_tokens - seq.num_output_tokens - 1  # what the step may emit after its next token
            if tree:  # a tree's depth, not its size, bounds what it emits: any room for one more token will do
                k = k if left > 0 else 0
            else:  # a chain emits at most its drafts + 1 tokens
                k = min(k, left)
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
        for i in picked:
            if drafts[i]:  # the caller's drafts, with the distributions they were drawn from when given
                self._external(batch.seqs[i], drafts[i][: batch.num_new_tokens[i] - 1])
        if proposed and self.proposer is not None:
            seqs = [batch.seqs[i] for i in proposed]
            for i, draft in zip(proposed, self.proposer.propose(seqs, [batch.num_new_tokens[i] - 1 for i in proposed])):
                if isinstance(draft, DraftTree):  # built within the budget, without ids outside the vocabulary
                    batch.seqs[i].spec.draft_tree = draft if len(draft) else None
                    draft = draft.tokens
                elif self.vocab_size is not None:  # prompt lookup may continue into a prompt's virtual tokens
                    draft = draft[: next((j for j, t in enumerate(draft) if t >= self.vocab_size), len(draft))]
                drafts[i] = draft
        for i in picked:
            seq = batch.seqs[i]
            seq.spec.draft_token_ids = drafts[i][: batch.num_new_tokens[i] - 1]
            batch.num_new_tokens[i] = 1 + len(seq.spec.draft_token_ids)
        batch.put_decodes_first()  # a sequence left without drafts is a plain decode again

    @staticmethod
    def _external(seq: Sequence, drafts: list[int]) -> None:
        """A sampled request's external drafts with logits: each draft with its distribution, for the sampler."""
        p = seq.params
        if p.external_draft_logits is None or p.greedy:
            return
        first = seq.num_output_tokens  # the output index of the first draft: its row of the logits
        rows = p.external_draft_logits[first : first + len(drafts)]
        seq.spec.draft_dists = draft_with_probs(drafts, rows, p.external_draft_acceptance_threshold)

    @staticmethod
    def sampler_drafts(seqs: list[Sequence], nodes: list[int]) -> list[Draft | None]:
        """What each row verifies, each sequence standing on draft node `nodes[i]` (0: the row after its last
        token): the chain's next draft (with its distribution when the caller gave one), None after its last one
        and for a tree (the sampled token itself picks the child)."""
        out: list[Draft | None] = []
        for seq, node in zip(seqs, nodes):
            spec = seq.spec
            if spec.draft_tree is not None or node >= len(spec.draft_token_ids):
                out.append(None)
            else:
                out.append(spec.draft_dists[node] if spec.draft_dists else spec.draft_token_ids[node])
        return out

    @staticmethod
    def next_node(seq: Sequence, node: int, token: int) -> int | None:
        """The draft node the sequence goes on to after sampling `token` on `node`, or None: its verification ends
        (the token was no draft there). An accepted node is recorded on the sequence."""
        spec = seq.spec
        if spec.draft_tree is not None:
            child = spec.draft_tree.children[node].get(token)
        else:
            child = node + 1 if node < len(spec.draft_token_ids) and spec.draft_token_ids[node] == token else None
        if child is not None:
            spec.accepted_nodes.append(child)
        return child

    @staticmethod
    def report(out: EngineOutput, seq: Sequence) -> None:
        """The sequence's verify rounds so far (this step's included) on its output; on its final output, the
        drafts accepted per round."""
        out.spec_verify_ct = seq.spec.num_verify_rounds + (1 if seq.spec.draft_token_ids else 0)
        if out.finish_reason is not None:
            out.accept_draft_tokens = seq.spec.num_accepted / out.spec_verify_ct if out.spec_verify_ct else 0.0

    def finish_verification(self, batch, block_manager, step_logits=None) -> int:
        """After the step: accepted drafts are computed K/V (a tree's copied to their positions' slots first);
        lookahead windows take their outputs; clear the drafts. Returns the number of drafts."""
        if self.lookahead is not None and step_logits is not None:
            self._observe_lookahead(batch, step_logits)
        num_draft = 0
        moves = []
        for seq in batch.seqs:
            spec = seq.spec
            if not spec.draft_token_ids:
                continue
            num_draft += len(spec.draft_token_ids)
            spec.num_verify_rounds += 1
            spec.num_drafted += len(spec.draft_token_ids)
            if spec.draft_tree is not None and not seq.is_finished:
                moves.extend(self._tree_moves(seq, block_manager.block_size))
            spec.draft_token_ids, spec.draft_tree, spec.draft_dists, spec.accepted_nodes = [], None, None, []
            if not seq.is_finished:
                seq.num_computed_tokens = seq.num_tokens - 1
                spec.num_draft_computed = min(spec.num_draft_computed, seq.num_computed_tokens)
        self.runner.move_slots(moves)
        for seq in batch.seqs:
            if not seq.is_finished:
                block_manager.cache_computed_blocks(seq)
        return num_draft

    @staticmethod
    def _tree_moves(seq: Sequence, block_size: int) -> list[tuple[int, int]]:
        """The (source, destination) cache slots, in every KV group, that bring the accepted tree nodes' K/V to
        their positions: node k of a tree rooted at cache index r lies at r + k; the i-th accepted belongs at
        r + i."""
        root = seq.num_computed_tokens - 1  # the step computed the root (its last token) only

        def slot(table: list[int], index: int) -> int:
            return table[index // block_size] * block_size + index % block_size

        return [
            (slot(table, root + node), slot(table, root + i))
            for i, node in enumerate(seq.spec.accepted_nodes, start=1)
            if node != i
            for table in seq.block_tables
        ]

    def _observe_lookahead(self, batch, step_logits) -> None:
        """Each lookahead sequence still running takes the greedy tokens after its window rows' nodes."""
        first_row = {seq: row for seq, row in zip(step_logits.sample_seqs, step_logits.first_rows)}
        wanted = [
            (seq, node)
            for seq in batch.seqs
            if seq.spec.draft_tree is not None and not seq.is_finished and seq in first_row
            for node in self.lookahead.output_nodes(seq)
        ]
        if not wanted:
            return
        rows = torch.tensor([first_row[seq] + node for seq, node in wanted], device=step_logits.sample_logits.device)
        tokens = step_logits.sample_logits[rows].argmax(dim=-1).tolist()
        outputs: dict[Sequence, dict[int, int]] = {}
        for (seq, node), token in zip(wanted, tokens):
            outputs.setdefault(seq, {})[node] = token
        for seq, by_node in outputs.items():
            self.lookahead.observe(seq, by_node)
