"""Prompt KV blocks a context-only request left behind, pinned (ref-counted) until fetched or expired.

Disaggregated serving (petrel/disagg) hands a prompt's KV from a context (prefill) instance to a decode one. The
pins live in the engine core (`EngineCore.pinned`) and are only touched by the engine loop thread. A pin holds
one reference on each block that covers the prompt, so neither the scheduler nor the prefix cache's eviction can
reuse them; taking the pin (a fetch) or its expiry gives the references back.

What context-only requests may hold is capped: a front reserves room for a prompt before queueing it (`reserve`,
any thread) and keeps the reservation until the request finished; a pin counts from the moment it is made until
it is released. Reservations and pins together stay within a number of prompts and of blocks, so requests that
nobody fetches cannot take the cache from everyone else. No torch here.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass

from petrel.engine.block_manager import BlockManager


class PinLimitReached(Exception):
    """The pinned and reserved prompts are at their cap: retry later (the front reports it as KVTransferBusy)."""


@dataclass
class PromptHandoff:
    """What a context-only request leaves for the instance that decodes it: the request, the token(s) it
    sampled, and the handle that fetches its pinned prompt KV."""

    request_id: object
    first_gen_tokens: list[int]
    handle: str


@dataclass
class PinnedPrompt:
    blocks: list[list[int]]  # per KV group (petrel/engine/kv_groups.py): its table's blocks of the prompt
    num_tokens: int
    expires_at: float

    @property
    def num_blocks(self) -> int:
        return sum(len(table) for table in self.blocks)


class PinnedPrompts:
    def __init__(self, block_manager: BlockManager, ttl: float):
        self.block_manager = block_manager
        self.ttl = ttl
        self.pins: dict[str, PinnedPrompt] = {}
        self.num_expired = 0  # pins released unfetched since start (the engine loop's; /metrics reads it)
        self._lock = threading.Lock()  # guards the two counts below, which fronts read and reserve from
        self._held_prompts = 0  # pinned or reserved
        self._held_blocks = 0

    def __len__(self) -> int:
        return len(self.pins)

    # ------------------------------------------------------------------ room (any thread)
    def prompt_blocks(self, num_tokens: int) -> int:
        """The blocks a pin of num_tokens positions holds: the prompt's blocks in every KV group."""
        return -(-num_tokens // self.block_manager.block_size) * self.block_manager.num_groups

    def reserve(self, num_tokens: int, max_prompts: int, max_blocks: int) -> PinReservation:
        """Room for one more context-only prompt, held until the reservation is released. PinLimitReached
        when the prompts pinned or reserved already hold max_prompts or would pass max_blocks; ValueError when this
        prompt alone needs more than max_blocks."""
        blocks = self.prompt_blocks(num_tokens)
        if blocks > max_blocks:
            raise ValueError(
                f"disaggregated_params: the prompt's KV ({blocks} blocks) is more than may be pinned "
                f"for a decode instance ({max_blocks} of the cache's {self.block_manager.num_blocks} "
                "blocks, kv_transfer_max_pinned_share)"
            )
        with self._lock:
            if self._held_prompts >= max_prompts or self._held_blocks + blocks > max_blocks:
                raise PinLimitReached(
                    f"disaggregated_params: {self._held_prompts} prompts' KV ({self._held_blocks} blocks) is pinned "
                    f"for decode instances or being prefilled to be; this server allows {max_prompts} prompts and "
                    f"{max_blocks} of its {self.block_manager.num_blocks} blocks (kv_transfer_max_pinned, "
                    "kv_transfer_max_pinned_share); retry later"
                )
            self._add(1, blocks)
        return PinReservation(self, blocks)

    @property
    def held(self) -> tuple[int, int]:
        """(prompts, blocks) pinned or reserved now."""
        with self._lock:
            return self._held_prompts, self._held_blocks

    def _add(self, prompts: int, blocks: int) -> None:
        self._held_prompts += prompts
        self._held_blocks += blocks

    def _give_back(self, prompts: int, blocks: int) -> None:
        with self._lock:
            self._add(-prompts, -blocks)

    # ------------------------------------------------------------------ pins (the engine loop thread)
    def pin(self, block_tables: list[list[int]], num_tokens: int, now: float | None = None) -> str:
        """Keep the blocks holding the first num_tokens positions (in every group's table); return the handle
        that fetches them."""
        self.expire(now)
        bs = self.block_manager.block_size
        blocks = [list(table[: -(-num_tokens // bs)]) for table in block_tables]
        for table in blocks:
            self.block_manager.retain(table)
        handle = secrets.token_hex(16)
        pin = PinnedPrompt(blocks, num_tokens, (now or time.monotonic()) + self.ttl)
        self.pins[handle] = pin
        with self._lock:
            self._add(1, pin.num_blocks)
        return handle

    def hand_off(self, seq, token: int) -> PromptHandoff:
        """A context-only sequence whose prefill is done (its first token sampled): pin its prompt's KV."""
        return PromptHandoff(seq.request.request_id, [token], self.pin(seq.block_tables, seq.num_prompt_tokens))

    def take(self, handle: str) -> PinnedPrompt | None:
        """The pin (its blocks still held: call release() once they are read), or None: unknown or expired."""
        self.expire()
        return self.pins.pop(handle, None)

    def release(self, pin: PinnedPrompt) -> None:
        for table in pin.blocks:
            self.block_manager.release(table)
        self._give_back(1, pin.num_blocks)

    def expire(self, now: float | None = None) -> int:
        """Release the pins nobody fetched in time; returns how many."""
        now = time.monotonic() if now is None else now
        old = [h for h, p in self.pins.items() if p.expires_at <= now]
        for handle in old:
            self.release(self.pins.pop(handle))
        self.num_expired += len(old)
        return len(old)


class PinReservation:
    """Room one context-only request holds from before it is queued until it finished (its pin, if it made one,
    counts on its own from then)."""

    def __init__(self, pinned: PinnedPrompts, blocks: int):
        self._pinned, self._blocks = pinned, blocks
        self._lock = threading.Lock()
        self._released = False

    def release(self) -> None:
        """Give the room back (once; later calls do nothing)."""
        with self._lock:
            if self._released:
                return
            self._released = True
        self._pinned._give_back(1, self._blocks)

    def until_finished(self, sink):
        """`sink` (a request's output callback), releasing the reservation with the request's last output."""

        def watched(chunk) -> None:
            try:
                sink(chunk)
            finally:
                if chunk.finish_reason is not None:
                    self.release()

        return watched
