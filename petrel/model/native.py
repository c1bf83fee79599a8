"""Build and load petrel's small C kernels for x86-64 CPUs (AVX2 + FMA; AVX-512 where the CPU has it).

The kernel files (SOURCES: the float32 kernels, the quantized products and the threads they share out their work
over) are plain C with no torch headers: they build with the system C compiler in about a second (a torch C++
extension takes a minute on two cores) into one library, once per source text and compiler, in petrel's cache;
ctypes loads it and drops the GIL during each call.

load() returns None where the kernels cannot run: not x86-64 with AVX2 and FMA, no C compiler, a failed build, or
the caller's environment switch set to 0. Every caller then has a plain-torch path that computes the same thing.
"""
from __future__ import annotations

import ctypes
import functools
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

FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-pthread", "-shared", "-fPIC"]
SOURCES = ("dense_kernels.c", "prefill_attention.c", "quant_kernels.c", "gemm_avx512.c", "thread_pool.c", "thread_pool.h",
           "simd.h")


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split() for line in f if line.startswith("flags")), []))
    except OSError:
        return frozenset()


def cpu_has_avx2_fma() -> bool:
    return (torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
            and {"avx2", "fma"} <= _cpu_flags())


def cpu_has_avx512() -> bool:
    """Whether the AVX-512 kernels (gemm_avx512.c) may run: the CPU has AVX-512F and PETREL_AVX512 is not 0."""
    return (os.environ.get("PETREL_AVX512", "1") != "0" and cpu_has_avx2_fma()
            and torch.backends.cpu.get_cpu_capability() == "AVX512" and "avx512f" in _cpu_flags())


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc"):
        if name and shutil.which(name.split()[0]):
            return name.split()[0]
    return None


_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}    # by switch


def load(switch: str, what: str, signatures: dict[str, list]) -> ctypes.CDLL | None:
    """The kernels' library (built on first use, then kept in this process), or None where it cannot run here.

    switch: the caller's environment variable that turns its kernels off when "0"; what: what falls back, for the
    log; signatures: the caller's exported functions' ctypes argument types (they return void), or (argument
    types, result type)."""
    if switch not in _loaded:
        with _lock:
            if switch not in _loaded:
                lib = None if os.environ.get(switch, "1") == "0" else _library()
                if lib is None:
                    logger.info("%s run with torch (slower)", what)
                for name, types in signatures.items() if lib is not None else ():
                    argtypes, restype = types if isinstance(types, tuple) else (types, None)
                    getattr(lib, name).argtypes, getattr(lib, name).restype = argtypes, restype
                _loaded[switch] = lib
    return _loaded[switch]


@functools.cache
def _library() -> ctypes.CDLL | None:
    """SOURCES built into one shared library (or found built in the cache) and loaded, or None."""
    if not cpu_has_avx2_fma():
        return None
    compiler = _compiler()
    if compiler is None:
        logger.info("no C compiler for petrel's kernels")
        return None
    paths = [os.path.join(os.path.dirname(__file__), name) for name in SOURCES]
    digest = hashlib.sha256(" ".join([compiler, *FLAGS]).encode())
    for source in paths:
        with open(source, "rb") as f:
            digest.update(f.read())
    path = os.path.join(petrel_cache_dir("kernels"), f"petrel_kernels_{digest.hexdigest()[:16]}.so")
    try:
        if not os.path.isfile(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp{os.getpid()}"
            c_files = [p for p in paths if p.endswith(".c")]
            subprocess.run([compiler, *FLAGS, *c_files, "-o", tmp, "-lm"], check=True, capture_output=True, timeout=120)
            os.replace(tmp, path)
        return ctypes.CDLL(path)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        logger.warning("could not build petrel's kernels (%s %s)", exc, detail.decode(errors="replace")[-500:])
        return None
