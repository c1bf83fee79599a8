"""Paged KV blocks: a pool with ref counts, a hash-chained prefix cache and LRU eviction. No torch here.

A block is in exactly one state: free (no content worth keeping), used (ref count > 0), or cached
(ref count 0 but its hash is kept, evictable least-recently-used first).

Sliding window: when every layer of the model attends to the same last W positions, a running sequence gives
back each block that no future query can see (free_behind_window). Its block-table entry becomes FREED, so the
table keeps its positional layout (position p lives in block_table[p // block_size]); the freed entries always
form a prefix of the table, and free / fork / retain / prefix-cache publishing skip them.
"""
from __future__ import annotations

import bisect
import hashlib
from collections import OrderedDict, deque

from petrel.engine.sequence import Sequence

FREED = -1   # a block-table entry whose block was given back behind the sliding window (never read unmasked)


def num_freed_blocks(block_table: list[int]) -> int:
    """How many leading entries of a block table are FREED (they always form a prefix)."""
    return bisect.bisect_left(block_table, True, key=lambda b: b != FREED)


def held_blocks(block_table: list[int]) -> list[int]:
    """The blocks a table actually holds (FREED entries left out)."""
    return block_table[num_freed_blocks(block_table):]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_seed: str = "", watermark: float = 0.01, sliding_window: int | None = None):
        """sliding_window: the window of every layer of the model (None: some layer sees all positions); with
        one, free_behind_window gives back the blocks behind it."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one slot, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_seed = hash_seed
        self.sliding_window = sliding_window
        self.watermark_blocks = int(watermark * num_blocks)
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()   # cached blocks, LRU first
        self.hash_to_block: dict[bytes, int] = {}
        self.block_hash: dict[int, bytes] = {}
        self.block_tokens: dict[int, tuple[int, ...]] = {}
        self.pending_copies: list[tuple[int, int]] = []          # (src, dst) copy-on-write, for the runner

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
    def root_hash(self, cache_salt: str | None, lora_int_id: int = 0) -> bytes:
        """The chain's root: the hash seed, the request's cache salt and its LoRA adapter (0: none), so that
        different adapters never share KV blocks of the same tokens."""
        lora = f":lora={lora_int_id}" if lora_int_id else ""
        return hashlib.sha256(f"petrel:{self.hash_seed}:{cache_salt or ''}{lora}".encode()).digest()

    def _extend_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        bs = self.block_size
        while len(seq.block_hashes) < num_full_blocks:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if i else self.root_hash(seq.request.cache_salt, seq.request.lora_int_id)
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            seq.block_hashes.append(hashlib.sha256(parent + repr(tokens).encode()).digest())

    # ------------------------------------------------------------------ allocation
    def _take_block(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)
            h = self.block_hash.pop(block)
            self.block_tokens.pop(block, None)
            if self.hash_to_block.get(h) == block:
                del self.hash_to_block[h]
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if block in self.block_hash:
                self.evictable[block] = None      # newest at the end
            else:
                self.free_blocks.append(block)

    def match_prefix(self, seq: Sequence) -> None:
        """On admission: take the longest chain of cached full blocks of the prompt (never all of it:
        at least one token is left to compute, so the step yields logits)."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching or seq.params.needs_context_outputs:
            return
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, max_blocks)
        for i in range(max_blocks):
            block = self.hash_to_block.get(seq.block_hashes[i])
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            if block is None or self.block_tokens.get(block) != tokens:
                break
            if self.ref_counts[block] == 0:
                self.evictable.pop(block)
            self.ref_counts[block] += 1
            seq.block_table.append(block)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        # after a preemption the chain can run into the sequence's own output: report prompt tokens only
        seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
        self.free_behind_window(seq)      # a long hit need not hold the blocks behind the window

    def free_behind_window(self, seq: Sequence) -> int:
        """Give back the sequence's blocks that every future query has behind its sliding window; returns how many.

        The next query sits at position num_computed_tokens (a decode, a prefill chunk's first token, or the
        first of speculative draft tokens; rejected drafts only ever lie ahead of it) and sees keys from
        num_computed_tokens - W + 1 on, so a block ending at or before num_computed_tokens - W is never read
        again (one position of slack). A freed block keeps its prefix-cache hash: released, it stays cached
        (its contents are still valid for other prompts). A context-only request keeps its whole prompt: the
        decode instance fetches all of it.
        """
        window = self.sliding_window
        if window is None or seq.request.context_only:
            return 0
        table = seq.block_table
        end = min((seq.num_computed_tokens - window) // self.block_size, len(table))
        start = num_freed_blocks(table)
        for i in range(start, end):       # oldest first, so the oldest is evicted first
            self._release(table[i])
            table[i] = FREED
        return max(0, end - start)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, admitting: bool = False) -> bool:
        """Make room for the next num_new_tokens KV entries; False (and nothing changed) if it cannot."""
        bs = self.block_size
        needed = -(-(seq.num_computed_tokens + num_new_tokens) // bs) - len(seq.block_table)
        first = seq.num_computed_tokens // bs
        copy_on_write = (seq.num_computed_tokens % bs != 0 and first < len(seq.block_table)
                         and self.ref_counts[seq.block_table[first]] > 1)
        reserve = self.watermark_blocks if admitting else 0
        if max(needed, 0) + copy_on_write > self.num_free_blocks - reserve:
            return False
        if copy_on_write:
            shared = seq.block_table[first]
            fresh = self._take_block()
            self.pending_copies.append((shared, fresh))
            seq.block_table[first] = fresh
            self._release(shared)
        for _ in range(needed):
            seq.block_table.append(self._take_block())
        return True

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Publish the sequence's full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        self._extend_hashes(seq, num_full)
        bs = self.block_size
        for i in range(num_full):
            block = seq.block_table[i]
            if block == FREED or block in self.block_hash:
                continue
            h = seq.block_hashes[i]
            if h in self.hash_to_block:   # same content computed twice at once: keep the first
                continue
            self.block_hash[block] = h
            self.hash_to_block[h] = block
            self.block_tokens[block] = tuple(seq.token_ids[i * bs:(i + 1) * bs])

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares all of the parent's blocks; a shared partial block is copied on first write."""
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        for block in held_blocks(child.block_table):
            self.ref_counts[block] += 1

    def free(self, seq: Sequence) -> None:
        # release in reverse so that a sequence's tail is evicted before its head
        for block in reversed(held_blocks(seq.block_table)):
            self._release(block)
        seq.block_table = []
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

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def reset_prefix_cache(self) -> None:
        for block in list(self.evictable):
            del self.evictable[block]
            self.free_blocks.append(block)
        self.hash_to_block.clear()
        self.block_hash = {b: h for b, h in self.block_hash.items() if self.ref_counts[b] > 0}
        self.block_tokens = {b: t for b, t in self.block_tokens.items() if b in self.block_hash}
        for b, h in self.block_hash.items():
            self.hash_to_block[h] = b
