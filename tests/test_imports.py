"""petrel's import structure: no module imports itself back through others, and the light modules stay light.

An import cycle is found from the source alone: every `import` and `from ... import` in every file under petrel/,
at module level and inside functions alike (an import inside a function still makes its module depend on the
other; deferring it only hides a circle), except those under `if TYPE_CHECKING:`. The light modules are imported
in a fresh interpreter, which must not have imported torch (or the web stack) afterwards: the scheduler, the block
manager, the detokenizer and the protocol models are tested and used without a model, and `import petrel` loads
nothing until a public name is used.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------- the import graph


def modules_of(package_dir: Path) -> dict[str, Path]:
    """Every module of the package at `package_dir`, by dotted name (a package by its own name)."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imports(tree: ast.AST, module: str, is_package: bool, modules: dict) -> list[tuple[str, int]]:
    """(imported module, line) for each import in `tree` that names one of `modules`, at any depth, skipping
    `if TYPE_CHECKING:` blocks. `from a import b` is an import of a.b when that is a module, else of a."""
    found = []

    def visit(nodes) -> None:
        for child in nodes:
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                visit(child.orelse)
                continue
            if isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: from the module's package, one level up per extra dot
                    package = module.split(".") if is_package else module.split(".")[:-1]
                    package = package[: len(package) - (child.level - 1)]
                    base = ".".join(package + ([base] if base else []))
                for alias in child.names:
                    found.append((f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base, child.lineno))
            visit(ast.iter_child_nodes(child))

    visit(ast.iter_child_nodes(tree))
    return [(name, line) for name, line in found if name in modules and name != module]


def import_graph(package_dir: Path) -> dict[str, dict[str, int]]:
    """module -> {module it imports: the line of the first such import}."""
    modules = modules_of(package_dir)
    graph = {}
    for name, path in modules.items():
        edges: dict[str, int] = {}
        for target, line in _imports(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py", modules):
            edges.setdefault(target, line)
        graph[name] = edges
    return graph


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each holds at least one cycle), iteratively
    (Tarjan's algorithm), each sorted, in a stable order."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return sorted(components)


def describe(component: list[str], graph: dict[str, dict[str, int]], package_dir: Path) -> str:
    """The imports that hold a cycle together, one per line, as path:line -> module."""
    lines = []
    for module in component:
        path = modules_of(package_dir)[module].relative_to(package_dir.parent)
        lines += [
            f"  {path}:{line} imports {target}" for target, line in sorted(graph[module].items()) if target in component
        ]
    return "\n".join(lines)


def test_petrel_has_no_import_cycles():
    graph = import_graph(ROOT / "petrel")
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100, "the walker found too little to be right"
    cycles = import_cycles(graph)
    assert not cycles, (
        "import cycles (break each by moving what both sides need into a module of its own):\n"
        + "\n".join(describe(c, graph, ROOT / "petrel") for c in cycles)
    )


def test_the_cycle_check_finds_cycles_through_functions_and_relative_imports(tmp_path):
    """The walker on a made-up package: a module-level cycle, one closed by an import inside a function, one
    through a relative import, and an import under TYPE_CHECKING that is no cycle."""
    files = {
        "__init__.py": "",
        "a.py": "from pkg import b\n",
        "b.py": "import pkg.a\n",
        "c.py": "def f():\n    from pkg.d import x\n",
        "d.py": "from pkg import c\nx = 1\n",
        "e.py": "from .sub import g\n",
        "sub/__init__.py": "",
        "sub/g.py": "from .. import e\n",
        "h.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import i\n",
        "i.py": "import pkg.h\n",
    }
    for name, text in files.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    graph = import_graph(tmp_path / "pkg")
    assert import_cycles(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"], ["pkg.e", "pkg.sub.g"]]
    assert "pkg/c.py:2 imports pkg.d" in describe(["pkg.c", "pkg.d"], graph, tmp_path / "pkg")


# ------------------------------------------------------------------------------------------- light modules


def imported_after(code: str) -> dict:
    """Run `code` in a fresh interpreter; which heavy packages and petrel modules it had imported at the end."""
    probe = code + textwrap.dedent("""
        import json, sys
        print(json.dumps({"heavy": sorted(m for m in ("torch", "transformers", "fastapi", "uvicorn", "numpy")
                                          if m in sys.modules),
                          "petrel": sorted(m for m in sys.modules if m.split(".")[0] == "petrel")}))
    """)
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "module",
    [
        "petrel",
        "petrel.engine.scheduler",
        "petrel.engine.block_manager",
        "petrel.engine.detokenizer",
        "petrel.serve.protocol",
        "petrel.serve",
        "petrel.route",
        "petrel.cli",
        "petrel.bench",
        "petrel.distributed",
    ],
)
def test_light_modules_do_not_import_torch(module):
    after = imported_after(f"import {module}\n")
    assert "torch" not in after["heavy"] and "transformers" not in after["heavy"], after
    if module != "petrel.serve.protocol":  # pydantic only: no web framework either
        assert "fastapi" not in after["heavy"], after


def test_import_petrel_loads_nothing_until_a_name_is_used():
    after = imported_after("import petrel\nassert petrel.__version__\n")
    assert after["petrel"] == ["petrel"] and after["heavy"] == []
    after = imported_after("from petrel import SamplingParams\nSamplingParams(max_tokens=4)\n")
    assert "torch" not in after["heavy"]  # sampling parameters need no model
    after = imported_after("from petrel import LLM\n")
    assert "torch" in after["heavy"] and "petrel.llm" in after["petrel"]


def test_every_public_name_of_petrel_is_the_object_its_module_defines():
    import importlib

    import petrel

    assert set(petrel.__all__) == {
        "LLM",
        "RequestFuture",
        "SamplingParams",
        "EngineConfig",
        "RequestOutput",
        "CompletionOutput",
        "Logprob",
        "OutputChunk",
        "FinishDetails",
        "RequestPerfMetrics",
        "TextGenerationRequest",
        "GuidedDecodingParams",
        "LoRARequest",
        "DisaggregatedParams",
    }
    for name in petrel.__all__:
        module = importlib.import_module(petrel._EXPORTS[name])
        assert getattr(petrel, name) is getattr(module, name), name
        assert name in dir(petrel)
    namespace = {}
    exec("from petrel import *", namespace)
    assert set(petrel.__all__) <= set(namespace)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        petrel.NoSuchThing  # noqa: B018


def test_the_packages_lazy_names_resolve():
    """petrel.serve, petrel.route and petrel.bench import their public names on first use: each resolves, to the
    object its module defines."""
    import petrel.bench
    import petrel.route
    import petrel.serve
    from petrel.bench import in_process, runners, workloads
    from petrel.route import disagg, router
    from petrel.serve import app

    assert petrel.serve.build_app is app.build_app
    for name in ("Backend", "Router", "build_router_app", "prefix_of"):
        assert getattr(petrel.route, name) is getattr(router, name)
    assert petrel.route.build_disagg_app is disagg.build_disagg_app
    assert petrel.bench.make_w2_prompts is workloads.make_w2_prompts and petrel.bench.QUICK is workloads.QUICK
    assert petrel.bench.PetrelRunner is runners.PetrelRunner and petrel.bench.run_w1 is in_process.run_w1
    # petrel.bench keeps __all__ literal (type checkers read it statically): it must name exactly what it exports
    assert set(petrel.bench.__all__) == {"main", *petrel.bench._EXPORTS}
    for package in (petrel.serve, petrel.route, petrel.bench):
        with pytest.raises(AttributeError):
            package.no_such_name  # noqa: B018


def test_the_workloads_the_peers_import_need_only_numpy():
    """benchmarks/peers/ runs in the peers' own virtual environments, which have numpy but not petrel's
    dependencies: what the peer scripts import from petrel must need nothing more."""
    after = imported_after("import sys; sys.path.insert(0, 'benchmarks/peers'); import peer_common\n")
    assert after["heavy"] == ["numpy"], after
    assert set(after["petrel"]) == {"petrel", "petrel.bench", "petrel.bench.report", "petrel.bench.workloads"}
