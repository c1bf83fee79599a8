"""Find and load petrel's C kernels for x86-64 CPUs (AVX2 + FMA; AVX-512 where the CPU has it).

The kernel files (kernel_build.SOURCES: the float32 kernels, the quantized products and the threads they share out
their work over) are plain C with no torch headers, built by kernel_build into one library. Where it comes from:
  1. the library `pip install` built into the package (petrel/model/_kernels<EXT_SUFFIX>), when it was built from
     the sources beside it (it records their digest; an editable install whose C files changed since is stale);
  2. otherwise, the fallback: built on first use with the system C compiler (about a second) into petrel's cache,
     once per source text and compiler.
ctypes loads it (dropping the GIL during each call) and takes every function's argument and result types from
kernels.h, the one declaration the C files are compiled against.

load() returns None where the kernels cannot run: not x86-64 with AVX2 and FMA, no installed library and no C
compiler, a failed build, or the caller's environment switch set to 0. Every caller then has a plain-torch path
that computes the same thing; one WARNING says what is lost, unless PETREL_REQUIRE_KERNELS=1 (CI), which makes it
an error instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.machinery
import logging
import os
import platform
import re
import threading

import torch

from petrel.model import kernel_build
from petrel.model.cache import petrel_cache_dir

logger = logging.getLogger("petrel")

REQUIRE_SWITCH = "PETREL_REQUIRE_KERNELS"
LOST = (
    "float32 decode (few-row products, paged attention, whole decoder layers in one call), quantized-weight "
    "products and the AVX-512 prefill product run in torch instead: the same results, about half the decode "
    "speed (W1 roughly halves)"
)


class KernelsUnavailable(RuntimeError):
    """PETREL_REQUIRE_KERNELS=1, and petrel's C kernels cannot run here."""


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split() for line in f if line.startswith("flags")), []))
    except OSError:
        return frozenset()


def cpu_has_avx2_fma() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and {"avx2", "fma"} <= _cpu_flags()


def cpu_has_avx512() -> bool:
    """Whether the AVX-512 kernels (gemm_avx512.c) may run: the CPU has AVX-512F and PETREL_AVX512 is not 0."""
    return (
        os.environ.get("PETREL_AVX512", "1") != "0"
        and cpu_has_avx2_fma()
        and torch.backends.cpu.get_cpu_capability() == "AVX512"
        and "avx512f" in _cpu_flags()
    )


def cpu_has(*flags: str) -> bool:
    """Whether /proc/cpuinfo lists every one of these CPU flags (e.g. "avx512bw")."""
    return set(flags) <= _cpu_flags()


AMX_FLAGS = {"bf16": ("amx_tile", "amx_bf16"), "int8": ("amx_tile", "amx_int8")}  # Xeons from Sapphire Rapids on


def cpu_has_amx(kind: str) -> bool:
    """Whether the CPU has AMX's tiles and their `kind` products ("bf16" or "int8"), by /proc/cpuinfo's flags (the
    kernel lists them only where it supports the tile state). petrel.model.amx decides what runs there."""
    return cpu_has(*AMX_FLAGS[kind])


_C_TYPES = {
    "int": ctypes.c_int,
    "int32_t": ctypes.c_int32,
    "int64_t": ctypes.c_int64,
    "float": ctypes.c_float,
    "void": None,
}
_PROTOTYPE = re.compile(r"([A-Za-z_][\w\s*]*?)\s*\b(\w+)\s*\(([^()]*)\)\s*;")


def _c_type(declaration: str):
    """The ctypes type of a parameter or result declaration (its name, if any, left off)."""
    if "*" in declaration:
        return ctypes.c_char_p if declaration.split("*")[0].split() == ["const", "char"] else ctypes.c_void_p
    words = [w for w in declaration.split() if w != "const"]
    return _C_TYPES[words[0]]


def declarations(header: str | None = None) -> dict[str, tuple[list, type | None]]:
    """{function: (ctypes argument types, result type)} of every prototype in kernels.h (or the given text)."""
    if header is None:
        with open(os.path.join(kernel_build.DIRECTORY, kernel_build.HEADER)) as f:
            header = f.read()
    text = re.sub(r"/\*.*?\*/", " ", header, flags=re.S)
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    text = re.sub(r"typedef\s+struct\s*\{.*?\}\s*\w+\s*;", " ", text, flags=re.S)
    found = {}
    for result, name, params in _PROTOTYPE.findall(text):
        params = [p.strip() for p in params.split(",")]
        argtypes = [] if params == ["void"] else [_c_type(p) for p in params]
        found[name] = (argtypes, _c_type(result))
    return found


def installed_library() -> str | None:
    """The path of the library `pip install` built into the package, or None."""
    base = os.path.join(kernel_build.DIRECTORY, kernel_build.INSTALLED_NAME.rsplit(".", 1)[1])
    return next((base + s for s in importlib.machinery.EXTENSION_SUFFIXES if os.path.isfile(base + s)), None)


def _open(path: str) -> ctypes.CDLL:
    """The library at path with every declared function's types set (AttributeError if one is missing)."""
    lib = ctypes.CDLL(path)
    for name, (argtypes, restype) in declarations().items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    return lib


def find_library() -> tuple[ctypes.CDLL | None, str]:
    """(the library, where it came from) or (None, why it cannot run here); builds into the cache when needed."""
    if not kernel_build.is_x86_64():
        return None, f"they are x86-64 code and this machine is {platform.machine()}"
    if not cpu_has_avx2_fma():
        return None, "this CPU has no AVX2 and FMA"
    digest = kernel_build.source_digest()
    if (path := installed_library()) is not None:
        try:
            lib = _open(path)
            built_from = lib.kernels_source_digest().decode()
        except (OSError, AttributeError) as exc:
            logger.info("the installed kernels (%s) cannot be used: %s", path, exc)
        else:
            if built_from == digest:
                return lib, path
            logger.info("the installed kernels (%s) were built from other sources: building these", path)
    compiler = kernel_build.find_compiler()
    if compiler is None:
        return None, (
            "no C compiler ($CC, cc or gcc on PATH) and no library built at install from these "
            "sources; install gcc and reinstall petrel, or set CC"
        )
    key = hashlib.sha256(f"{compiler} {digest}".encode()).hexdigest()[:16]
    path = os.path.join(petrel_cache_dir("kernels"), f"petrel_kernels_{key}.so")
    try:
        if not os.path.isfile(path):
            logger.info("building petrel's kernels into %s", path)
            kernel_build.build(path, compiler)
        return _open(path), path
    except (kernel_build.BuildError, OSError, AttributeError) as exc:
        return None, f"the build failed: {exc}"


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    """find_library() once per process; the WARNING of what is lost, once, where there is none."""
    lib, where = find_library()
    if lib is None and os.environ.get(REQUIRE_SWITCH) != "1":
        logger.warning("petrel's C kernels are off (%s): %s.", where, LOST)
    elif lib is not None:
        logger.info("petrel's C kernels: %s", where)
    return lib, where


def kernels_status() -> tuple[bool, str]:
    """(whether petrel's C kernels load here, where the library came from or why they cannot run): what load()
    finds, read without raising under PETREL_REQUIRE_KERNELS=1 and whatever the callers' switches say (`petrel env`
    reports it)."""
    lib, where = _library()
    return lib is not None, where


_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}  # by switch


def load(switch: str, what: str) -> ctypes.CDLL | None:
    """The kernels' library (found or built on first use, then kept in this process), or None where it cannot run
    here. switch: the caller's environment variable that turns its kernels off when "0"; what: what falls back,
    for the log. Raises KernelsUnavailable instead of returning None under PETREL_REQUIRE_KERNELS=1 (unless the
    caller's switch turned them off)."""
    if switch not in _loaded:
        with _lock:
            if switch not in _loaded:
                if os.environ.get(switch, "1") == "0":
                    logger.info("%s run with torch (%s=0)", what, switch)
                    lib = None
                else:
                    lib, where = _library()
                    if lib is None and os.environ.get(REQUIRE_SWITCH) == "1":
                        raise KernelsUnavailable(f"{REQUIRE_SWITCH}=1, but petrel's C kernels cannot run here: {where}")
                _loaded[switch] = lib
    return _loaded[switch]


def out_of_memory(kernel: str) -> MemoryError:
    """The error for a kernel that returned KERNEL_OUT_OF_MEMORY (kernels.h): its output was not written."""
    return MemoryError(f"petrel's {kernel} kernel could not allocate its scratch memory")
