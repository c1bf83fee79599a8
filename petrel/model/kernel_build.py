"""How petrel's C kernels become one shared library: the sources, the compiler flags, the compiler, and a digest of
what goes in.

One recipe for both builds: setup.py's build step compiles the library into the package when petrel is installed
(`pip install .` / `pip install -e .`), and native.py compiles it into petrel's cache on first use where no
installed library matches the sources (no compiler at install time, or C files edited since an editable install).
setup.py loads this file by its path, before petrel or torch can be imported: it imports the standard library only.

The flags target x86-64 with AVX2 + FMA, never the build machine's own CPU (-march=native): the library runs on any
AVX2 CPU, and the AVX-512 functions (gemm_avx512.c, prefill_attention_avx512.c, int8_gemm.c's and group_gemm.c's
AVX-512 and VNNI blocks) carry their own target attribute and run only where native.cpu_has_avx512 (and
quant_kernels.int8_isa) say so, so one build serves every x86-64 machine the checkout runs on."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sysconfig

DIRECTORY = os.path.dirname(os.path.abspath(__file__))
HEADER = "kernels.h"  # the exported functions' declarations (native.py reads them for ctypes)
SOURCES = (
    "dense_kernels.c",
    "prefill_attention.c",
    "prefill_attention_avx512.c",
    "decode_attention.c",
    "latent_attention.c",
    "latent_layers.c",
    "quant_kernels.c",
    "int8_gemm.c",
    "group_gemm.c",
    "group_gemm_q8.c",
    "gemm_avx2.c",
    "gemm_avx512.c",
    "bf16_pairs.c",
    "panels.c",
    "greedy_rows.c",
    "moe.c",
    "thread_pool.c",
    "scratch.c",
    "build_info.c",
    HEADER,
    "thread_pool.h",
    "scratch.h",
    "simd.h",
    "online_softmax.h",
    "prefill_attention.h",
    "group_gemm_q8.h",
    "group_panels.h",
    "vector_ops.h",
    "gemm_driver.h",
    "gemv_rows.h",
    "bf16_pairs.h",
    "int16_rows.h",
    "weight_product.h",
)
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-pthread", "-shared", "-fPIC")
LIBRARIES = ("-lm",)
INSTALLED_NAME = "petrel.model._kernels"  # setup.py's extension: petrel/model/_kernels<EXT_SUFFIX>


class BuildError(Exception):
    """The kernels could not be built here (the message says why, with the compiler's last lines)."""


def is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def find_compiler() -> str | None:
    """The C compiler to use: $CC, Python's own (sysconfig CC), cc or gcc, the first found on PATH."""
    for name in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc"):
        if name and shutil.which(name.split()[0]):
            return name.split()[0]
    return None


def source_digest(directory: str = DIRECTORY) -> str:
    """The sha256 of the flags and every source file: what a library built from these sources records."""
    digest = hashlib.sha256(" ".join(FLAGS + LIBRARIES).encode())
    for name in SOURCES:
        with open(os.path.join(directory, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read())
    return digest.hexdigest()


def build(output: str, compiler: str | None = None, directory: str = DIRECTORY, timeout: float = 120) -> None:
    """Compile the sources in `directory` into the shared library `output` (written whole or not at all), with
    the source digest built in (kernels_source_digest()). Raises BuildError."""
    if not is_x86_64():
        raise BuildError(f"the kernels are x86-64 code and this machine is {platform.machine()}")
    compiler = compiler or find_compiler()
    if compiler is None:
        raise BuildError("no C compiler found (looked for $CC, cc and gcc on PATH)")
    c_files = [os.path.join(directory, name) for name in SOURCES if name.endswith(".c")]
    tmp = f"{output}.tmp{os.getpid()}"
    command = [
        compiler,
        *FLAGS,
        f'-DPETREL_KERNELS_DIGEST="{source_digest(directory)}"',
        *c_files,
        "-o",
        tmp,
        *LIBRARIES,
    ]
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    try:
        subprocess.run(command, check=True, capture_output=True, timeout=timeout)
        os.replace(tmp, output)
    except subprocess.CalledProcessError as exc:
        detail = (exc.stderr or b"").decode(errors="replace")[-500:].strip()
        raise BuildError(f"{compiler} exited with status {exc.returncode}: {detail}".strip()) from exc
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"{compiler}: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
