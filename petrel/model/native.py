"""Build and load petrel's small C kernels for x86-64 CPUs (AVX2 + FMA).

Each kernel file is plain C with no torch headers: it builds with the system C compiler in about a second (a torch
C++ extension takes a minute on two cores), once per source and compiler, into petrel's cache; ctypes loads it and
drops the GIL during each call. The kernels parallelise with OpenMP, which inside a torch process is torch's own
runtime (same libgomp), so they share its thread pool instead of adding threads.

load() returns None where the kernels cannot run: not x86-64 with AVX2 and FMA, no C compiler, a failed build, or
the kernel's environment switch set to 0. Every caller then has a plain-torch path with the same results.
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

FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]


@functools.cache
def cpu_has_avx2_fma() -> bool:
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


_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def load(source_name: str, switch: str, what: str, signatures: dict[str, list]) -> ctypes.CDLL | None:
    """The compiled library of petrel/model/<source_name> (built on first use, then cached in this process), or
    None where it cannot run here.

    switch: the environment variable that turns these kernels off when "0"; what: what falls back, for the log;
    signatures: each exported function's ctypes argument types (all return void)."""
    if source_name not in _loaded:
        with _lock:
            if source_name not in _loaded:
                lib = _build_and_open(source_name, switch, what)
                for name, argtypes in signatures.items() if lib is not None else ():
                    getattr(lib, name).argtypes, getattr(lib, name).restype = argtypes, None
                _loaded[source_name] = lib
    return _loaded[source_name]


def _build_and_open(source_name: str, switch: str, what: str) -> ctypes.CDLL | None:
    if os.environ.get(switch, "1") == "0" or not cpu_has_avx2_fma():
        return None
    compiler = _compiler()
    if compiler is None:
        logger.info("no C compiler: %s run with torch (slower)", what)
        return None
    source = os.path.join(os.path.dirname(__file__), source_name)
    with open(source, "rb") as f:
        text = f.read()
    key = hashlib.sha256(text + " ".join([compiler, *FLAGS]).encode()).hexdigest()[:16]
    path = os.path.join(petrel_cache_dir("kernels"), f"{os.path.splitext(source_name)[0]}_{key}.so")
    try:
        if not os.path.isfile(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp{os.getpid()}"
            subprocess.run([compiler, *FLAGS, source, "-o", tmp, "-lm"], check=True, capture_output=True, timeout=120)
            os.replace(tmp, path)
        return ctypes.CDLL(path)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        logger.warning("could not build %s (%s %s): %s run with torch", source_name, exc,
                       detail.decode(errors="replace")[-500:], what)
        return None
