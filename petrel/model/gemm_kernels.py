"""The Python side of petrel's GEMMs (gemm_avx512.c, gemm_avx2.c) and of bfloat16 weights' products
(dense_kernels.c's bf16_gemv, bf16_pairs.c): which build runs on this CPU, the calling thread's workspace, and for
bfloat16 weights (quantization 'bf16') which kernel takes how many rows. dense_kernels and quantization both use it,
so it imports neither."""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from petrel.model import native

GEMV_MAX_ROWS = 256  # the few-row kernels' rows, measured (2 threads): 1.2-2x torch up to 128 rows, even at 256,
# behind torch's GEMM from 512


def library() -> ctypes.CDLL | None:
    """petrel's kernels (native.load; PETREL_DENSE_KERNELS=0 turns them off for float32 and bfloat16 products)."""
    return native.load("PETREL_DENSE_KERNELS", "float32 decode kernels")


BF16_PAIRS_MIN_ROWS = 1  # from here x rounded to bfloat16 and dpbf16 (Zen 4, 2 threads, weights from memory: 1.1-1.5x
# the widened few-row kernel at one row, 1.2-1.5x at 4, 1.7-2x from 16)


def bf16_pairs_rows() -> int:
    """From how many rows of x bfloat16 weights multiply x rounded to bfloat16, two products an element
    (bf16_pairs.c's bf16_pairs_product, AVX512_BF16's dpbf16: twice the float32 FMA's rate): BF16_PAIRS_MIN_ROWS
    where the CPU has AVX512_BF16 and neither PETREL_AVX512 nor PETREL_BF16_ACTIVATIONS is 0, else 0 (never: the
    weights widened to float32 times float32 x)."""
    on = os.environ.get("PETREL_BF16_ACTIVATIONS", "1") != "0" and native.cpu_has_avx512()
    return BF16_PAIRS_MIN_ROWS if on and native.cpu_has("avx512_bf16", "avx512bw") else 0


def bf16_panels() -> bool:
    """Whether bfloat16 projections are held in panels (quantization.pack_panels) for bf16_panels_product: where
    their products round x to bfloat16 (bf16_pairs_rows) and the kernels load."""
    return bf16_pairs_rows() > 0 and library() is not None


PANELS_AVX512, PANELS_AVX2 = 1, 2  # kernels.h: the blocks f32_panels_product multiplies float32 panels with


def f32_panels_isa() -> int:
    """The blocks float32 weights in panels are multiplied with (f32_panels_product): PANELS_AVX512 where the CPU has
    AVX-512 (native.cpu_has_avx512), else PANELS_AVX2 where the kernels load (they need AVX2 and FMA); 0 where
    they do not load."""
    if library() is None:
        return 0
    return PANELS_AVX512 if native.cpu_has_avx512() else PANELS_AVX2


def f32_panels() -> bool:
    """Whether a float32 model's weights are held packed in panels at load (quantization.hold_f32_panels): where
    f32_panels_isa() runs them and PETREL_F32_PANELS is not 0."""
    return os.environ.get("PETREL_F32_PANELS", "1") != "0" and f32_panels_isa() != 0


def f32_panels_product(x: torch.Tensor, packed: torch.Tensor, n: int, isa: int | None = None) -> torch.Tensor | None:
    """x [M, K] float32 contiguous @ W^T for float32 W packed in panels (quantization.pack_panels) with n rows, with
    the blocks of `isa` (default f32_panels_isa(); a benchmark may ask for PANELS_AVX2 on an AVX-512 CPU); None
    where the kernel cannot run (not the CPU, or no f32_panels_isa)."""
    if not x.is_cpu or not packed.is_cpu or not (best := f32_panels_isa()):
        return None
    isa = best if isa is None else isa
    lib, y = library(), torch.empty(x.shape[0], n, dtype=torch.float32)
    lib.f32_panels_product(
        x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), y.data_ptr(), n, torch.get_num_threads(), isa
    )
    return y


def bf16_product(x: torch.Tensor, codes: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] float32 contiguous @ codes[N, K]^T for bfloat16 codes: from bf16_pairs_rows() rows (K even), x
    rounded to bfloat16 and two products an instruction (bf16_pairs_product); below, each weight widened to float32
    exactly: the few-row kernel up to GEMV_MAX_ROWS rows, else the GEMM of this CPU's widest vectors (which widens W
    as it packs it); None where none runs."""
    (m, k), n = x.shape, codes.shape[0]
    from_rows = bf16_pairs_rows()
    pairs = 0 < from_rows <= m and k % 2 == 0
    if (not pairs and m <= GEMV_MAX_ROWS and k % 16) or not x.is_cpu or not codes.is_cpu or (lib := library()) is None:
        return None
    y, threads = torch.empty(m, n, dtype=torch.float32), torch.get_num_threads()
    if pairs:
        if lib.bf16_pairs_product(x.data_ptr(), m, k, codes.data_ptr(), y.data_ptr(), n, threads):
            raise native.out_of_memory("bf16_pairs_product")
    elif m <= GEMV_MAX_ROWS:
        lib.bf16_gemv(x.data_ptr(), m, k, codes.data_ptr(), y.data_ptr(), n, threads)
    else:
        widest_gemm(lib, x, codes, y)
    return y


def bf16_panels_product(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor | None:
    """x [M, K] float32 contiguous @ W^T for the bfloat16 W [n, K] packed in panels (quantization.pack_panels): any
    count of rows, x rounded to bfloat16, through bf16_panels_product; None where bf16_panels() says no (bfloat16
    products do not round x, or the kernels are off: the caller's float32 fallback then)."""
    if not (bf16_panels() and x.is_cpu and packed.is_cpu):
        return None
    lib, y = library(), torch.empty(x.shape[0], n, dtype=torch.float32)
    if lib.bf16_panels_product(
        x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), y.data_ptr(), n, torch.get_num_threads()
    ):
        raise native.out_of_memory("bf16_panels_product")
    return y


def widest_gemm(lib, x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor) -> None:
    """y = x @ weight^T, weight float32 (f32_gemm) or bfloat16 (bf16_gemm: widened as packed; the same workspace),
    by the AVX-512 GEMM where native.cpu_has_avx512 says so, else the AVX2 one."""
    (m, k), n, threads = x.shape, weight.shape[0], torch.get_num_threads()
    wide, bf16 = native.cpu_has_avx512(), weight.dtype == torch.bfloat16
    workspace = gemm_workspace(
        lib.f32_gemm_workspace(k, n, threads) if wide else lib.f32_gemm_avx2_workspace(k, n, threads)
    )
    xp, wp, yp, ws = x.data_ptr(), weight.data_ptr(), y.data_ptr(), workspace.data_ptr()
    if wide and bf16:
        lib.bf16_gemm(xp, m, k, wp, yp, n, ws, threads)
    elif wide:
        lib.f32_gemm(xp, m, k, wp, yp, n, ws, threads)
    elif bf16:
        lib.bf16_gemm_avx2(xp, m, k, wp, yp, n, ws, threads)
    else:
        lib.f32_gemm_avx2(xp, m, k, wp, yp, n, ws, threads)


_workspaces = threading.local()


def gemm_workspace(floats: int) -> torch.Tensor:
    """The calling thread's GEMM workspace of at least `floats` floats (a few MB: the packed chunks of W), kept from
    call to call: a fresh one would be paid in page faults every product."""
    buffer = getattr(_workspaces, "buffer", None)
    if buffer is None or buffer.numel() < floats:
        buffer = _workspaces.buffer = torch.empty(floats, dtype=torch.float32)
    return buffer
