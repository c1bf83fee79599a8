"""The AVX2 low-bit kernels of quant_kernels.c (weight-only: float activations), and for many rows int8_gemm.c (int8
row-scaled weights) and group_gemm.c (GGUF's group-quantized weights) times activations rounded to 16-bit integers
(or 8-bit ones a group of 32, group_gemm_q8.c: 4-bit GGUF codes, see q4_activation_bits; 8-bit codes on AVX-512
VNNI, see int8_activation_bits) (AVX2, AVX-512 or AVX-512 VNNI, see int8_isa), built and loaded by petrel.model.native.

library() is None where the kernels cannot run (see native.load; switch: PETREL_QUANT_KERNELS=0): QuantizedLinear
then dequantizes with torch instead (same results, slower). PETREL_INT8_COMPUTE=0 keeps int8 weights on the float
products (see int8_compute), and GGUF weights too."""

from __future__ import annotations

import ctypes
import os

import torch

from petrel.model import native


def library() -> ctypes.CDLL | None:
    """The loaded kernels (see native.load); None where they cannot run here."""
    return native.load("PETREL_QUANT_KERNELS", "quantized layers")


def gemv(
    lib,
    bits: int,
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    mins: torch.Tensor | None,
    gshift: int,
    n: int,
) -> torch.Tensor:
    """x [M, K] float32 contiguous -> [M, n] float32 (few rows: each weight read once per four rows)."""
    m, k = x.shape
    y = torch.empty(m, n, dtype=torch.float32)
    if lib.quant_gemv(
        bits,
        x.data_ptr(),
        m,
        k,
        codes.data_ptr(),
        scale.data_ptr(),
        None if mins is None else mins.data_ptr(),
        gshift,
        y.data_ptr(),
        n,
        torch.get_num_threads(),
        integer_isa(bits),
    ):
        raise native.out_of_memory("quant_gemv")
    return y


def gemm(
    lib,
    bits: int,
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    mins: torch.Tensor | None,
    gshift: int,
    n: int,
) -> torch.Tensor:
    """x [M, K] float32 contiguous -> [M, n] float32 (tens of rows: 12 weight rows at a time dequantized into a
    float32 tile that every row of x passes over while it is in cache)."""
    m, k = x.shape
    y = torch.empty(m, n, dtype=torch.float32)
    if lib.quant_gemm(
        bits,
        x.data_ptr(),
        m,
        k,
        codes.data_ptr(),
        scale.data_ptr(),
        None if mins is None else mins.data_ptr(),
        gshift,
        y.data_ptr(),
        n,
        torch.get_num_threads(),
    ):
        raise native.out_of_memory("quant_gemm")
    return y


def dequantize_rows(
    lib,
    bits: int,
    k: int,
    codes: torch.Tensor,
    scale: torch.Tensor,
    mins: torch.Tensor | None,
    gshift: int,
    out: torch.Tensor,
    n0: int,
    n1: int,
) -> None:
    """Weight rows n0..n1 as float32 into out[:n1 - n0] (contiguous)."""
    lib.quant_dequant(
        bits,
        k,
        codes.data_ptr(),
        scale.data_ptr(),
        None if mins is None else mins.data_ptr(),
        gshift,
        out.data_ptr(),
        n0,
        n1,
        torch.get_num_threads(),
    )


def int8_compute() -> bool:
    """Whether quantized weights multiply many rows in integers (int8_gemm, group_gemm); PETREL_INT8_COMPUTE=0 keeps
    the float products."""
    return os.environ.get("PETREL_INT8_COMPUTE", "1") != "0"


INT8_AVX2, INT8_AVX512, INT8_AVX512_VNNI = 0, 1, 2  # int8_gemm's and group_gemm's kernels (kernels.h)


def int8_isa() -> int:
    """The widest int8_gemm kernel this CPU runs: AVX-512 with VNNI, AVX-512 (F + BW), else AVX2. PETREL_AVX512=0
    keeps AVX2 (native.cpu_has_avx512), PETREL_AVX512_VNNI=0 the AVX-512 kernel without VNNI."""
    if not (native.cpu_has_avx512() and native.cpu_has("avx512bw")):
        return INT8_AVX2
    if native.cpu_has("avx512_vnni") and os.environ.get("PETREL_AVX512_VNNI", "1") != "0":
        return INT8_AVX512_VNNI
    return INT8_AVX512


INT8_ACTIVATIONS = 4  # or'ed into int8_gemm's and group_gemm's isa: 8-bit activations (kernels.h)


def q4_activation_bits() -> int:
    """The bits 4-bit GGUF weights' integer products round activations to: 8, one scale a group of 32
    (group_gemm_q8.c, as llama.cpp's Q8 blocks: half the integer work), or 16 with one scale a row
    (group_gemm.c, PETREL_Q4_ACTIVATIONS=16)."""
    return 16 if os.environ.get("PETREL_Q4_ACTIVATIONS", "8") == "16" else 8


def int8_activation_bits() -> int:
    """The bits 8-bit weights' integer products (quantization="int8", GGUF's Q8_0) round activations to: 8, one
    scale a group of 32 (group_gemm_q8.c: the codes offset to unsigned bytes for AVX512_VNNI's dpbusd, four
    products a lane where 16-bit activations' dpwssd has two), where int8_isa is AVX-512 VNNI; else, or with
    PETREL_INT8_ACTIVATIONS=16, 16 with one scale a row (int8_gemm.c, group_gemm.c)."""
    vnni = int8_isa() == INT8_AVX512_VNNI
    return 8 if vnni and os.environ.get("PETREL_INT8_ACTIVATIONS", "8") != "16" else 16


def integer_isa(bits: int) -> int:
    """int8_gemm's and group_gemm's isa argument for codes of this many bits: int8_isa, with INT8_ACTIVATIONS
    where 4-bit codes' q4_activation_bits, or 8-bit codes' int8_activation_bits, say 8."""
    eight = q4_activation_bits() == 8 if bits == 4 else bits == 8 and int8_activation_bits() == 8
    return int8_isa() | (INT8_ACTIVATIONS if eight else 0)


def int8_gemm(lib, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 contiguous @ (scale * codes)^T -> [M, N] float32, codes int8 [N, K] with one scale a row:
    x's rows rounded to 16-bit integers, or to 8-bit ones a group of 32 (int8_activation_bits), the products exact
    int32 sums (int8_gemm.c, integer_isa's kernel)."""
    (m, k), n = x.shape, codes.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    threads = torch.get_num_threads()
    if lib.int8_gemm(x.data_ptr(), m, k, codes.data_ptr(), scale.data_ptr(), y.data_ptr(), n, threads, integer_isa(8)):
        raise native.out_of_memory("int8_gemm")
    return y


def group_gemm(
    lib, bits: int, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor | None, gshift: int
) -> torch.Tensor:
    """x [M, K] float32 contiguous @ W^T -> [M, N] float32 for a group-quantized W (bits 4, or bits 8 in groups of
    2**gshift; see quant_kernels.c): x rounded to integers (4-bit codes: see q4_activation_bits; else 16 bits with
    one scale a row), each group's products exact int32 sums (group_gemm.c, integer_isa's kernel)."""
    (m, k), n = x.shape, codes.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if lib.group_gemm(
        bits,
        x.data_ptr(),
        m,
        k,
        codes.data_ptr(),
        scale.data_ptr(),
        None if mins is None else mins.data_ptr(),
        gshift,
        y.data_ptr(),
        n,
        torch.get_num_threads(),
        integer_isa(bits),
    ):
        raise native.out_of_memory("group_gemm")
    return y
