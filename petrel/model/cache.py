"""petrel's on-disk cache (PETREL_CACHE, default ~/.cache/petrel): what is slow to derive from a model file
(its tokenizer converted from GGUF, its GGUF index) is kept per file, keyed by path, size and mtime."""

from __future__ import annotations

import hashlib
import os


def petrel_cache_dir(kind: str) -> str:
    return os.path.join(os.environ.get("PETREL_CACHE", os.path.expanduser("~/.cache/petrel")), kind)


def cache_key(path: str) -> str:
    """Changes whenever the file is replaced or rewritten."""
    stat = os.stat(path)
    return hashlib.sha256(f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
