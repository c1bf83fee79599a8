"""SubscribeKvEvents: the prefix cache's block events (stored / removed / cleared, global-attention group only) and
the engine's load, for a gateway's cache-aware routing.

The block manager calls a sink in the engine loop; the sink only appends to each subscription's bounded queue.
A subscription first gets the blocks cached when it began (taken in the same engine-loop call that registers its
queue, so nothing falls between), then a batch every `poll` seconds with the events since, each with the load, and a
load-only heartbeat (repeating the last sequence number) when nothing happened for `heartbeat` seconds. Sequence
numbers count per subscription from 1; a subscriber resuming from a number (start_sequence_number > 0) or one that
fell `max_queued` events behind gets DATA_LOSS, and resubscribes to a fresh snapshot."""

from __future__ import annotations

import asyncio
import time
from collections import deque

import grpc
from smg_grpc_proto.generated import common_pb2 as cpb

from petrel.serve.worker_info import engine_load


def int64_hash(digest: bytes) -> int:
    """A petrel block hash (sha256 digest) as the proto's int64: its first 8 bytes, big-endian, signed."""
    return int.from_bytes(digest[:8], "big", signed=True)


class _Subscription:
    def __init__(self, max_queued: int):
        self.events: deque = deque()
        self.max_queued = max_queued
        self.overflowed = False

    def put(self, event: tuple) -> None:  # the engine loop
        if len(self.events) >= self.max_queued:
            self.overflowed = True
            return
        self.events.append(event)

    def drain(self) -> list[tuple]:
        out = []
        while self.events:
            out.append(self.events.popleft())
        return out


def events_to_proto(events: list[tuple], block_size: int, first_id: int) -> list:
    """KvCacheEvents: a run of stored blocks each chained on the previous one becomes one KvBlocksStored."""
    out: list = []
    last_stored = None
    for event in events:
        kind = event[0]
        if kind == "stored":
            _, digest, parent, tokens = event
            block = cpb.KvBlock(block_hash=int64_hash(digest), token_ids=list(tokens), block_size=block_size)
            if last_stored is not None and parent == last_stored[0]:
                last_stored[1].stored.blocks.append(block)
            else:
                stored = cpb.KvBlocksStored(blocks=[block])
                if parent is not None:
                    stored.parent_block_hash = int64_hash(parent)
                out.append(cpb.KvCacheEvent(event_id=first_id + len(out), stored=stored))
            last_stored = (digest, out[-1])
            continue
        last_stored = None
        if kind == "removed":
            removed = cpb.KvBlocksRemoved(block_hashes=[int64_hash(event[1])])
            out.append(cpb.KvCacheEvent(event_id=first_id + len(out), removed=removed))
        else:
            out.append(cpb.KvCacheEvent(event_id=first_id + len(out), cleared=cpb.KvCacheCleared()))
    return out


def _cached_blocks(bm) -> list[tuple]:
    """The global-attention group's cached blocks as stored events (no parents: a snapshot, in block order)."""
    return [
        ("stored", h, None, bm.block_tokens[b])
        for h, b in bm.hash_to_block.items()
        if isinstance(h, bytes) and b in bm.block_tokens
    ]


class KvEventStream:
    def __init__(self, llm, poll: float = 0.05, heartbeat: float = 1.0, max_queued: int = 100_000):
        self.llm = llm
        self.poll = poll
        self.heartbeat = heartbeat
        self.max_queued = max_queued
        self._subscriptions: list[_Subscription] = []  # replaced, never mutated: the engine loop iterates it

    def _sink(self, event: tuple) -> None:
        for sub in self._subscriptions:
            sub.put(event)

    def _register(self, core, sub: _Subscription) -> list[tuple]:
        bm = core.block_manager
        bm.kv_event_sink = self._sink
        self._subscriptions = [*self._subscriptions, sub]
        return _cached_blocks(bm)

    def _unregister(self, sub: _Subscription) -> None:
        self._subscriptions = [s for s in self._subscriptions if s is not sub]

    async def engine_load(self) -> dict:
        """worker_info.engine_load, read in the engine loop."""
        return await asyncio.to_thread(self.llm.engine.call, engine_load, 5.0)

    async def _load(self, sample: int, load_only: bool) -> cpb.EngineLoad:
        state = await self.engine_load()
        return cpb.EngineLoad(
            running_requests=state["num_running_reqs"],
            waiting_requests=state["num_waiting_reqs"],
            token_usage=state["token_usage"],
            active_token_usage=state["token_usage"],
            max_running_requests=self.llm.config.max_num_seqs,
            sample=sample,
            load_only=load_only,
            cache_hit_rate=state["cache_hit_rate"],
            num_used_tokens=state["num_used_tokens"],
            max_total_num_tokens=state["max_total_num_tokens"],
        )

    async def subscribe(self, request, context):
        if request.start_sequence_number > 0:
            await context.abort(
                grpc.StatusCode.DATA_LOSS,
                f"cannot replay from sequence {request.start_sequence_number}: subscribe from 0 for a fresh snapshot",
            )
        await context.send_initial_metadata(())
        sub = _Subscription(self.max_queued)
        block_size = self.llm.engine.core.block_manager.block_size
        seq = sample = 0
        if request.load_records_before_first_batch:
            sample += 1
            yield cpb.KvEventBatch(sequence_number=0, timestamp=time.time(), load=await self._load(sample, True))
        pending = await asyncio.to_thread(self.llm.engine.call, lambda core: self._register(core, sub), 10.0)
        try:
            quiet_since = time.monotonic()
            while True:
                pending += sub.drain()
                if sub.overflowed:
                    await context.abort(grpc.StatusCode.DATA_LOSS, "the subscriber fell behind: resubscribe")
                if pending:
                    seq += 1
                    sample += 1
                    events = events_to_proto(pending, block_size, 1)
                    pending = []
                    yield cpb.KvEventBatch(
                        sequence_number=seq, timestamp=time.time(), events=events, load=await self._load(sample, False)
                    )
                    quiet_since = time.monotonic()
                elif time.monotonic() - quiet_since >= self.heartbeat:
                    sample += 1
                    yield cpb.KvEventBatch(
                        sequence_number=seq, timestamp=time.time(), load=await self._load(sample, True)
                    )
                    quiet_since = time.monotonic()
                await asyncio.sleep(self.poll)
        finally:
            self._unregister(sub)
