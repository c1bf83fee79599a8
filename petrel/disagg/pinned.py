"""Prompt KV blocks a context-only request left behind, pinned (ref-counted) until fetched or expired.

Lives in the engine core and is only touched by the engine loop thread. A pin holds one reference on each
block that covers the prompt, so neither the scheduler nor the prefix cache's eviction can reuse them; taking
the pin (a fetch) or its expiry gives the references back. No torch here.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

from petrel.engine.block_manager import BlockManager


@dataclass
class PinnedPrompt:
    blocks: list[list[int]]      # per KV group (petrel/engine/kv_groups.py): its table's blocks of the prompt
    num_tokens: int
    expires_at: float


class PinnedPrompts:
    def __init__(self, block_manager: BlockManager, ttl: float):
        self.block_manager = block_manager
        self.ttl = ttl
        self.pins: dict[str, PinnedPrompt] = {}

    def __len__(self) -> int:
        return len(self.pins)

    def pin(self, block_tables: list[list[int]], num_tokens: int, now: float | None = None) -> str:
        """Keep the blocks holding the first num_tokens positions (in every group's table); return the handle
        that fetches them."""
        self.expire(now)
        bs = self.block_manager.block_size
        blocks = [list(table[:-(-num_tokens // bs)]) for table in block_tables]
        for table in blocks:
            self.block_manager.retain(table)
        handle = secrets.token_hex(16)
        self.pins[handle] = PinnedPrompt(blocks, num_tokens, (now or time.monotonic()) + self.ttl)
        return handle

    def take(self, handle: str) -> PinnedPrompt | None:
        """The pin (its blocks still held: call release() once they are read), or None: unknown or expired."""
        self.expire()
        return self.pins.pop(handle, None)

    def release(self, pin: PinnedPrompt) -> None:
        for table in pin.blocks:
            self.block_manager.release(table)

    def expire(self, now: float | None = None) -> int:
        """Release the pins nobody fetched in time; returns how many."""
        now = time.monotonic() if now is None else now
        old = [h for h, p in self.pins.items() if p.expires_at <= now]
        for handle in old:
            self.release(self.pins.pop(handle))
        return len(old)
