"""The AVX2 weight-only low-bit kernels of quant_kernels.c: compiled once per source and compiler into petrel's
cache, loaded with ctypes. Plain C with no torch headers builds in about a second (a torch C++ extension takes a
minute on two cores), and ctypes drops the GIL during the call.

library() is None where the kernels cannot run (not x86-64 with AVX2 and FMA, no C compiler, a failed build, or
PETREL_QUANT_KERNELS=0): QuantizedLinear then dequantizes with torch instead (same results, slower)."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
import threading

import torch

from petrel.model.cache import petrel_cache_dir

logger = logging.getLogger("petrel")

SOURCE = os.path.join(os.path.dirname(__file__), "quant_kernels.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built on first use; None where they cannot run here."""
    global _library, _tried
    if _tried:
        return _library
    with _lock:
        if not _tried:
            _library = _load()
            _tried = True
    return _library


def _cpu_has_avx2_fma() -> bool:
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc"):
        if name and shutil.which(name.split()[0]):
            return name.split()[0]
    return None


def _load() -> ctypes.CDLL | None:
    if os.environ.get("PETREL_QUANT_KERNELS", "1") == "0" or not _cpu_has_avx2_fma():
        return None
    compiler = _compiler()
    if compiler is None:
        logger.info("no C compiler: quantized layers dequantize with torch (slower)")
        return None
    with open(SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(source + " ".join([compiler, *FLAGS]).encode()).hexdigest()[:16]
    path = os.path.join(petrel_cache_dir("kernels"), f"quant_kernels_{key}.so")
    try:
        if not os.path.isfile(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp{os.getpid()}"
            subprocess.run([compiler, *FLAGS, SOURCE, "-o", tmp], check=True, capture_output=True, timeout=120)
            os.replace(tmp, path)
        lib = ctypes.CDLL(path)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        logger.warning("could not build the quantized kernels (%s %s): quantized layers dequantize with torch",
                       exc, detail.decode(errors="replace")[-500:])
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.quant_gemv.argtypes = [i32, p, i64, i64, p, p, p, i32, p, i64, i32]
    lib.quant_gemv.restype = None
    lib.quant_dequant.argtypes = [i32, i64, p, p, p, i32, p, i64, i64, i32]
    lib.quant_dequant.restype = None
    return lib


def gemv(lib, bits: int, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor | None,
         gshift: int, n: int) -> torch.Tensor:
    """x [M, K] float32 contiguous -> [M, n] float32 (few rows: each weight read once per four rows)."""
    m, k = x.shape
    y = torch.empty(m, n, dtype=torch.float32)
    lib.quant_gemv(bits, x.data_ptr(), m, k, codes.data_ptr(), scale.data_ptr(),
                   None if mins is None else mins.data_ptr(), gshift, y.data_ptr(), n, torch.get_num_threads())
    return y


def dequantize_rows(lib, bits: int, k: int, codes: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor | None,
                    gshift: int, out: torch.Tensor, n0: int, n1: int) -> None:
    """Weight rows n0..n1 as float32 into out[:n1 - n0] (contiguous)."""
    lib.quant_dequant(bits, k, codes.data_ptr(), scale.data_ptr(), None if mins is None else mins.data_ptr(),
                      gshift, out.data_ptr(), n0, n1, torch.get_num_threads())
