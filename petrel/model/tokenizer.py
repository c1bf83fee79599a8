"""Tokenizer loading: a Hugging Face directory as is, a GGUF file's vocabulary converted once and cached."""
from __future__ import annotations

import hashlib
import os

from petrel.model.loader import ModelSource


def _cache_dir() -> str:
    return os.path.join(os.environ.get("PETREL_CACHE", os.path.expanduser("~/.cache/petrel")), "tokenizers")


def load_tokenizer(source: ModelSource, tokenizer: str | None = None):
    from transformers import AutoTokenizer
    if tokenizer is not None:
        return AutoTokenizer.from_pretrained(tokenizer)
    if source.kind == "hf":
        return AutoTokenizer.from_pretrained(source.path)
    stat = os.stat(source.path)
    key = hashlib.sha256(f"{os.path.abspath(source.path)}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = os.path.join(_cache_dir(), key)
    if os.path.isfile(os.path.join(cached, "tokenizer_config.json")):
        try:
            return AutoTokenizer.from_pretrained(cached)
        except Exception:
            pass  # a damaged cache entry: convert again
    tok = AutoTokenizer.from_pretrained(os.path.dirname(source.path), gguf_file=os.path.basename(source.path))
    try:
        tmp = f"{cached}.tmp{os.getpid()}"
        tok.save_pretrained(tmp)
        os.replace(tmp, cached)
    except OSError:
        pass  # a read-only home: convert each time
    return tok
