"""`make lint`'s type check: every module pyproject.toml's [tool.mypy] names exists, so a renamed module cannot
silently drop out of the strict set (or out of the not-yet list, which would then fail the check)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MYPY = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]


def _path(module: str) -> Path:
    base = ROOT / Path(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def test_every_module_the_type_check_names_exists():
    for override in MYPY["overrides"]:
        missing = [m for m in override["module"] if not _path(m).is_file()]
        assert not missing, missing


def test_the_cores_are_strict_and_lint_runs_mypy():
    strict = next(o for o in MYPY["overrides"] if o.get("disallow_untyped_defs"))
    for core in ("petrel.engine.scheduler", "petrel.engine.block_manager", "petrel.sampling_params", "petrel.config"):
        assert core in strict["module"], core
    lenient = [o for o in MYPY["overrides"] if o.get("ignore_errors")]
    assert not set(strict["module"]) & {m for o in lenient for m in o["module"]}
    makefile = (ROOT / "Makefile").read_text()
    lint = re.search(r"^lint:.*?\n((?:\t.*\n)+)", makefile, flags=re.M).group(1)
    assert "mypy" in lint and "ruff check" in lint
