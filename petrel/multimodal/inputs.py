"""What a request carries about its media from the front end to the model runner: plain data, made once."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, eq=False)
class MultiModalItem:
    """One image of a prompt: its content hash (the prefix cache's and the encoder cache's key), the prompt rows its
    embeddings go to (in the order the encoder output gives them) and the encoder's input."""

    kind: str  # "image" or "video"
    hash: bytes
    positions: tuple[int, ...]  # prompt positions of its placeholder tokens, ascending
    data: torch.Tensor  # the encoder's input (Idefics3: the image's tiles [n, 3, M, M]; Qwen2-VL: patches [t, h, w, v])


@dataclass(eq=False)
class MultiModalInputs:
    """A prompt's media items, in prompt order."""

    items: list[MultiModalItem]
    # multimodal rotary (Qwen2-VL, petrel/multimodal/mrope.py): each prompt token's t/h/w positions [3, prompt length],
    # and what a later token adds to its index (its three positions are index + delta)
    mrope_positions: torch.Tensor | None = None
    mrope_delta: int = 0
    # a rotary table given with the request (Executor Request.mrope_config): each prompt token's (cos, sin) per
    # frequency [prompt length, head_dim / 2, 2], used instead of its positions'; its digest keys every block
    rope_cos_sin: torch.Tensor | None = None
    rope_digest: bytes = b""
    _block_keys: dict = field(default_factory=dict, repr=False)

    def block_key(self, block: int, block_size: int) -> bytes:
        """The content hashes of the items with placeholder rows in prompt block `block` (b"" when none): the
        prefix cache hashes them with the block's tokens, so equal tokens over different images never match."""
        keys = self._block_keys.get(block_size)
        if keys is None:
            keys = self._block_keys[block_size] = {}
            for item in self.items:
                for b in dict.fromkeys(p // block_size for p in item.positions):
                    keys[b] = keys.get(b, b"") + item.hash
        return keys.get(block, b"") + self.rope_digest

    def overlaps(self, start: int, end: int):
        """(item, indices into its rows, prompt positions) of every item with placeholder rows in [start, end)."""
        for item in self.items:
            if item.positions[0] >= end or item.positions[-1] < start:
                continue
            idx = [k for k, p in enumerate(item.positions) if start <= p < end]
            if idx:
                yield item, idx, [item.positions[k] for k in idx]
