"""One KV block <-> bytes: the form a block takes in every lower tier (host memory, disk, a shared store).

A block id of the paged cache holds, for each of the runner's cache tensors (KVGroups.layers_per_block of them:
every layer of a one-group model, or one KV group's layers), the K and V rows of block_size positions (a latent
cache, multi-head latent attention's: one row a position, petrel/model/kv_layout.py). Its blob:

    b"PETRELKV" | version (u16, big-endian) | header length (u32) | header (JSON) | payload (raw tensor bytes)

The header names the model (a fingerprint of its architecture and weights), the dtype, the cache kind ("kv" or
"latent"; a header without one was written for "kv"), the payload's shape [layers, planes (2, key and value; 1, the
latent row), block_size, kv_heads, head_dim], the KV group, the block's chain hash, its token ids, the payload's
length and its CRC-32. decode_block checks every one of them against what the reading engine expects and raises
BlockCodecError on any difference, a short (truncated) payload or a bad checksum: the caller counts it and
recomputes the block. No pickle: JSON and raw bytes only.
"""

from __future__ import annotations

import hashlib
import json
import struct
import warnings
import zlib
from dataclasses import asdict, dataclass

import torch

MAGIC = b"PETRELKV"
VERSION = 1
_PREFIX = struct.Struct(">HI")  # version, header length
MAX_HEADER_BYTES = 1 << 20
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class BlockCodecError(ValueError):
    """A blob that is not a usable block for this engine (another model or layout, corrupted or truncated)."""


@dataclass(frozen=True)
class BlockLayout:
    """What a block's KV must match to be used by an engine: its model, dtype and cache geometry."""

    fingerprint: str  # model_fingerprint(): architecture and weights identity
    dtype: str  # a DTYPES name
    num_layers: int  # cache tensors per block id (KVGroups.layers_per_block)
    block_size: int
    kv_heads: int
    head_dim: int
    kind: str = "kv"  # the cache kind (petrel/model/kv_layout.py): "kv" (keys and values), "latent" (one row)

    @property
    def shape(self) -> tuple[int, ...]:
        planes = 1 if self.kind == "latent" else 2
        return (self.num_layers, planes, self.block_size, self.kv_heads, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def payload_bytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.torch_dtype).element_size()


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"KV tiers store {sorted(DTYPES)} caches, not {name}")
    return name


def encode_block(layout: BlockLayout, key: bytes, group: int, tokens, kv: torch.Tensor) -> bytes:
    """The blob of one block: kv [layers, planes, block_size, kv_heads, head_dim] (any device) with its identity."""
    if tuple(kv.shape) != layout.shape or kv.dtype != layout.torch_dtype:
        raise ValueError(f"block KV of shape {list(kv.shape)} {kv.dtype} does not fit layout {layout}")
    payload = kv.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    header = {
        **asdict(layout),
        "group": group,
        "key": key.hex(),
        "tokens": [int(t) for t in tokens],
        "payload_bytes": len(payload),
        "crc32": zlib.crc32(payload),
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    return MAGIC + _PREFIX.pack(VERSION, len(raw)) + raw + payload


def decode_block(layout: BlockLayout, blob: bytes, key: bytes, group: int, tokens) -> torch.Tensor:
    """The KV of a blob ([layers, planes, block_size, kv_heads, head_dim], on the CPU), after checking that it is the
    block `key` of group `group` holding `tokens`, written by this model with this layout, and intact."""
    start = len(MAGIC) + _PREFIX.size
    if len(blob) < start or blob[: len(MAGIC)] != MAGIC:
        raise BlockCodecError("not a petrel KV block (bad magic or truncated header)")
    version, header_len = _PREFIX.unpack_from(blob, len(MAGIC))
    if version != VERSION:
        raise BlockCodecError(f"KV block format version {version}, this engine reads {VERSION}")
    if header_len > MAX_HEADER_BYTES or len(blob) < start + header_len:
        raise BlockCodecError("KV block header truncated")
    try:
        header = json.loads(blob[start : start + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BlockCodecError(f"KV block header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise BlockCodecError("KV block header is not a JSON object")
    header.setdefault("kind", "kv")  # written before caches had kinds
    expected = {
        **asdict(layout),
        "group": group,
        "key": key.hex(),
        "tokens": [int(t) for t in tokens],
        "payload_bytes": layout.payload_bytes,
    }
    for name, value in expected.items():
        if header.get(name) != value:
            raise BlockCodecError(
                f"KV block {name} mismatch: stored {_short(header.get(name))}, expected {_short(value)}"
            )
    payload = memoryview(blob)[start + header_len :]
    if len(payload) != layout.payload_bytes:
        raise BlockCodecError(f"KV block payload is {len(payload)} bytes, expected {layout.payload_bytes} (truncated?)")
    if zlib.crc32(payload) != header.get("crc32"):
        raise BlockCodecError("KV block checksum mismatch (corrupted)")
    with warnings.catch_warnings():  # a read-only buffer: the tensor is only copied from, never written
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(payload, dtype=torch.uint8)
    return flat.view(layout.torch_dtype).reshape(layout.shape)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def model_fingerprint(model: torch.nn.Module, model_config, quantization: str | None = None) -> str:
    """A digest that differs between models: the architecture (ModelConfig), the quantization, and a sample of
    every weight tensor's values (names, shapes, dtypes and up to 256 evenly spaced elements each), so a
    fine-tune of the same architecture, or the same file loaded differently, gets another fingerprint."""
    h = hashlib.sha256()
    h.update(json.dumps(asdict(model_config), sort_keys=True, default=str).encode())
    h.update(f"|quantization={quantization or 'none'}".encode())
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    for name, t in sorted(tensors, key=lambda item: item[0]):
        h.update(f"|{name}:{list(t.shape)}:{t.dtype}".encode())
        if t.numel():
            h.update(_sample(t.detach()).contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]


def _sample(t: torch.Tensor, n: int = 256) -> torch.Tensor:
    """Up to n evenly spaced elements of t, flat, without copying a large tensor whole."""
    if t.dim() == 0:
        return t.reshape(1)
    if not t.is_contiguous():  # a few whole rows (a view's reshape would copy it all)
        t = t[torch.linspace(0, t.shape[0] - 1, steps=min(16, t.shape[0])).long()]
    flat = t.reshape(-1)
    return flat[:: max(1, flat.numel() // n)][:n]
