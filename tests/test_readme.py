"""The README cannot drift: its Python examples run as written, and every command in its code blocks runs.

Python blocks run in a fresh interpreter (the serve blocks against a `petrel serve` started here, in one
namespace, as a reader would type them in order). Shell lines run with bash; a few get a smaller size so the
suite stays short (`--quick` for benchmarks) or a free port when 8000 is taken; nothing else is rewritten.
`make run` / `make test` are the README's set-up commands: CI itself runs `make test` (.ci/run), so they are
only checked to exist as Makefile targets here.
"""

from __future__ import annotations

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

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", README, flags=re.S)
PYTHON = [code for lang, code in BLOCKS if lang == "python"]
SHELL = [code for lang, code in BLOCKS if lang == ""]
# a command that would run for minutes gets the smoke size of the same command (a repeated option: the last wins).
# Only that each command runs is checked here; what they compute is tested in-process elsewhere: `petrel bench`
# on w1,w2,w4 in tests/test_bench_smoke.py, the serve sweep's JSON and plot in tests/test_serve_e2e.py
SMALLER = {
    "petrel generate": ["--max-tokens", "16"],
    "petrel bench": ["--quick", "--engines", "petrel", "--workloads", "w4"],
    "petrel bench serve": ["--quick", "--num-prompts", "4", "--max-tokens", "4"],
    "petrel bench compare": ["--engines", "petrel", "--workloads", "startup"],
}


def _commands(block: str) -> list[str]:
    """The command lines of a shell block: comments stripped, backslash continuations joined."""
    text = re.sub(r"\\\n\s*", " ", block)
    lines = [line.split("  #")[0].strip() for line in text.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


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
    assert r.returncode == 0, f"{args}\nstdout: {r.stdout[-2000:]}\nstderr: {r.stderr[-2000:]}"
    return r


def test_the_readme_has_the_blocks_this_test_runs():
    assert len(PYTHON) >= 4 and len(SHELL) >= 3
    assert any("make run" in b for b in SHELL) and any("make test" in b for b in SHELL)


def test_the_two_setup_commands_are_makefile_targets():
    makefile = (ROOT / "Makefile").read_text()
    for target in ("run", "test"):
        assert re.search(rf"^{target}:", makefile, flags=re.M), target
    assert "make test" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("index", [0, 1], ids=["llm-api", "executor-api"])
def test_python_examples_run(index, tmp_path):
    code = PYTHON[index]
    assert "127.0.0.1:8000" not in code
    _run([sys.executable, "-c", code], cwd=tmp_path)


def test_terminal_commands_run(tmp_path):
    block = next(b for b in SHELL if "petrel generate" in b and "petrel bench" in b)
    (tmp_path / "prompts.txt").write_text("Name a seabird.\nWhat is 2 + 2?\n")
    ran = []
    for line in _commands(block):
        args = shlex.split(line)
        assert args[0] == "petrel", line
        sub = (
            " ".join(args[:3])
            if args[1:2] == ["bench"] and len(args) > 2 and not args[2].startswith("-")
            else " ".join(args[:2])
        )
        if sub == "petrel serve":
            continue  # long-running: test_serve_examples_run starts it
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
        if sub == "petrel generate" and "--input" not in args:
            assert r.stdout.strip()
    assert {"petrel generate", "petrel chat", "petrel bench", "petrel bench serve", "petrel bench compare"} <= set(ran)


def test_serve_examples_run(tmp_path):
    """`petrel serve --port 8000`, the curl line, then the client blocks in order in one interpreter."""
    serve_block = next(b for b in SHELL if "petrel serve --port 8000" in b and "curl" in b)
    commands = _commands(serve_block)
    port = _port()
    serve = shlex.split(commands[0].replace("8000", str(port)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "petrel.cli", *serve[1:]], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
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
        for line in commands[1:]:
            r = _run(["bash", "-c", line.replace("8000", str(port))], env={**os.environ, "NO_PROXY": "*"})
            assert '"choices"' in r.stdout, r.stdout
        client_blocks = [code for code in PYTHON if "client." in code]
        assert len(client_blocks) >= 2
        script = "\n".join(code.replace("8000", str(port)) for code in client_blocks)
        _run([sys.executable, "-c", script], cwd=tmp_path, env={**os.environ, "NO_PROXY": "*"})
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_every_file_the_docs_name_exists():
    for doc in (ROOT / "README.md", ROOT / "docs" / "ARCHITECTURE.md"):
        named = set(re.findall(r"\b((?:petrel|tests|benchmarks|docs)/[\w/.-]+\.(?:py|md|png|html))", doc.read_text()))
        assert named, doc
        missing = sorted(p for p in named if not (ROOT / p).exists())
        assert not missing, f"{doc.name} names files that do not exist: {missing}"


def test_the_configuration_table_lists_every_engine_option():
    from dataclasses import fields

    from petrel.config import EngineConfig

    table = README[README.index("### Configuration") : README.index("## Layout")]
    documented = set(re.findall(r"^\| `(\w+)` \|", table, flags=re.M))
    assert documented == {f.name for f in fields(EngineConfig)}
