"""How petrel finds, builds and calls its C kernels (petrel/model/native.py, kernel_build.py, kernels.h).

The interface: every exported C function is declared in kernels.h (which every C file includes, so the compiler
checks each definition against it), ctypes takes its types from there, and each Python call site passes exactly
the declared number of arguments and checks the status of the kernels that return one. The library: one installed
by `pip install` is used when built from the current sources (then nothing is compiled), else the first-use build;
a kernel whose scratch allocation fails reports it; with no compiler petrel runs with torch, the same tokens, after
one WARNING naming what is lost, and PETREL_REQUIRE_KERNELS=1 (CI) makes that an error at startup."""

from __future__ import annotations

import ast
import ctypes
import functools
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from petrel import SamplingParams
from petrel.model import (
    dense_kernels,
    gemm_kernels,
    kernel_build,
    latent_stack,
    mla_kernels,
    moe_kernels,
    native,
    quant_kernels,
)

MODEL_DIR = kernel_build.DIRECTORY
needs_kernels = pytest.mark.skipif(
    dense_kernels.library() is None, reason="petrel's kernels cannot run here (no AVX2/FMA or no C compiler)"
)


def _read(name: str) -> str:
    with open(os.path.join(MODEL_DIR, name)) as f:
        return f.read()


def test_every_exported_c_function_is_declared_in_a_header():
    """A function the library exports (defined without `static`) is declared in kernels.h (ctypes' types) or in
    another of the sources' headers (C-only: thread_pool.h, group_gemm_q8.h, ...), so no kernel's arguments are
    known to Python by hand alone."""
    declared = set(native.declarations())
    helpers = set()
    for header in kernel_build.SOURCES:
        if header.endswith(".h") and header != kernel_build.HEADER:
            helpers |= set(re.findall(r"\b(\w+)\s*\(", re.sub(r"/\*.*?\*/", "", _read(header), flags=re.S)))
    defined = set()
    for name in kernel_build.SOURCES:
        if name.endswith(".c"):
            defined |= set(
                re.findall(
                    r"^(?!static\b)(?:const\s+)?\w+\s+\**(\w+)\s*\([^;{]*\)\s*\{", _read(name), flags=re.M | re.S
                )
            )
    assert {"decode_layers", "quant_gemv", "f32_gemm", "parallel_run", "kernels_source_digest"} <= defined
    assert defined - declared - helpers == set()
    assert declared - defined == set()  # nor a declaration without its definition


def test_header_declarations_parse_to_ctypes_types():
    parsed = native.declarations("""/* a comment (with parentheses); */
        #define X 1
        typedef struct { const void *p;
                         int32_t n; } thing;
        int f(const float *const *x, int64_t n, float s,
              const thing *t, int k);
        const char *g(void);
        int64_t h(int32_t a);""")
    P = ctypes.c_void_p
    assert parsed == {
        "f": ([P, ctypes.c_int64, ctypes.c_float, P, ctypes.c_int], ctypes.c_int),
        "g": ([], ctypes.c_char_p),
        "h": ([ctypes.c_int32], ctypes.c_int64),
    }


def _kernel_calls():
    """(module file, kernel name, ast.Call, parent node) for every `...lib.NAME(...)` call in the wrappers."""
    for module in (dense_kernels, gemm_kernels, quant_kernels, moe_kernels, mla_kernels, latent_stack):
        tree = ast.parse(open(module.__file__).read())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and (getattr(node.func.value, "id", None) == "lib" or getattr(node.func.value, "attr", None) == "lib")
            ):
                yield os.path.basename(module.__file__), node.func.attr, node, parents[node]


def test_python_call_sites_match_the_header():
    """Each kernel call passes exactly the declared number of arguments (ctypes accepts extra arguments of a cdecl
    function silently), and every call of a kernel that returns a status (`int`) is an `if` that raises."""
    declared = native.declarations()
    called = set()
    for module, name, call, parent in _kernel_calls():
        where = f"{module}:{call.lineno} {name}"
        assert name in declared, f"{where}: not declared in kernels.h"
        assert not call.keywords and not any(isinstance(a, ast.Starred) for a in call.args), where
        assert len(call.args) == len(declared[name][0]), (
            f"{where}: {len(call.args)} arguments, kernels.h declares {len(declared[name][0])}"
        )
        if declared[name][1] is ctypes.c_int:
            assert isinstance(parent, ast.If) and parent.test is call, f"{where}: its status is not checked"
            assert isinstance(parent.body[0], ast.Raise), where
        called.add(name)
    assert called == set(declared) - {"f32_tile_product", "kernels_source_digest"}  # those two: C / native only


def test_layer_structs_match_the_header():
    """The mixture-of-experts layer (its experts' activation too) and the layer extras decode_layer(s) take, and
    DeepSeek's layers and shapes latent_decode_layers takes, field for field."""
    types = {"int64_t": ctypes.c_int64, "weight": dense_kernels.Weight, "float": ctypes.c_float}
    types["moe_act"] = dense_kernels.MoeAct
    mirrors = (("moe_act", dense_kernels.MoeAct), ("moe_layer", dense_kernels.MoeLayer))
    mirrors += (("latent_layer", latent_stack.LatentLayer), ("latent_shape", latent_stack.LatentShape))
    for name, mirror in (*mirrors, ("layer_extras", dense_kernels.LayerExtras)):
        body = re.search(r"typedef\s+struct\s*\{([^{}]*)\}\s*" + name + r"\s*;", _read("kernels.h")).group(1)
        fields = [
            (m.group(3), ctypes.c_void_p if m.group(2) else types[m.group(1)])
            for m in re.finditer(r"^\s*(?:const\s+)?(\w+)\s*(\*?)\s*(\w+);", body, flags=re.M)
        ]
        assert fields == mirror._fields_, name


def test_weight_struct_matches_the_header():
    body = re.search(r"typedef\s+struct\s*\{(.*?)\}\s*weight\s*;", _read("kernels.h"), flags=re.S).group(1)
    fields = [
        (m.group(3), ctypes.c_void_p if m.group(2) else {"int32_t": ctypes.c_int32}[m.group(1)])
        for m in re.finditer(r"^\s*(?:const\s+)?(\w+)\s*(\*?)\s*(\w+);", body, flags=re.M)
    ]
    assert fields == dense_kernels.Weight._fields_
    assert ctypes.sizeof(dense_kernels.Weight) == 48  # 3 pointers, 5 int32 fields, padded to 8


@needs_kernels
def test_loaded_functions_carry_the_declared_types():
    lib = dense_kernels.library()
    assert lib is quant_kernels.library()  # one library for both
    for name, (argtypes, restype) in native.declarations().items():
        assert getattr(lib, name).argtypes == argtypes and getattr(lib, name).restype == restype, name
    assert lib.kernels_source_digest().decode() == kernel_build.source_digest()


@needs_kernels
def test_failed_scratch_allocation_is_reported():
    """Sizes past any address space: the kernels' malloc fails before anything is read, and they say so."""
    lib, huge = dense_kernels.library(), 1 << 44
    oom = 1  # KERNEL_OUT_OF_MEMORY
    assert lib.quant_gemv(4, None, huge, 64, None, None, None, 5, None, 16, 1, 0) == oom
    assert lib.int8_gemm(None, huge, 64, None, None, None, 16, 1, 0) == oom
    assert lib.group_gemm(4, None, huge, 64, None, None, None, 5, None, 16, 1, 0) == oom
    assert (
        lib.decode_layer(
            None,
            None,
            huge,
            64,
            None,
            None,
            1e-6,
            None,
            None,
            None,
            None,
            128,
            4,
            4,
            16,
            None,
            None,
            None,
            None,
            0,
            0,
            None,
            None,
            1,
            None,
            16,
            0,
            1.0,
            None,
            None,
            0,
            1,
        )
        == oom
    )
    assert (
        lib.decode_layers(
            2,
            None,
            None,
            huge,
            64,
            None,
            None,
            1e-6,
            None,
            128,
            4,
            4,
            16,
            None,
            None,
            None,
            None,
            0,
            0,
            None,
            None,
            16,
            None,
            1.0,
            None,
            0,
            1,
        )
        == oom
    )
    picks = (ctypes.c_int64 * 512)()  # 64 tokens' 8 picks, all expert 0: counted, then no room for their rows
    assert lib.moe_experts(None, 64, huge, 32, 8, picks, None, 0, 4, None, None, None, None, 1) == oom
    # ... and the wrappers raise instead of returning an unwritten output
    failing = SimpleNamespace(quant_gemv=lambda *args: oom, quant_gemm=lambda *args: oom)
    x, codes, scale = torch.randn(2, 64), torch.zeros(16, 2, 16, dtype=torch.uint8), torch.ones(16, 2)
    for product in (quant_kernels.gemv, quant_kernels.gemm):
        with pytest.raises(MemoryError, match="scratch memory"):
            product(failing, 4, x, codes, scale, None, 5, 16)


def test_require_switch_turns_missing_kernels_into_an_error(monkeypatch, caplog):
    monkeypatch.setattr(native, "find_library", lambda: (None, "no C compiler (for this test)"))
    monkeypatch.setattr(native, "_library", functools.cache(native._library.__wrapped__))  # a fresh cache
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.delenv("PETREL_DENSE_KERNELS", raising=False)
    monkeypatch.setenv("PETREL_REQUIRE_KERNELS", "1")
    with pytest.raises(native.KernelsUnavailable, match="PETREL_REQUIRE_KERNELS=1.*no C compiler"):
        dense_kernels.library()
    monkeypatch.setenv("PETREL_DENSE_KERNELS", "0")  # turned off on purpose: no error
    assert dense_kernels.library() is None
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_library", functools.cache(native._library.__wrapped__))
    monkeypatch.delenv("PETREL_DENSE_KERNELS")
    monkeypatch.delenv("PETREL_REQUIRE_KERNELS")
    with caplog.at_level(logging.WARNING, logger="petrel"):
        assert dense_kernels.library() is None and quant_kernels.library() is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # one for the process, whichever kernels ask
    assert "no C compiler" in warnings[0].getMessage() and "W1 roughly halves" in warnings[0].getMessage()


@needs_kernels
def test_installed_library_is_used_when_current_and_rebuilt_when_stale(tmp_path, monkeypatch):
    installed = native._library()[1]  # this process's library: built from these sources too
    builds = []

    def no_build(output, compiler=None, **kwargs):
        builds.append(output)
        raise kernel_build.BuildError("this test compiles nothing")

    monkeypatch.setattr(native, "installed_library", lambda: installed)
    monkeypatch.setattr(kernel_build, "build", no_build)
    monkeypatch.setenv("PETREL_CACHE", str(tmp_path / "cache"))
    lib, where = native.find_library()
    assert lib is not None and where == installed and builds == []
    # C files edited since the install: the installed library is not used, the first-use build runs
    monkeypatch.setattr(kernel_build, "source_digest", lambda directory=None: "0" * 64)
    lib, where = native.find_library()
    assert lib is None and "this test compiles nothing" in where
    assert len(builds) == 1 and builds[0].startswith(str(tmp_path / "cache"))


PROMPTS = ["The capital of France is", "def fibonacci(n):"]
RUN_DEFAULT_MODEL = textwrap.dedent(f"""
    import json, logging, sys
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from petrel.model import native
    native.installed_library = lambda: None      # as on a clean clone installed without a compiler
    from petrel import LLM, SamplingParams
    llm = LLM()
    print("started", flush=True)
    outs = llm.generate({PROMPTS!r}, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    llm.shutdown()
    print(json.dumps({{"tokens": [o.outputs[0].token_ids for o in outs], "kernels": native._library()[0] is not None}}))
""")


def _run(tmp_path, code: str, env: dict) -> subprocess.CompletedProcess:
    """code in a fresh interpreter with an empty petrel cache (nothing built before) and env on top of ours."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("PETREL_REQUIRE_KERNELS", "CC")}
    full_env.update(PETREL_CACHE=str(tmp_path / "cache"), **env)
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=600)


def _current_installed_library() -> str | None:
    """The library `pip install` built, if there is one built from these sources."""
    if (installed := native.installed_library()) is None:
        return None
    built_from = ctypes.CDLL(installed).kernels_source_digest
    built_from.restype = ctypes.c_char_p
    return installed if built_from() == kernel_build.source_digest().encode() else None


@pytest.mark.skipif(not native.cpu_has_avx2_fma(), reason="no AVX2 and FMA: no kernels to install")
def test_installed_kernels_mean_nothing_is_compiled(tmp_path):
    """After `pip install`, the first use of the kernels (LLM() makes it while starting) loads the installed
    library and builds nothing into the cache. Under PETREL_REQUIRE_KERNELS=1 (CI, a fresh install) the
    installed library must be there; elsewhere a checkout installed before its C files last changed skips."""
    if _current_installed_library() is None:
        if os.environ.get("PETREL_REQUIRE_KERNELS") == "1":
            pytest.fail("PETREL_REQUIRE_KERNELS=1, but pip install built no kernels from these sources")
        pytest.skip("no kernels built by pip install from these sources (pip install -e . builds them)")
    proc = _run(
        tmp_path,
        "from petrel.model import dense_kernels, native, quant_kernels\n"
        "assert dense_kernels.library() is not None and quant_kernels.library() is not None\n"
        "print(native._library()[1])",
        {"PETREL_REQUIRE_KERNELS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == _current_installed_library()
    assert not os.path.exists(tmp_path / "cache" / "kernels")


@pytest.mark.e2e
def test_without_a_compiler_petrel_runs_with_torch_and_says_so(tmp_path, llm):
    """A machine with no C compiler and nothing built at install: the default model still loads and produces the
    same greedy tokens (through torch) as with the kernels, after one WARNING naming what is lost; under
    PETREL_REQUIRE_KERNELS=1 the same machine fails at startup."""
    empty = tmp_path / "empty-path"
    empty.mkdir()
    no_compiler = {"PATH": str(empty), "CC": str(tmp_path / "no-such-cc")}
    proc = _run(tmp_path, RUN_DEFAULT_MODEL, no_compiler)
    assert proc.returncode == 0, proc.stderr[-3000:]
    without = json.loads(proc.stdout.strip().splitlines()[-1])
    assert without["kernels"] is False
    reference = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    assert without["tokens"] == [o.outputs[0].token_ids for o in reference]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("WARNING petrel:") and "kernels" in line]
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert "no C compiler" in warnings[0] and "torch" in warnings[0] and "W1 roughly halves" in warnings[0]

    proc = _run(tmp_path, RUN_DEFAULT_MODEL, {**no_compiler, "PETREL_REQUIRE_KERNELS": "1"})
    assert proc.returncode != 0 and "started" not in proc.stdout
    assert (
        "KernelsUnavailable: PETREL_REQUIRE_KERNELS=1, but petrel's C kernels cannot run here: no C compiler"
        in proc.stderr
    )
