"""Encoder outputs kept by content hash: an image in many requests, or in many prefill chunks of one, is encoded
once. Least recently used entries go when the byte budget is passed; a miss re-encodes the whole item, which gives
the same rows (each item is encoded on its own), so eviction never changes results."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import torch

DEFAULT_ENCODER_CACHE_MEMORY = 256 * 1024**2


class EncoderCache:
    def __init__(self, capacity_bytes: int = DEFAULT_ENCODER_CACHE_MEMORY):
        self.capacity_bytes = capacity_bytes
        self.entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.num_bytes = 0
        self.num_encoded = 0  # items run through the encoder so far
        self.num_hits = 0  # items served from the cache so far
        self.encode_seconds = 0.0  # time spent in the encoder so far

    def counters(self) -> tuple[int, int, float]:
        """(items encoded, cache hits, encoder seconds) since start."""
        return self.num_encoded, self.num_hits, self.encode_seconds

    def outputs(self, items, encode: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> dict[bytes, torch.Tensor]:
        """hash -> encoder output of each item (MultiModalItem), encoding the ones not cached in one call. An item
        of kind "embedding" is its own output (given by the caller): neither encoded nor cached."""
        given = {item.hash: item.data for item in items if item.kind == "embedding"}
        items = [item for item in items if item.kind != "embedding"]
        wanted = {item.hash: item for item in items}
        found = {h: self.entries[h] for h in wanted if h in self.entries}
        for h in found:
            self.entries.move_to_end(h)
        self.num_hits += len(found)
        misses = [item for h, item in wanted.items() if h not in found]
        if misses:
            t0 = time.perf_counter()
            encoded = encode([item.data for item in misses])
            if encoded and encoded[0].is_cuda:  # the time of the encoder's work, not of its launch
                torch.cuda.synchronize(encoded[0].device)
            self.encode_seconds += time.perf_counter() - t0
            for item, out in zip(misses, encoded):
                found[item.hash] = out
                self._put(item.hash, out)
            self.num_encoded += len(misses)
        return found | given

    def clear(self) -> None:
        self.entries.clear()
        self.num_bytes = 0

    def _put(self, key: bytes, value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        if size > self.capacity_bytes:
            return  # larger than the whole budget: used for this step only
        self.entries[key] = value
        self.num_bytes += size
        while self.num_bytes > self.capacity_bytes:
            _, old = self.entries.popitem(last=False)
            self.num_bytes -= old.numel() * old.element_size()
