"""A request's KV cache retention policy (TensorRT-LLM's KvCacheRetentionConfig): which priority its cached blocks
keep, and for how long. No torch here.

Every cached block has a priority from 0 to 100 (DEFAULT_PRIORITY unless a policy says otherwise). The block
manager evicts the lowest priority first, least recently used first among equals (petrel/engine/eviction.py); a
lower KV tier takes an evicted block only if its priority is at least the engine's secondary_offload_min_priority,
and the host tier drops its lowest-priority blocks first when full.

A policy gives token ranges of the prompt [token_start, token_end) (token_end None: to the prompt's end) a priority
and optionally a duration; a block takes the range that holds its first token (no range: the default). Blocks of
generated tokens take decode_priority (and decode_duration). A duration counts from when the block is first cached;
once it has passed, the block's priority is the default again. A prefix-cache hit by a request with a policy gives
the blocks it reuses that request's priorities (the latest policy wins); a request without one leaves them as they
are.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

DEFAULT_PRIORITY = 35  # TensorRT-LLM's kDefaultRetentionPriority
MIN_PRIORITY, MAX_PRIORITY = 0, 100


@dataclass(frozen=True)
class TokenRange:
    start: int
    end: int | None  # exclusive; None: the prompt's end
    priority: int
    duration: float | None  # seconds; None: for as long as the block stays cached


@dataclass(frozen=True)
class KvRetention:
    ranges: tuple[TokenRange, ...]  # sorted by start, non-overlapping
    decode_priority: int = DEFAULT_PRIORITY
    decode_duration: float | None = None

    def block_priority(self, block: int, block_size: int, num_prompt_tokens: int) -> tuple[int, float | None]:
        """(priority, duration in seconds or None) of a sequence's block `block`."""
        first = block * block_size
        if first >= num_prompt_tokens:
            return self.decode_priority, self.decode_duration
        for r in self.ranges:
            if first >= r.start and (r.end is None or first < r.end):
                return r.priority, r.duration
        return DEFAULT_PRIORITY, None


def check_priority(value, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not MIN_PRIORITY <= value <= MAX_PRIORITY:
        raise ValueError(f"{field} must be an integer from {MIN_PRIORITY} to {MAX_PRIORITY}, got {value!r}")
    return value


def _or_default(priority):
    return DEFAULT_PRIORITY if priority is None else priority


def _seconds(value, field: str) -> float | None:
    """A duration given in milliseconds (a number) or as a datetime.timedelta, in seconds; None stays None."""
    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = value / 1000.0
    else:
        raise ValueError(f"{field} must be milliseconds (a number) or a datetime.timedelta, got {value!r}")
    if seconds < 0:
        raise ValueError(f"{field} must not be negative, got {value!r}")
    return seconds


def make_retention(config, field: str = "kv_cache_retention_config") -> KvRetention:
    """A KvRetention from TensorRT-LLM's shape: an object or dict with token_range_retention_configs (each with
    token_start, token_end, priority, duration_ms), decode_retention_priority and decode_duration_ms. ValueError
    naming the field for anything malformed."""

    def get(obj, name, default=None):
        return obj.get(name, default) if isinstance(obj, dict) else getattr(obj, name, default)

    if isinstance(config, dict):
        known = {"token_range_retention_configs", "decode_retention_priority", "decode_duration_ms"}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"{field} has unknown field(s) {unknown}; known: {sorted(known)}")
    raw = get(config, "token_range_retention_configs") or []
    if not isinstance(raw, (list, tuple)):
        raise ValueError(f"{field}.token_range_retention_configs must be a list, got {type(raw).__name__}")
    ranges = []
    for i, r in enumerate(raw):
        where = f"{field}.token_range_retention_configs[{i}]"
        start, end = get(r, "token_start"), get(r, "token_end")
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"{where}.token_start must be an integer >= 0, got {start!r}")
        if end is not None and (isinstance(end, bool) or not isinstance(end, int) or end <= start):
            raise ValueError(f"{where}.token_end must be None or an integer above token_start, got {end!r}")
        priority = check_priority(_or_default(get(r, "priority")), f"{where}.priority")
        ranges.append(TokenRange(start, end, priority, _seconds(get(r, "duration_ms"), f"{where}.duration_ms")))
    ranges.sort(key=lambda r: r.start)
    for a, b in zip(ranges, ranges[1:]):
        if a.end is None or a.end > b.start:
            raise ValueError(
                f"{field}.token_range_retention_configs overlap: [{a.start}, {a.end}) and [{b.start}, {b.end}) "
                "(only the last range may run to the prompt's end)"
            )
    decode = check_priority(_or_default(get(config, "decode_retention_priority")), f"{field}.decode_retention_priority")
    duration = _seconds(get(config, "decode_duration_ms"), f"{field}.decode_duration_ms")
    return KvRetention(tuple(ranges), decode, duration)
