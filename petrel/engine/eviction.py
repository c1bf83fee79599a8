"""Cached KV blocks in eviction order: the lowest retention priority first, the least recently released first among
equals (petrel/engine/kv_retention.py says where priorities come from). No torch here.

It answers what the block manager asked of its plain LRU dict (len, in, iteration in eviction order, pop, del,
popitem(last=False) for the next victim), plus add(block, priority) and reprioritize. With every block at one
priority it is that LRU dict. Keys may be anything hashable: the host tier orders its blobs with it too."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class EvictionQueue(Generic[K]):
    def __init__(self) -> None:
        self._buckets: dict[int, OrderedDict[K, None]] = {}  # priority -> keys, least recently added first
        self._priority: dict[K, int] = {}  # key -> its bucket

    def __len__(self) -> int:
        return len(self._priority)

    def __contains__(self, key: object) -> bool:
        return key in self._priority

    def __iter__(self) -> Iterator[K]:
        """Keys in eviction order."""
        for priority in sorted(self._buckets):
            yield from list(self._buckets[priority])

    def priority_of(self, key: K) -> int | None:
        return self._priority.get(key)

    def add(self, key: K, priority: int) -> None:
        """Queue a key (or move it) to the back of its priority's line: the last of them to go."""
        self.pop(key, None)
        self._priority[key] = priority
        self._buckets.setdefault(priority, OrderedDict())[key] = None

    def touch(self, key: K) -> None:
        """The key was used: the last of its priority to go."""
        self._buckets[self._priority[key]].move_to_end(key)

    def pop(self, key: K, default: object = KeyError) -> object:
        priority = self._priority.pop(key, None)
        if priority is None:
            if default is KeyError:
                raise KeyError(key)
            return default
        bucket = self._buckets[priority]
        del bucket[key]
        if not bucket:
            del self._buckets[priority]
        return None

    def __delitem__(self, key: K) -> None:
        self.pop(key)

    def popitem(self, last: bool = False) -> tuple[K, None]:
        """The next key to evict (last=True: the one that would go last), as (key, None) like OrderedDict's."""
        if not self._priority:
            raise KeyError("popitem(): the queue is empty")
        priority = (max if last else min)(self._buckets)
        key, _ = self._buckets[priority].popitem(last=last)
        if not self._buckets[priority]:
            del self._buckets[priority]
        del self._priority[key]
        return key, None

    def peek(self) -> K | None:
        """The next key to evict, left in place (None when empty)."""
        if not self._priority:
            return None
        return next(iter(self._buckets[min(self._buckets)]))
