"""Lookahead decoding: Jacobi iteration over a window of future positions feeds an n-gram pool, and the pool's
n-grams that continue the last token are verified, all in the step's one forward pass (TensorRT-LLM's
LookaheadDecodingConfig(W, N, G): window size, n-gram size, verification set size). No draft model.

Each sequence keeps a window of W rows of N - 1 guessed tokens at consecutive positions; row i's first token
stands at i positions after the sequence's last token (row 0's first token is that last token itself), and the
first tokens of rows 1..W-1 follow each other: the Jacobi guesses of the next W - 1 positions. Each step the
model's greedy output after a row's last token is that row's next token: a full row and its output make an n-gram
(into the pool, keyed by its first token), and the row drops its first token for the output (all rows shift one
position ahead, as the sequence does). Rows start from random prompt tokens and fill up over the first N - 2
steps. The pool also takes every n-gram of the prompt and of the output; it keeps the G latest n-grams a key.

The step's drafts are one tree (petrel/engine/draft_tree.py): the G latest n-grams after the last token (the
verification branch) and each row's path (row i: the first tokens of rows 1..i, then the rest of row i; the
lookahead branch), merged where they share tokens: (N - 2) + (W - 1 + G)(N - 1) draft tokens at most. The engine
walks the tree from the last token, going on while the token it samples is a child of the node it stands on, so
greedy tokens are plain decoding's and a sampled token is drawn from the target's own distribution (a draft child
is taken only when the draw lands on it). The accepted nodes' K/V are then copied to their positions' slots.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from petrel.engine.draft_tree import DraftTree

if TYPE_CHECKING:
    from petrel.engine.sequence import Sequence


def lookahead_draft_len(w: int, n: int, g: int) -> int:
    """Draft tokens a step verifies at most: the window's (N - 2) + (W - 1)(N - 1), the candidates' G(N - 1)."""
    return (n - 2 if n > 1 else 0) + (w - 1 + g) * (n - 1)


def check_lookahead_config(name: str, value, minimum: int = 0) -> tuple[int, int, int]:
    """(window, ngram, verification set) sizes as TensorRT-LLM allows them (n >= 1, w >= 1, g >= minimum; an n of 1
    needs w = 1 and g = 0: plain decoding), else a ValueError naming `name`."""
    try:
        w, n, g = value
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be (window_size, ngram_size, verification_set_size), got {value!r}") from None
    if any(isinstance(v, bool) or not isinstance(v, int) for v in (w, n, g)):
        raise ValueError(f"{name} sizes must be integers, got {value!r}")
    if w < 1 or n < 1 or g < minimum:
        raise ValueError(
            f"{name} needs window_size >= 1, ngram_size >= 1 and verification_set_size >= {minimum}, got {(w, n, g)}"
        )
    if n == 1 and (w != 1 or g != 0):
        raise ValueError(f"{name}: an ngram_size of 1 (plain decoding) needs window_size 1 and verification_set_size 0")
    return w, n, g


class NgramPool:
    """n-grams keyed by their first token: the latest `size` distinct continuations (n - 1 tokens) of each key."""

    def __init__(self, n: int, size: int):
        self.n, self.size = n, size
        self.grams: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, key: int, continuation: tuple[int, ...]) -> None:
        grams = self.grams.setdefault(key, OrderedDict())
        grams.pop(continuation, None)
        grams[continuation] = None
        if len(grams) > self.size:
            grams.popitem(last=False)

    def add_tokens(self, tokens: list[int], first_end: int) -> None:
        """Every n-gram of `tokens` that ends at index first_end or later."""
        for end in range(max(first_end, self.n - 1), len(tokens)):
            self.add(tokens[end - self.n + 1], tuple(tokens[end - self.n + 2 : end + 1]))

    def guesses(self, key: int) -> list[tuple[int, ...]]:
        """The key's continuations, latest first."""
        return list(reversed(self.grams.get(key, ())))


@dataclass
class LookaheadState:
    """One sequence's lookahead: its sizes, window rows, pool, and what this step's tree holds of the rows."""

    w: int
    n: int
    g: int
    rows: list[list[int]]  # W rows of up to N - 1 tokens; rows[0][0] stands for the sequence's last token
    pool: NgramPool
    seen: int = 0  # tokens of the sequence whose n-grams are in the pool
    root: int = -1  # the last token when the tree was built
    row_ends: dict[int, int] = field(default_factory=dict)  # row -> the tree node of its last token (rows in the tree)


class LookaheadProposer:
    """Builds each sequence's draft tree before the step (propose) and moves its window after it (observe)."""

    def __init__(self, window: int, ngram: int, verification: int, vocab_size: int | None = None):
        self.max_sizes = (window, ngram, verification)
        self.vocab_size = vocab_size  # tokens at or past it (a prompt's virtual tokens) are never drafted

    def sizes(self, seq: Sequence) -> tuple[int, int, int]:
        """The request's (w, n, g): its own lookahead_config, else the engine's maximum."""
        return seq.params.lookahead_config or self.max_sizes

    def max_draft_tokens(self, seq: Sequence) -> int:
        return lookahead_draft_len(*self.sizes(seq))

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[DraftTree]:
        return [self.tree(seq, k) for seq, k in zip(seqs, num_tokens)]

    def tree(self, seq: Sequence, budget: int) -> DraftTree:
        """The sequence's draft tree of at most `budget` nodes: the candidates first, then the window's rows (a row
        is in whole or not at all); the state remembers where each row ends."""
        state = self._state(seq)
        state.pool.add_tokens(seq.token_ids, state.seen)
        state.seen = seq.num_tokens
        state.root = seq.token_ids[-1]
        tree = DraftTree()
        state.row_ends = {}
        if state.n < 2:
            return tree
        for guess in state.pool.guesses(state.root)[: state.g]:
            if self._draftable(guess):
                tree.add_path(list(guess), budget)
        firsts: list[int] = []  # the first tokens of rows 1..i
        for i, row in enumerate(state.rows):
            if i > 0:
                firsts.append(row[0])
            path = [*firsts, *row[1:]]
            end = tree.add_path(path, budget) if self._draftable(path) else None
            if end is not None:
                state.row_ends[i] = end
        return tree

    def observe(self, seq: Sequence, outputs: dict[int, int]) -> None:
        """After the step: `outputs` holds the greedy token after each row-ending node. Each row in the tree takes
        its output: a full row first gives its n-gram to the pool and drops its first token."""
        state = seq.spec.lookahead
        if state is None:
            return
        for i, end in state.row_ends.items():
            row = state.rows[i]
            if i == 0:
                row[0] = state.root
            token = outputs[end]
            if len(row) == state.n - 1:
                state.pool.add(row[0], (*row[1:], token))
                del row[0]
            row.append(token)
        state.row_ends = {}

    def output_nodes(self, seq: Sequence) -> list[int]:
        """The tree nodes whose greedy next token observe() needs."""
        state = seq.spec.lookahead
        return sorted(set(state.row_ends.values())) if state is not None else []

    def _draftable(self, tokens) -> bool:
        return self.vocab_size is None or all(t < self.vocab_size for t in tokens)

    def _state(self, seq: Sequence) -> LookaheadState:
        state = seq.spec.lookahead
        if state is None:
            w, n, g = self.sizes(seq)
            words = [t for t in seq.token_ids[: seq.num_prompt_tokens] if self._draftable((t,))] or [0]
            pick = random.Random(len(seq.token_ids)).choice  # the window starts from prompt tokens
            rows = [[seq.token_ids[-1]]] + [[pick(words)] for _ in range(w - 1)]
            state = seq.spec.lookahead = LookaheadState(w, n, g, rows, NgramPool(n, max(g, 1)))
        return state
