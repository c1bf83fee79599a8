"""Paged KV blocks: a pool with ref counts, a hash-chained prefix cache and LRU eviction. No torch here.

A block is in exactly one state: free (no content worth keeping), used (ref count > 0), or cached
(ref count 0 but its hash is kept, evictable least-recently-used first). Cached blocks have a retention priority
(petrel/engine/kv_retention.py: a request's KvCacheRetentionConfig; the default otherwise): the lowest priority goes
first, least recently used first among equals (petrel/engine/eviction.py).

Sliding window: when every layer of the model attends to the same last W positions, a running sequence gives
back each block that no future query can see (free_behind_window). Its block-table entry becomes FREED, so the
table keeps its positional layout (position p lives in block_table[p // block_size]); the freed entries always
form a prefix of the table, and free / fork / retain / prefix-cache publishing skip them. With attention sinks
(sink_tokens: every query also sees the first positions) a windowed table keeps its first sink blocks, and the
freed entries form a run right after them instead.

KV groups (petrel/engine/kv_groups.py): a model mixing sliding-window and global layers has one block table per
group of layers (seq.block_tables; seq.block_table is group 0's), all drawing from this one pool. The tables keep
the same positional layout; only a sliding group's table frees behind its window. Each allocation covers every
group, and the prefix cache keys a block by (group, hash): a hit counts only as far as every group holds what its
layers will read (a global group all blocks of the hit, a sliding group those its window still sees).

Partial reuse (enable_partial_reuse, TensorRT-LLM's): after the whole blocks a prompt matches, the block after them
may match in part: a cached block with the same parent in the chain whose first k tokens equal the prompt's next k
gives them too. With copy_on_partial_reuse its KV is copied into a fresh block (any number of requests may do so);
without, the request takes the cached block itself when no one else uses it (it leaves the prefix cache: its later
slots are overwritten). Requests whose blocks are keyed by more than their tokens (images, given positions, extra
ids of virtual tokens) take whole blocks only, and their blocks are never partly reused.

Lower KV tiers (petrel/kv_tiers, when the engine has them): an evicted cached block is listed for the engine to copy
out, and a prefix lookup continues past the memory hit through tier_fetch; a tier hit gets a fresh block, published
at once, whose KV (opaque here) the engine writes before the step runs (see petrel/engine/kv_tier_io.py).
blocks_past_memory names the blocks a lookup would ask the tiers for, so that the engine can read them from a slow
tier ahead of the lookup.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import itertools
import json
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from petrel.engine.eviction import EvictionQueue
from petrel.engine.kv_retention import DEFAULT_PRIORITY
from petrel.engine.sequence import EngineRequest, Sequence

FREED = -1  # a block-table entry whose block was given back behind the sliding window (never read unmasked)
TIER = -2  # match_prefix: a prompt block that a lower KV tier holds (not in memory)

# A block's prefix-cache key: group 0's is its chain hash, another group's (group, hash) (see _cache_key)
CacheKey = bytes | tuple[int, bytes]
# KV events for the sink: ("stored", hash, parent hash or None, token ids), ("removed", hash) or ("cleared",)
KvEvent = tuple[Any, ...]
# a prompt block's lookup, cached(group, block index): the group's block for it, TIER, or None (see match_prefix)
CachedLookup = Callable[[int, int], int | None]


def num_freed_blocks(block_table: list[int], start: int = 0) -> int:
    """How many entries of a block table from `start` on are FREED (they always form a run there: from 0, or from
    the end of the sink blocks)."""
    return bisect.bisect_left(block_table, True, lo=min(start, len(block_table)), key=lambda b: b != FREED) - min(
        start, len(block_table)
    )


def held_blocks(block_table: list[int]) -> list[int]:
    """The blocks a table actually holds (FREED entries left out)."""
    if not block_table or block_table[0] == FREED:  # behind a window, from the start
        return block_table[num_freed_blocks(block_table) :]
    if FREED not in block_table:
        return block_table[:]
    return [b for b in block_table if b != FREED]  # a run after the sink blocks


def _keyed_by_tokens_alone(request: EngineRequest) -> bool:
    """Whether a request's blocks are keyed by their tokens (and chain) alone: only those take part in partial
    reuse, whose match compares tokens."""
    return request.multi_modal is None and request.position_ids is None and request.token_extra_ids is None


def _common_prefix(a: Iterable[int], b: Iterable[int]) -> int:
    """How many leading items a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _cache_key(group: int, block_hash: bytes) -> CacheKey:
    """A block's prefix-cache key: group 0's is the hash itself, another group's the pair (the same tokens have a
    block in every group, each holding its own layers' KV)."""
    return block_hash if group == 0 else (group, block_hash)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_seed: str = "",
        watermark: float = 0.01,
        sliding_window: int | None = None,
        group_windows: list[int | None] | None = None,
        sink_tokens: int = 0,
    ):
        """sliding_window: the window of every layer of the model (None: some layer sees all positions); with
        one, free_behind_window gives back the blocks behind it. group_windows: instead, one window per KV group
        (a block table per group; see petrel/engine/kv_groups.py). sink_tokens: the first positions every query of
        a windowed group also sees (attention sinks): their blocks are never given back."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one slot, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_seed = hash_seed
        self.windows: list[int | None] = list(group_windows) if group_windows is not None else [sliding_window]
        self.num_groups = len(self.windows)
        self.sink_blocks = -(-sink_tokens // block_size)  # a windowed table's first blocks, kept for the sinks
        # partial reuse of the block after a prefix hit (see the module's doc); children: cached blocks by their
        # parent's cache key, to find the candidates
        self.partial_reuse = False
        self.copy_on_partial_reuse = True
        self.children: dict[CacheKey, dict[int, None]] = {}
        self.block_parent: dict[int, CacheKey] = {}
        self._copy_sources: list[int] = []  # blocks held until the runner has copied them (take_pending_copies)
        self.watermark_blocks = int(watermark * num_blocks)
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        # cached blocks, in eviction order (lowest priority, then LRU, first)
        self.evictable: EvictionQueue[int] = EvictionQueue()
        # retention priorities of cached or used blocks other than the default, and when they run out
        self.block_priority: dict[int, int] = {}
        self._expiry: list[tuple[float, int, int]] = []  # (time, serial, block) heap of priorities that expire
        self._expiry_serial: dict[int, int] = {}  # block -> the serial of its live expiry
        self._serials = itertools.count()
        self.clock: Callable[[], float] = time.monotonic
        # a lower KV tier takes an evicted block only if its priority is at least this (secondary_offload_min_priority)
        self.offload_min_priority = DEFAULT_PRIORITY
        self.hash_to_block: dict[CacheKey, int] = {}
        self.block_hash: dict[int, CacheKey] = {}
        self.block_tokens: dict[int, tuple[int, ...]] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) copy-on-write, for the runner
        # KV events (a gateway's cache-aware routing): called in the engine loop with ("stored", hash, parent hash
        # or None, token ids), ("removed", hash) or ("cleared",) for the global-attention group's blocks
        self.kv_event_sink: Callable[[KvEvent], None] | None = None
        # lower KV tiers (petrel/kv_tiers), when the engine has them: tier_fetch(group, hash, tokens) returns a
        # checked block's KV (opaque here) or None. A cached block evicted for reuse is listed in
        # pending_evictions (block, group, hash, tokens) for the runner to copy out before anything writes it; a
        # block allocated for a tier hit has its KV in pending_loads (block -> KV) for the runner to write before
        # the step that reads it (both drained by the engine right after scheduling).
        self.tier_fetch: Callable[[int, bytes, tuple[int, ...]], object | None] | None = None
        self.pending_evictions: list[tuple[int, int, bytes, tuple[int, ...]]] = []
        self.evicted_priorities: dict[tuple[int, bytes], int] = {}  # (group, hash) -> a non-default priority
        self.pending_loads: dict[int, object] = {}
        # a shared store (publish_computed): every block cache_computed_blocks publishes is listed in
        # pending_publishes (block, group, hash, tokens) for the runner to copy out to the store
        self.publish_computed = False
        self.pending_publishes: list[tuple[int, int, bytes, tuple[int, ...]]] = []

    # ------------------------------------------------------------------ groups
    @property
    def sliding_window(self) -> int | None:
        """The window of a one-group manager (None with several groups, or none)."""
        return self.windows[0] if self.num_groups == 1 else None

    @property
    def frees_blocks(self) -> bool:
        """Whether some group gives back blocks behind a window."""
        return any(w is not None for w in self.windows)

    def _tables(self, seq: Sequence) -> list[list[int]]:
        """The sequence's tables, one per group (a sequence that holds nothing gets empty ones)."""
        if len(seq.block_tables) != self.num_groups:
            assert not any(seq.block_tables), "a sequence's tables belong to another block manager"
            seq.block_tables = [[] for _ in range(self.num_groups)]
        return seq.block_tables

    # ------------------------------------------------------------------ counts
    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation can take now (free + cached)."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def check_integrity(self) -> None:
        used = sum(1 for r in self.ref_counts if r > 0)
        assert len(self.free_blocks) + len(self.evictable) + used == self.num_blocks, "block states do not add up"
        assert not any(self.ref_counts[b] for b in self.free_blocks), "a free block is referenced"
        assert not any(self.ref_counts[b] for b in self.evictable), "a cached block is referenced"
        assert all(self.hash_to_block[h] == b for b, h in self.block_hash.items() if h in self.hash_to_block)

    # ------------------------------------------------------------------ hashing
    def root_hash(self, cache_salt: str | None, lora_int_id: int = 0, prompt_table: str = "") -> bytes:
        """The chain's root: the hash seed, the request's cache salt, its LoRA adapter (0: none) and its prompt
        tuning table's digest ('': none), so that different adapters or tables never share KV blocks of the same
        tokens. The salt is written JSON-quoted: a salt that spells another one's adapter (`x:lora=1`) is not that
        salt with that adapter, and no salt keeps the hash it always had."""
        salt = json.dumps(cache_salt) if cache_salt else ""
        lora = f":lora={lora_int_id}" if lora_int_id else ""
        table = f":prompt_table={prompt_table}" if prompt_table else ""
        return hashlib.sha256(f"petrel:{self.hash_seed}:{salt}{lora}{table}".encode("utf-8", "surrogatepass")).digest()

    def _extend_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        bs = self.block_size
        while len(seq.block_hashes) < num_full_blocks:
            i = len(seq.block_hashes)
            req = seq.request
            parent = (
                seq.block_hashes[-1] if i else self.root_hash(req.cache_salt, req.lora_int_id, req.prompt_table_digest)
            )
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            # the content hashes of the images whose rows the block holds: same tokens, other image, other block
            media = req.multi_modal.block_key(i, bs) if req.multi_modal is not None else b""
            seq.block_hashes.append(
                hashlib.sha256(
                    parent + repr(tokens).encode() + (b"|mm:" + media if media else b"") + req.block_key(i, bs)
                ).digest()
            )

    # ------------------------------------------------------------------ allocation
    def _take_block(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.popleft()
            self.pending_loads.pop(block, None)
        else:
            if self._expiry:
                self._expire()
            block, _ = self.evictable.popitem(last=False)
            priority = self._forget_priority(block)
            self._forget_parent(block)
            h = self.block_hash.pop(block)
            tokens = self.block_tokens.pop(block, None)
            if (
                self.pending_loads.pop(block, None) is None
                and self.tier_fetch is not None
                and tokens is not None
                and priority >= self.offload_min_priority
            ):
                group, block_hash = h if isinstance(h, tuple) else (0, h)
                self.pending_evictions.append((block, group, block_hash, tokens))  # its KV goes down a tier
                if priority != DEFAULT_PRIORITY:  # the host tier orders what it keeps by it
                    self.evicted_priorities[group, block_hash] = priority
            if self.hash_to_block.get(h) == block:
                del self.hash_to_block[h]
                if self.kv_event_sink is not None and isinstance(h, bytes):
                    self.kv_event_sink(("removed", h))
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if block in self.block_hash:
                self.evictable.add(block, self.block_priority.get(block, DEFAULT_PRIORITY))  # newest of its priority
            else:
                self._forget_priority(block)
                self.free_blocks.append(block)

    # ------------------------------------------------------------------ retention priorities
    def set_priority(self, block: int, priority: int, duration: float | None = None) -> None:
        """A cached (or used) block's retention priority, back to the default after `duration` seconds (None: for
        good); a cached block moves to its new place in the eviction order."""
        self._expiry_serial.pop(block, None)
        if priority == DEFAULT_PRIORITY:
            self.block_priority.pop(block, None)
        else:
            self.block_priority[block] = priority
            if duration is not None:
                serial = next(self._serials)
                self._expiry_serial[block] = serial
                heapq.heappush(self._expiry, (self.clock() + duration, serial, block))
        if block in self.evictable:
            self.evictable.add(block, priority)

    def _expire(self) -> None:
        """Priorities whose duration has passed go back to the default."""
        now = self.clock()
        while self._expiry and self._expiry[0][0] <= now:
            _, serial, block = heapq.heappop(self._expiry)
            if self._expiry_serial.get(block) == serial:
                self.set_priority(block, DEFAULT_PRIORITY)

    def _forget_priority(self, block: int) -> int:
        """The block leaves the cache: its priority (returned) is forgotten."""
        self._expiry_serial.pop(block, None)
        return self.block_priority.pop(block, DEFAULT_PRIORITY)

    def _apply_retention(self, block: int, seq: Sequence, i: int) -> None:
        """Give the sequence's block i the priority its request's retention policy says (if it has one)."""
        retention = seq.request.kv_retention
        if retention is not None:
            self.set_priority(block, *retention.block_priority(i, self.block_size, seq.num_prompt_tokens))

    def match_prefix(self, seq: Sequence) -> None:
        """On admission: take the longest chain of cached full blocks of the prompt (never all of it:
        at least one token is left to compute, so the step yields logits). With a window, a group needs only
        the blocks its window sees from the end of the hit; the ones behind it are entered FREED. With lower
        tiers, a block missing in memory is looked up there (checked KV, or None); the hits get fresh blocks
        (only when all of them fit in the free and cached blocks: else the hit is the memory part alone)."""
        tables = self._tables(seq)
        assert not any(tables) and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching or seq.params.needs_context_outputs:
            return
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        self._extend_hashes(seq, max_blocks)
        found: dict[tuple[int, int], int | None] = {}
        loaded: dict[tuple[int, int], object] = {}  # (group, block): KV a lower tier holds for it

        def cached(g: int, i: int) -> int | None:  # group g's block for prompt block i, looked up once
            if (g, i) not in found:
                block = self.hash_to_block.get(_cache_key(g, seq.block_hashes[i]))
                tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                found[g, i] = block if block is not None and self.block_tokens.get(block) == tokens else None
                if found[g, i] is None and self.tier_fetch is not None:
                    kv = self.tier_fetch(g, seq.block_hashes[i], tokens)
                    if kv is not None:
                        loaded[g, i] = kv
                        found[g, i] = TIER
            return found[g, i]

        hit = self._longest_hit(seq, max_blocks, cached)
        if self.tier_fetch is not None:
            wanted = self._tier_blocks_wanted(seq, hit, cached)
            room = self.num_free_blocks - sum(
                1 for (g, i), b in found.items() if b not in (None, TIER) and self.ref_counts[b] == 0 and i < hit
            )
            if wanted > room:  # no room to bring them back now: the in-memory part only
                for k in [k for k, b in found.items() if b == TIER]:
                    del found[k]
                loaded.clear()
                fetch, self.tier_fetch = self.tier_fetch, None
                try:
                    hit = self._longest_hit(seq, max_blocks, cached)
                finally:
                    self.tier_fetch = fetch
        whole = seq.request.context_only
        to_load = []  # (table, index, group, prompt block)
        for g, table in enumerate(tables):
            needed = self._needed(g, hit, whole)
            for i in range(hit):
                if not needed(i):
                    table.append(FREED)
                    continue
                block = cached(g, i)
                assert block is not None, "_longest_hit keeps only blocks every group holds"
                if block == TIER:
                    to_load.append((table, len(table), g, i))
                    table.append(FREED)  # filled below, once every memory hit is held
                    continue
                if self.ref_counts[block] == 0:
                    self.evictable.pop(block)
                self.ref_counts[block] += 1
                table.append(block)
                self._apply_retention(block, seq, i)
        for table, index, g, i in to_load:  # fresh blocks for the tier hits, published at once
            block = self._take_block()
            table[index] = block
            self.pending_loads[block] = loaded[g, i]
            self._publish(block, g, seq, i)
        seq.num_computed_tokens = hit * bs
        if self.partial_reuse and _keyed_by_tokens_alone(seq.request):
            self._match_partial(seq, hit)
        # after a preemption the chain can run into the sequence's own output: report prompt tokens only
        seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)

    def _match_partial(self, seq: Sequence, hit: int) -> None:
        """After a hit of `hit` whole blocks: the next block's first tokens from a cached block of the same parent
        that holds them (the most of them; see the module's doc). Every group must have such a block."""
        bs = self.block_size
        start = hit * bs
        limit = min(bs, seq.num_tokens - 1 - start)  # at least one token is left to compute
        tables = self._tables(seq)
        if limit <= 0 or len(tables[0]) != hit:
            return
        want = seq.token_ids[start : start + limit]
        parent = seq.block_hashes[hit - 1] if hit else self._chain_root(seq)
        picks, matched = [], limit
        for g in range(self.num_groups):
            best, best_k = None, 0
            for block in self.children.get(_cache_key(g, parent), ()):
                if not self.copy_on_partial_reuse and self.ref_counts[block]:
                    continue  # taken over only when no one else uses it
                k = _common_prefix(self.block_tokens[block], want)
                if k > best_k:
                    best, best_k = block, k
            if best is None:
                return
            picks.append(best)
            matched = min(matched, best_k)
        if self.copy_on_partial_reuse:
            for block in picks:  # held while fresh blocks are taken, so none of them is evicted for one
                self._hold(block)
            if len(picks) > self.num_free_blocks:
                for block in picks:
                    self._release(block)
                return
            for table, block in zip(tables, picks):
                fresh = self._take_block()
                self.pending_copies.append((block, fresh))
                self._copy_sources.append(block)  # released once the runner has the copies
                table.append(fresh)
        else:
            for table, block in zip(tables, picks):
                self._hold(block)
                self._uncache(block)  # its slots from `matched` on will be overwritten
                table.append(block)
        seq.num_computed_tokens = start + matched

    def _hold(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            self.evictable.pop(block)
        self.ref_counts[block] += 1

    def _chain_root(self, seq: Sequence) -> bytes:
        req = seq.request
        return self.root_hash(req.cache_salt, req.lora_int_id, req.prompt_table_digest)

    def _uncache(self, block: int) -> None:
        """The block leaves the prefix cache (it stays with whoever holds it)."""
        h = self.block_hash.pop(block, None)
        self.block_tokens.pop(block, None)
        self._forget_parent(block)
        self._forget_priority(block)
        if h is not None and self.hash_to_block.get(h) == block:
            del self.hash_to_block[h]
            if self.kv_event_sink is not None and isinstance(h, bytes):
                self.kv_event_sink(("removed", h))

    def _forget_parent(self, block: int) -> None:
        parent = self.block_parent.pop(block, None)
        if parent is not None:
            siblings = self.children[parent]
            del siblings[block]
            if not siblings:
                del self.children[parent]

    def _tier_blocks_wanted(self, seq: Sequence, hit: int, cached: CachedLookup) -> int:
        whole = seq.request.context_only
        total = 0
        for g in range(self.num_groups):
            needed = self._needed(g, hit, whole)
            total += sum(1 for i in range(hit) if needed(i) and cached(g, i) == TIER)
        return total

    def _longest_hit(self, seq: Sequence, max_blocks: int, cached: CachedLookup) -> int:
        """How many of the prompt's first blocks every group holds (cached(g, i) not None) as far as it reads."""
        tables = self._tables(seq)
        whole = seq.request.context_only  # its prompt is exported whole: every group needs every block
        hit, settled = max_blocks, False
        while not settled:  # shorten the hit until every group holds the blocks it reads of it
            settled = True
            for g in range(len(tables)):
                first = 0 if whole else self._first_needed(g, hit)
                missing = (
                    next((i for i in range(first, hit) if cached(g, i) is None), None)
                    if self.windows[g] is None
                    else next((i for i in reversed(range(first, hit)) if cached(g, i) is None), None)
                )
                if missing is None and first > 0:  # the sink blocks, read by every query of a windowed group
                    missing = next((i for i in range(min(self.sink_blocks, first)) if cached(g, i) is None), None)
                if missing is not None:
                    hit, settled = missing, False
        return hit

    def _first_needed(self, group: int, num_blocks: int) -> int:
        """The first block a group still reads once num_blocks full blocks are computed (0 without a window),
        apart from the sink blocks before it (see _needed)."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(0, min((num_blocks * self.block_size - window) // self.block_size, num_blocks))

    def _needed(self, group: int, num_blocks: int, whole: bool = False) -> Callable[[int], bool]:
        """Whether the group reads block i once num_blocks full blocks are computed: every block from the first
        its window sees, and the sink blocks (every block with `whole`: a context-only prompt is exported)."""
        first = 0 if whole else self._first_needed(group, num_blocks)
        sinks = self.sink_blocks if self.windows[group] is not None else 0
        return lambda i: i >= first or i < sinks

    def free_behind_window(self, seq: Sequence) -> int:
        """Give back the sequence's blocks that every future query has behind its sliding window; returns how many.

        The next query sits at position num_computed_tokens (a decode, a prefill chunk's first token, or the
        first of speculative draft tokens; rejected drafts only ever lie ahead of it) and sees keys from
        num_computed_tokens - W + 1 on, so a block ending at or before num_computed_tokens - W is never read
        again (one position of slack). A freed block keeps its prefix-cache hash: released, it stays cached
        (its contents are still valid for other prompts). A context-only request keeps its whole prompt: the
        decode instance fetches all of it.
        """
        if seq.request.context_only:
            return 0
        given_back = 0
        for window, table in zip(self.windows, self._tables(seq)):
            if window is None:
                continue
            end = min((seq.num_computed_tokens - window) // self.block_size, len(table))
            start = self.sink_blocks + num_freed_blocks(table, self.sink_blocks)  # the sink blocks stay
            for i in range(start, end):  # oldest first, so the oldest is evicted first
                self._release(table[i])
                table[i] = FREED
            given_back += max(0, end - start)
        return given_back

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, admitting: bool = False) -> bool:
        """Make room for the next num_new_tokens KV entries in every group; False (and nothing changed) if it cannot."""
        bs = self.block_size
        tables = seq.block_tables if len(seq.block_tables) == self.num_groups else self._tables(seq)
        needed = -(-(seq.num_computed_tokens + num_new_tokens) // bs) - len(tables[0])
        first = seq.num_computed_tokens // bs
        copy_on_write = []  # tables whose shared partial block is written next
        if seq.num_computed_tokens % bs != 0 and first < len(tables[0]):
            for table in tables:
                if self.ref_counts[table[first]] > 1:
                    copy_on_write.append(table)
        reserve = self.watermark_blocks if admitting else 0
        if max(needed, 0) * len(tables) + len(copy_on_write) > self.num_free_blocks - reserve:
            return False
        for table in copy_on_write:
            shared = table[first]
            fresh = self._take_block()
            self.pending_copies.append((shared, fresh))
            table[first] = fresh
            self._release(shared)
        for table in tables:
            for _ in range(needed):
                table.append(self._take_block())
        return True

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Publish the sequence's full, computed blocks in the prefix cache (every group's)."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        self._extend_hashes(seq, num_full)
        tables = seq.block_tables if len(seq.block_tables) == self.num_groups else self._tables(seq)
        for g, table in enumerate(tables):
            for i in range(num_full):
                block = table[i]
                if block == FREED or block in self.block_hash:
                    continue
                if _cache_key(g, seq.block_hashes[i]) in self.hash_to_block:  # computed twice at once: keep the first
                    continue
                self._publish(block, g, seq, i)
                if self.publish_computed:  # computed here: the shared store gets it too
                    self.pending_publishes.append((block, g, seq.block_hashes[i], self.block_tokens[block]))

    def _publish(self, block: int, group: int, seq: Sequence, i: int) -> None:
        """Enter `block` in the prefix cache as group `group`'s copy of the sequence's prompt block i (its hash and
        tokens), and tell the KV event sink of group 0's."""
        bs = self.block_size
        key = _cache_key(group, seq.block_hashes[i])
        self.block_hash[block] = key
        self.hash_to_block[key] = block
        self.block_tokens[block] = tuple(seq.token_ids[i * bs : (i + 1) * bs])
        self._apply_retention(block, seq, i)
        if self.partial_reuse and _keyed_by_tokens_alone(seq.request):
            parent_key = _cache_key(group, seq.block_hashes[i - 1] if i else self._chain_root(seq))
            self.children.setdefault(parent_key, {})[block] = None
            self.block_parent[block] = parent_key
        if group == 0 and self.kv_event_sink is not None:
            parent = seq.block_hashes[i - 1] if i else None
            self.kv_event_sink(("stored", key, parent, self.block_tokens[block]))

    def blocks_past_memory(self, seq: Sequence) -> list[tuple[int, bytes]]:
        """(group, hash) of the prompt's full blocks a prefix lookup may match, from the first one some group's
        prefix cache lacks on, in chain order: what a lower tier would have to serve ([] for a sequence that takes
        no prefix hit)."""
        if not self.enable_prefix_caching or seq.params.needs_context_outputs:
            return []
        hashes = self.prompt_block_hashes(seq)
        groups = range(self.num_groups)
        first = next(
            (i for i, h in enumerate(hashes) if any(_cache_key(g, h) not in self.hash_to_block for g in groups)),
            len(hashes),
        )
        return [(g, h) for h in hashes[first:] for g in groups]

    def prompt_block_hashes(self, seq: Sequence) -> list[bytes]:
        """The chain hashes of the prompt's full blocks a prefix lookup may match (not the one holding its last
        token, which is always computed)."""
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, max_blocks)
        return list(seq.block_hashes[:max_blocks])

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares all of the parent's blocks; a shared partial block is copied on first write."""
        child.block_tables = [list(table) for table in self._tables(parent)]
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        for table in child.block_tables:
            for block in held_blocks(table):
                self.ref_counts[block] += 1

    def free(self, seq: Sequence) -> None:
        # release in reverse so that a sequence's tail is evicted before its head
        for table in seq.block_tables:
            for block in reversed(held_blocks(table)):
                self._release(block)
        seq.block_tables = [[] for _ in range(self.num_groups)]
        seq.num_computed_tokens = 0

    def retain(self, blocks: list[int]) -> None:
        """Hold one more reference on blocks in use (a pin that outlives its sequence); FREED entries are skipped."""
        for block in held_blocks(blocks):
            assert self.ref_counts[block] > 0, "only a block in use can be retained"
            self.ref_counts[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Give back references taken with retain()."""
        for block in reversed(held_blocks(blocks)):
            self._release(block)

    def forget_contents(self, blocks: list[int]) -> None:
        """These blocks' KV was never written (a tier load failed): they leave the prefix cache, so nothing reuses
        them; a sequence holding one still holds it (its step failed and is aborted)."""
        for block in blocks:
            h = self.block_hash.pop(block, None)
            self.block_tokens.pop(block, None)
            if h is not None and self.hash_to_block.get(h) == block:
                del self.hash_to_block[h]
            self._forget_parent(block)
            if self.ref_counts[block] == 0 and block in self.evictable:
                del self.evictable[block]
                self._forget_priority(block)
                self.free_blocks.append(block)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """The copies for the runner to make before the step writes anything; the partial-reuse sources held for
        them are let go (nothing can take them before the copies run)."""
        copies, self.pending_copies = self.pending_copies, []
        sources, self._copy_sources = self._copy_sources, []
        for block in sources:
            self._release(block)
        return copies

    def reset_prefix_cache(self) -> None:
        for block in list(self.evictable):
            del self.evictable[block]
            self._forget_priority(block)
            self._forget_parent(block)
            self.free_blocks.append(block)
        self.hash_to_block.clear()
        if self.kv_event_sink is not None:
            self.kv_event_sink(("cleared",))
        self.block_hash = {b: h for b, h in self.block_hash.items() if self.ref_counts[b] > 0}
        self.block_tokens = {b: t for b, t in self.block_tokens.items() if b in self.block_hash}
        for b, h in self.block_hash.items():
            self.hash_to_block[h] = b
