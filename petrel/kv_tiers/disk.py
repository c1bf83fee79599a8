"""The disk tier: one file per block in a directory, named by the key's hex, written atomically (a temporary file
renamed into place), the least recently used removed when the byte bound is reached. It never raises: a failed
write is counted (errors, dropped) and the block is simply not kept.

The directory is this engine's while it runs: a lock file keeps a second engine out (ValueError at start), and
the block files a previous run left are removed at start. A block's key holds its LoRA adapter by the engine's
per-run id (LoRARequest.lora_int_id), so blocks of another run are not trusted.
"""

from __future__ import annotations

import fcntl
import os
import re
import threading
from collections import OrderedDict

from petrel.kv_tiers.base import StoreStats

SUFFIX = ".kvblock"
LOCK_NAME = ".petrel-kv-tier.lock"
_OURS = re.compile(r"^[0-9a-f]+\.kvblock(\.tmp\.\d+)?$")


class DiskTier:
    name = "disk"

    def __init__(self, path: str, capacity_bytes: int):
        if not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise ValueError(f"disk tier capacity must be a positive number of bytes, got {capacity_bytes!r}")
        self.path = os.path.abspath(os.path.expanduser(path))
        self.capacity_bytes = capacity_bytes
        try:
            os.makedirs(self.path, exist_ok=True)
            self._lock_file = open(os.path.join(self.path, LOCK_NAME), "a+")  # noqa: SIM115 - held while we run
        except OSError as exc:
            raise ValueError(f"kv_disk_tier_path {path!r} cannot be used: {exc}") from None
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock_file.close()
            raise ValueError(f"kv_disk_tier_path {path!r} is in use by another petrel engine") from None
        for name in os.listdir(self.path):  # a previous run's blocks (see the module's doc)
            if _OURS.match(name):
                try:
                    os.unlink(os.path.join(self.path, name))
                except OSError:
                    pass
        self._sizes: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, least recently used first
        self._bytes = 0
        self._stats = StoreStats()
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._sizes)

    def file_of(self, key: bytes) -> str:
        return os.path.join(self.path, key.hex() + SUFFIX)

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            if key not in self._sizes:
                self._stats.misses += 1
                return None
            try:
                with open(self.file_of(key), "rb") as f:
                    blob = f.read()
            except OSError:
                self._stats.errors += 1
                self._stats.misses += 1
                self._forget(key)
                return None
            self._sizes.move_to_end(key)
            self._stats.hits += 1
            self._stats.bytes_out += len(blob)
            return blob

    def put(self, key: bytes, blob: bytes) -> None:
        with self._lock:
            self._stats.puts += 1
            if len(blob) > self.capacity_bytes:
                self._stats.dropped += 1
                return
            self._remove(key)
            while self._sizes and self._bytes + len(blob) > self.capacity_bytes:
                self._remove(next(iter(self._sizes)))
            final = self.file_of(key)
            tmp = f"{final}.tmp.{os.getpid()}"
            try:
                with open(tmp, "wb") as f:
                    f.write(blob)
                os.replace(tmp, final)
            except OSError:  # the disk is full or gone: not kept, never raised
                self._stats.errors += 1
                self._stats.dropped += 1
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                return
            self._sizes[key] = len(blob)
            self._bytes += len(blob)
            self._stats.bytes_in += len(blob)

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._sizes

    def stats(self) -> dict[str, int]:
        with self._lock:
            return self._stats.as_dict()

    def _forget(self, key: bytes) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self._bytes -= size

    def _remove(self, key: bytes) -> None:
        if key in self._sizes:
            self._forget(key)
            try:
                os.unlink(self.file_of(key))
            except OSError:
                pass

    def close(self) -> None:
        """Let another engine use the directory (its lock goes with the file)."""
        if not self._lock_file.closed:
            self._lock_file.close()
