"""A tree of draft tokens verified in one forward pass (lookahead decoding's branches, merged).

The sequence's last token is the root (node 0, its next position's row); nodes 1..n are the draft tokens, each
one token after its parent, parents before children. In the forward pass node k sits at cache index
root + k and position root + depth(k), and sees the prompt, the tokens before the root and its own ancestors
only (model_runner builds that mask); so the row of node k is exactly the row plain decoding would compute
after the tokens on its path. Paths sharing a prefix share its nodes (a trie), so no token is computed twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)  # node k's token at tokens[k - 1]
    parents: list[int] = field(default_factory=list)  # node k's parent at parents[k - 1] (0: the root)
    depths: list[int] = field(default_factory=list)  # node k's depth at depths[k - 1] (a root child: 1)
    children: list[dict[int, int]] = field(default_factory=lambda: [{}])  # per node (root included): token -> node

    def __len__(self) -> int:
        """Draft tokens (the root not counted)."""
        return len(self.tokens)

    def add_path(self, path: list[int], budget: int) -> int | None:
        """Add a path of tokens after the root, sharing the nodes it has in common with earlier paths. Nothing is
        added when its new nodes would bring the tree past `budget` nodes. Returns its last node (0 for an empty
        path), or None when it did not fit."""
        new = len(path) - self._shared_prefix(path)
        if len(self.tokens) + new > budget:
            return None
        node = 0
        for token in path:
            child = self.children[node].get(token)
            if child is None:
                self.tokens.append(token)
                self.parents.append(node)
                self.depths.append((self.depths[node - 1] if node else 0) + 1)
                self.children.append({})
                child = len(self.tokens)
                self.children[node][token] = child
            node = child
        return node

    def _shared_prefix(self, path: list[int]) -> int:
        node = 0
        for i, token in enumerate(path):
            child = self.children[node].get(token)
            if child is None:
                return i
            node = child
        return len(path)

    def ancestors(self, node: int) -> list[int]:
        """The draft nodes on the path to `node`, itself included, root first (the root not included)."""
        path = []
        while node:
            path.append(node)
            node = self.parents[node - 1]
        return path[::-1]

    def path_tokens(self, node: int) -> list[int]:
        return [self.tokens[k - 1] for k in self.ancestors(node)]
