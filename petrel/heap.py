"""Handing freed memory back to the operating system.

glibc keeps what a large allocation frees: once a big buffer has been freed its mmap threshold rises, so later
ones come from the heap, which shrinks only from its top. After work that allocated and freed a lot at once (a
huge request body, a large grammar handed over from a compile worker), malloc_trim gives that memory back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
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
