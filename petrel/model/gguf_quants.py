"""GGUF block formats read as affine codes, w = scale * code + min per group, without dequantizing.

Each reader takes a tensor's raw blocks ([rows, bytes per row] uint8, as GGUFIndex maps them) and returns
(codes, scale, mins, bits, group_shift) in the layouts of quant_kernels.c:
  4 bits (Q4_0, Q4_1, Q4_K): codes [rows, K/32, 16] uint8, element i of a 32-group in the low nibble of byte i,
      element 16 + i in the high nibble (Q4_0/Q4_1 store exactly this; Q4_K is repacked); groups of 32.
  8 bits (Q8_0, Q5_0, Q5_1, Q5_K: groups of 32; Q6_K: groups of 16): codes [rows, K] int8.
scale and mins: float32 [rows, groups]; mins None where the format has no offset. The products d * sub-scale of the
K-quants are taken in float32, as the dequantized reference takes them. MXFP4 is no affine code: its 4-bit codes
(already in that nibble order) keep their E2M1 values and its scale stays the E8M0 byte of each block, uint8 [rows,
groups], mins None (QuantizedWeight.mxfp4; quant_kernels.c).
"""

from __future__ import annotations

import numpy as np

QK = 32  # elements of a Q4_0 .. Q8_0 block
QK_K = 256  # elements of a K-quant super-block


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte offset start of each block, as float32 [blocks, 1]."""
    return np.ascontiguousarray(blocks[:, start : start + 2]).view(np.float16).astype(np.float32)


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """[..., 32] codes 0..15 -> [..., 16] bytes: code i low, code 16 + i high."""
    return (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 32 high bits (a little-endian uint32 per block) -> [blocks, 32] of 0/16."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")  # bit j of the uint32 is element j's
    return bits.astype(np.uint8) << 4


def _mxfp4(b):
    return b[:, 1:], b[:, :1], None  # the E8M0 exponent byte, then 16 bytes of codes


def _q8_0(b):
    return b[:, 2:].view(np.int8), _f16(b, 0), None


def _q4_0(b):
    d = _f16(b, 0)
    return b[:, 2:], d, -8.0 * d


def _q4_1(b):
    return b[:, 4:], _f16(b, 0), _f16(b, 2)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[blocks, 16] bytes of a 32-block -> [blocks, 32] codes (low nibbles first)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q5_0(b):
    q = _nibbles(b[:, 6:]) | _fifth_bits(b[:, 2:6])
    return (q.astype(np.int16) - 16).astype(np.int8), _f16(b, 0), None


def _q5_1(b):
    q = _nibbles(b[:, 8:]) | _fifth_bits(b[:, 4:8])
    return q.astype(np.int8), _f16(b, 0), _f16(b, 2)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit sub-block scales and eight 6-bit mins, [blocks, 8] each."""
    s = s.astype(np.uint8)
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_affine(b):
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales(b[:, 4:16])
    return d * sc, -(dmin * mn)


def _q4_k(b):
    scale, mins = _k_affine(b)
    qs = b[:, 16:144].reshape(-1, 4, 32)  # 64 elements per 32 bytes: low nibbles, then high nibbles
    codes = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
    return _pack_nibbles(codes).reshape(len(b), -1), scale, mins


def _q5_k(b):
    scale, mins = _k_affine(b)
    qh = b[:, 16:48]  # bit j of byte l: the fifth bit of sub-block j's element l
    qs = b[:, 48:176].reshape(-1, 4, 32)
    low = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    return (low | (high << 4)).astype(np.int8).reshape(len(b), -1), scale, mins


def _q6_k(b):
    ql = b[:, 0:128].reshape(-1, 2, 64)
    qh = b[:, 128:192].reshape(-1, 2, 32)
    sc = b[:, 192:208].view(np.int8).astype(np.float32)  # one per 16 elements
    d = _f16(b, 208)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-1)  # [blocks, 2, 128]
    high = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2).reshape(-1, 2, 128)
    codes = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)
    return codes.reshape(len(b), -1), d * sc, None


# GGML type name -> (reader, block elements, block bytes, code bits, group shift)
READERS = {
    "Q8_0": (_q8_0, QK, 34, 8, 5),
    "Q4_0": (_q4_0, QK, 18, 4, 5),
    "Q4_1": (_q4_1, QK, 20, 4, 5),
    "Q5_0": (_q5_0, QK, 22, 8, 5),
    "Q5_1": (_q5_1, QK, 24, 8, 5),
    "Q4_K": (_q4_k, QK_K, 144, 4, 5),
    "Q5_K": (_q5_k, QK_K, 176, 8, 5),
    "Q6_K": (_q6_k, QK_K, 210, 8, 4),
    "MXFP4": (_mxfp4, QK, 17, 4, 5),
}


def read_blocks(type_name: str, raw: np.ndarray, rows: int, cols: int):
    """(codes, scale, mins, bits, group_shift) of a [rows, cols] tensor stored as GGUF type_name blocks."""
    reader, elems, size, bits, gshift = READERS[type_name]
    blocks = np.ascontiguousarray(raw).reshape(-1, size)
    codes, scale, mins = reader(blocks)
    groups = cols >> gshift
    codes = codes.reshape(rows, cols // 32, 16) if bits == 4 else codes.reshape(rows, cols)
    scale_type = np.uint8 if type_name == "MXFP4" else np.float32
    scale = np.ascontiguousarray(scale, dtype=scale_type).reshape(rows, groups)
    mins = None if mins is None else np.ascontiguousarray(mins, dtype=np.float32).reshape(rows, groups)
    return np.ascontiguousarray(codes), scale, mins, bits, gshift
