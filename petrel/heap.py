"""Handing freed memory back to the operating system, and keeping start-up's objects out of the collector's way.

glibc keeps what a large allocation frees: once a big buffer has been freed its mmap threshold rises, so later
ones come from the heap, which shrinks only from its top. After work that allocated and freed a lot at once (a
huge request body, a large grammar handed over from a compile worker), malloc_trim gives that memory back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
from collections.abc import Callable
from typing import Any


@functools.cache
def _malloc_trim() -> Callable[..., Any] | None:
    """glibc's malloc_trim, or None (another C library)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def can_release() -> bool:
    return _malloc_trim() is not None


def release_free_memory() -> None:
    """Give the heap's free memory back to the OS (a few milliseconds; nothing where glibc is not the C library)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def collect_and_release() -> None:
    """A full garbage collection, then release_free_memory: memory that only reference cycles held (a refused
    request's parsed body lives on in its exception's traceback cycle: 200,000 messages, four at a time, kept
    +124 MiB of RSS until the next collection) is free before the heap is trimmed. Milliseconds once start-up's
    objects are frozen (freeze_startup_objects), a few tenths of a second otherwise."""
    gc.collect()
    release_free_memory()


def freeze_startup_objects() -> None:
    """Moves every object alive now (after start-up: the model, tokenizer, modules) out of the cyclic garbage
    collector's reach, after collecting what is already garbage. A full collection traversed them all (0.46 s in a
    server, 0.12 s inside an offline W2 run, the engine's loop waiting behind it); after the freeze it takes
    milliseconds."""
    gc.collect()
    gc.freeze()


def thaw_frozen_objects() -> None:
    """Hands every frozen object back to the collector (an engine shut down: its objects, held in cycles, would
    otherwise never be freed); a later freeze_startup_objects freezes what is still alive again."""
    gc.unfreeze()
