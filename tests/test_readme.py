"""The README and the documentation site cannot drift: their examples run as written.

The pages are README.md and the site's pages in mkdocs.yml's nav order. Their code blocks follow one rule:
- ```python blocks run. Those that talk to a server (`client.`, or 127.0.0.1:8000) run in one interpreter, in
  order, in one namespace (as a reader would type them), against a `petrel serve` started here; every other one runs
  in its own namespace, all of them in one interpreter (one start-up for all).
- Untagged ``` blocks are commands that run: `make X` (CI itself runs `make test`, .ci/run, so the targets are only
  checked to exist), `petrel ...` (a few get a smaller size so the suite stays short, `--quick` for benchmarks),
  `petrel serve --port 8000` (started once, on a free port when 8000 is taken) and the `curl` lines against it.
  Any other line in an untagged block fails the test: a command this test cannot run belongs in a ```sh block.
- ```py, ```sh, ```bash and ```text blocks are shown, not run (they need weights, several servers or a cluster).
A block that appears on two pages (the README's tour and the Quickstart) runs once.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent


def _nav_pages(nav) -> list[str]:
    """The docs/-relative paths of mkdocs.yml's nav, in order."""
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


NAV = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
PAGES = ["README.md"] + [f"docs/{page}" for page in NAV]
README = (ROOT / "README.md").read_text()
BLOCKS = [
    (page, lang, code)
    for page in PAGES
    for lang, code in re.findall(r"^```(\w*)\n(.*?)^```", (ROOT / page).read_text(), flags=re.S | re.M)
]


def _unique(items):
    seen, kept = set(), []
    for key, value in items:
        if value not in seen:
            seen.add(value)
            kept.append((key, value))
    return kept


PYTHON = _unique((page, code) for page, lang, code in BLOCKS if lang == "python")
SERVER_PYTHON = [(page, code) for page, code in PYTHON if "client." in code or "127.0.0.1:8000" in code]
STANDALONE_PYTHON = [(page, code) for page, code in PYTHON if (page, code) not in SERVER_PYTHON]
SHELL = [(page, code) for page, lang, code in BLOCKS if lang == ""]
# a command that would run for minutes gets the smoke size of the same command (a repeated option: the last wins).
# Only that each command runs is checked here; what they compute is tested in-process elsewhere: `petrel bench`
# on w1,w2,w4 in tests/test_bench_smoke.py, the serve sweep's JSON and plot in tests/test_serve_e2e.py
SMALLER = {
    "petrel generate": ["--max-tokens", "16"],
    "petrel bench": ["--quick", "--engines", "petrel", "--workloads", "w4"],
    "petrel bench serve": ["--quick", "--num-prompts", "4", "--max-tokens", "4"],
    "petrel bench compare": ["--engines", "petrel", "--workloads", "startup"],
}
SERVE = "petrel serve --port 8000"
# runs blocks in one interpreter: each in a namespace of its own, or all in one (argv[2] == "shared"); a block's
# name (page and place) is its file name, so a traceback says which block failed
RUNNER = """
import json, sys
blocks = json.load(open(sys.argv[1]))
shared = {"__name__": "__main__"}
for name, code in blocks:
    print(f"--- {name}", flush=True)
    namespace = shared if sys.argv[2] == "shared" else {"__name__": "__main__"}
    exec(compile(code, name, "exec"), namespace)
"""


def _commands(block: str) -> list[str]:
    """The command lines of a shell block: comments stripped, backslash continuations joined."""
    text = re.sub(r"\\\n\s*", " ", block)
    lines = [line.split("  #")[0].strip() for line in text.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


COMMANDS = _unique((page, line) for page, block in SHELL for line in _commands(block))


def _port() -> int:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", 8000))
            return 8000
        except OSError:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]


def _run(args, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(args, capture_output=True, text=True, timeout=600, **kw)
    assert r.returncode == 0, f"{args}\nstdout: {r.stdout[-2000:]}\nstderr: {r.stderr[-3000:]}"
    return r


def _run_blocks(blocks, tmp_path, shared: bool, **kw) -> subprocess.CompletedProcess:
    named = [(f"{page} python block {i}", code) for i, (page, code) in enumerate(blocks, 1)]
    (tmp_path / "blocks.json").write_text(json.dumps(named))
    mode = "shared" if shared else "own"
    return _run([sys.executable, "-c", RUNNER, str(tmp_path / "blocks.json"), mode], cwd=tmp_path, **kw)


def test_the_pages_have_the_blocks_this_test_runs():
    readme = [code for page, lang, code in BLOCKS if page == "README.md" and lang in ("python", "")]
    assert any("make run" in b for b in readme) and any("make test" in b for b in readme)
    assert len(STANDALONE_PYTHON) >= 4 and len(SERVER_PYTHON) >= 5
    assert any(line.startswith("petrel bench compare") for _, line in COMMANDS)
    assert any(line.startswith(SERVE) for _, line in COMMANDS) and any(line.startswith("curl") for _, line in COMMANDS)


def test_every_command_in_an_untagged_block_is_one_this_test_runs():
    for page, line in COMMANDS:
        assert line.split()[0] in ("make", "petrel", "curl"), f"{page}: {line!r} (tag its block sh to show it only)"


def test_the_setup_commands_are_makefile_targets():
    makefile = (ROOT / "Makefile").read_text()
    for page, line in COMMANDS:
        if line.startswith("make "):
            target = line.split()[1]
            assert re.search(rf"^{re.escape(target)}:", makefile, flags=re.M), (page, line)
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_python_examples_run(tmp_path):
    """Every example that needs no server, each in its own namespace, in one interpreter."""
    for _, code in STANDALONE_PYTHON:
        assert "127.0.0.1:8000" not in code
    _run_blocks(STANDALONE_PYTHON, tmp_path, shared=False)


def test_terminal_commands_run(tmp_path):
    (tmp_path / "prompts.txt").write_text("Name a seabird.\nWhat is 2 + 2?\n")
    ran = []
    for page, line in COMMANDS:
        args = shlex.split(line)
        if args[0] != "petrel":
            continue
        sub = (
            " ".join(args[:3])
            if args[1:2] == ["bench"] and len(args) > 2 and not args[2].startswith("-")
            else " ".join(args[:2])
        )
        if sub == "petrel serve":
            assert line.startswith(SERVE), (page, line)  # the one server test_serve_examples_run starts
            continue
        if sub in ("petrel bench latency", "petrel bench throughput", "petrel bench prefix"):
            args += ["--quick"]
        else:
            args += SMALLER.get(sub, [])
        cmd = [sys.executable, "-m", "petrel.cli", *args[1:]]
        if sub == "petrel chat":
            r = _run(cmd, cwd=tmp_path, input="Hi!\n/exit\n")
        else:
            r = _run(cmd, cwd=tmp_path)
        ran.append(sub)
        if "--input" in args:
            lines = (tmp_path / "results.jsonl").read_text().splitlines()
            assert len(lines) == 2
        if sub in ("petrel generate", "petrel env") and "--input" not in args:
            assert r.stdout.strip()
    expected = {"petrel generate", "petrel chat", "petrel env", "petrel bench", "petrel bench serve"}
    assert expected | {"petrel bench compare"} <= set(ran)


def test_serve_examples_run(tmp_path):
    """`petrel serve --port 8000`, the curl lines, then the client blocks in order in one interpreter."""
    port = _port()
    serve = shlex.split(SERVE.replace("8000", str(port)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "petrel.cli", *serve[1:]], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    env = {**os.environ, "NO_PROXY": "*"}
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not become healthy"
            time.sleep(0.5)
        for page, line in COMMANDS:
            if line.startswith("curl"):
                r = _run(["bash", "-c", line.replace("8000", str(port))], env=env)
                assert '"choices"' in r.stdout, (page, r.stdout)
        blocks = [(page, code.replace("8000", str(port))) for page, code in SERVER_PYTHON]
        _run_blocks(blocks, tmp_path, shared=True, env=env)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_every_file_the_docs_name_exists():
    docs = [*PAGES, "CONTRIBUTING.md", "RELIABILITY.md"]
    for doc in docs:
        named = set(
            re.findall(r"\b((?:petrel|tests|benchmarks|docs)/[\w/.-]+\.(?:py|md|png|html))", (ROOT / doc).read_text())
        )
        missing = sorted(p for p in named if not (ROOT / p).exists())
        assert not missing, f"{doc} names files that do not exist: {missing}"


def test_every_page_under_docs_is_in_the_nav():
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert pages == set(NAV), pages ^ set(NAV)


def test_the_configuration_table_lists_every_engine_option():
    from dataclasses import fields

    from petrel.config import EngineConfig

    page = (ROOT / "docs" / "configuration.md").read_text()
    table = page[page.index("## Engine options") : page.index("## The engine\n")]
    documented = set(re.findall(r"^\| `(\w+)` \|", table, flags=re.M))
    assert documented == {f.name for f in fields(EngineConfig)}


def test_the_api_reference_covers_every_public_name():
    import petrel

    reference = (ROOT / "docs" / "reference.md").read_text()
    for name in petrel.__all__:
        assert f"::: {petrel._EXPORTS[name]}.{name}\n" in reference, name
