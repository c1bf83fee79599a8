"""The tokenizer bundle GetTokenizer streams: a flat zip of the served tokenizer's files (tokenizer.json,
tokenizer_config.json, the chat template, special tokens map, and the model's config / generation config when it
has them as files), cut into chunks, the sha256 of the whole zip on the last chunk."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import tempfile
import zipfile

CHUNK_BYTES = 512 * 1024
MODEL_FILES = ("config.json", "generation_config.json")


def bundle_bytes(tokenizer, chat_template: str | None = None, model_dir: str | None = None) -> bytes:
    """The zip: what `tokenizer.save_pretrained` writes (petrel builds a GGUF model's tokenizer from the GGUF),
    `chat_template` (the server's override) as chat_template.jinja, and `model_dir`'s config files."""
    tmp = tempfile.mkdtemp(prefix="petrel-tokenizer-")
    try:
        tokenizer.save_pretrained(tmp)
        if chat_template is not None:
            with open(os.path.join(tmp, "chat_template.jinja"), "w", encoding="utf-8") as f:
                f.write(chat_template)
        for name in MODEL_FILES:
            path = os.path.join(model_dir or "", name)
            if model_dir and os.path.isfile(path):
                shutil.copy(path, os.path.join(tmp, name))
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
            for name in sorted(os.listdir(tmp)):
                path = os.path.join(tmp, name)
                if os.path.isfile(path):
                    zf.write(path, name)
        return buf.getvalue()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def bundle_chunks(data: bytes, chunk_bytes: int = CHUNK_BYTES) -> list[tuple[bytes, str]]:
    """(data, sha256) pairs: the sha256 (lowercase hex of the whole zip) on the last one only."""
    digest = hashlib.sha256(data).hexdigest()
    parts = [data[i : i + chunk_bytes] for i in range(0, len(data), chunk_bytes)] or [b""]
    return [(part, digest if i == len(parts) - 1 else "") for i, part in enumerate(parts)]
