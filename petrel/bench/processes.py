"""The child processes a benchmark runs and watches from outside: a script run to its end (its `RESULT name: {json}`
lines collected), a server run until it is told to stop (ready once /health answers), and the peak resident memory
of each one's whole process tree."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

RESULT_LINE = re.compile(r"^RESULT (\S+): (\{.*\})\s*$", re.M)


def log(msg: str) -> None:
    """A progress line of `petrel bench compare` on stderr, with the time of day."""
    print(f"[compare {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class TreeRSS:
    """Peak RSS (MiB) of a process and all its descendants, watched from outside: the largest of the tree's summed
    RSS, sampled every second (every 0.2 s in the first two, for short processes), and each process's own
    high-water mark (VmHWM, which catches a single process's peak between samples). Never more than the true peak.
    Sampling a long run more often (it was every 0.2 s) cost the measured engine a few percent of its speed on two
    cores."""

    def __init__(self, pid: int, interval: float = 1.0):
        self.pid, self.interval, self.peak_mib = pid, interval, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        start = time.monotonic()
        while not self._stop.is_set():
            try:
                root = psutil.Process(self.pid)
                total = 0
                for proc in [root] + root.children(recursive=True):
                    try:
                        total += proc.memory_info().rss
                        self.peak_mib = max(self.peak_mib, high_water_mark(proc.pid) / 2**20)
                    except psutil.Error:
                        pass
                self.peak_mib = max(self.peak_mib, total / 2**20)
            except psutil.Error:
                pass
            self._stop.wait(0.2 if time.monotonic() - start < 2 else self.interval)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return round(self.peak_mib)


def high_water_mark(pid: int) -> int:
    """A process's peak resident set in bytes (Linux's VmHWM), or 0 where it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def run_script(cmd: list[str], env: dict | None = None, timeout: float = 3600) -> tuple[list[dict], float]:
    """Run one benchmark process to the end; returns the `RESULT name: {json}` objects it printed and its tree's
    peak RSS. Its output goes to our stderr as it comes (progress), and is parsed once it has finished."""
    log("$ " + " ".join(cmd))
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )
    rss = TreeRSS(proc.pid)
    lines = []
    try:
        deadline = time.monotonic() + timeout
        for line in proc.stdout:
            lines.append(line)
            sys.stderr.write("    " + line)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{cmd[0]} ran over {timeout:.0f} s")
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        peak = rss.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... exited with {proc.returncode}")
    text = "".join(lines)
    return [{"name": m.group(1), **json.loads(m.group(2))} for m in RESULT_LINE.finditer(text)], peak


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server about to start)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess (its own session, killed with its children), ready once `health_path` answers 200."""

    def __init__(
        self, cmd: list[str], port: int, env: dict | None = None, health_path: str = "/health", timeout: float = 900
    ):
        import httpx

        log("$ " + " ".join(cmd))
        self.started = time.perf_counter()
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=True
        )
        self.rss = TreeRSS(self.proc.pid)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; log: {self.log.name}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}{health_path}", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"server not ready in {timeout:.0f} s; log: {self.log.name}")
            time.sleep(0.2)
        self.ready_s = time.perf_counter() - self.started

    def close(self) -> float:
        """Stop the server (SIGTERM to its group, SIGKILL after 30 s); returns its tree's peak RSS in MiB."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.rss.stop()
