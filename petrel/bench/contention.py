"""`--contention N`: N competing CPU-bound processes while an engine runs, so that every engine of a comparison
meets the same degradation. `stress-ng --cpu N` when it is installed, else N copies of a Python busy loop; each in
a session of its own, stopped (and reaped) when the run ends, whatever way it ends."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

BUSY_LOOP = "while True: pass"


class Contention:
    """A context manager: `with Contention(n): run()` keeps n CPU-bound processes busy during run(); n = 0 does
    nothing. `tool` says what ran them ("stress-ng" or "python"); `pids` are the processes started."""

    def __init__(self, n: int, prefer_stress_ng: bool = True):
        if n < 0:
            raise ValueError(f"contention: {n} processes (must be >= 0)")
        self.n = n
        self.stress_ng = shutil.which("stress-ng") if prefer_stress_ng else None
        self.tool = "stress-ng" if self.stress_ng else "python"
        self.procs: list[subprocess.Popen] = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def describe(self) -> str:
        if not self.n:
            return "off"
        what = f"stress-ng --cpu {self.n}" if self.stress_ng else f"{self.n} Python busy-loop process(es)"
        return f"{what} running during each engine's run"

    def start(self) -> Contention:
        if not self.n or self.procs:
            return self
        if self.stress_ng:
            cmds = [[self.stress_ng, "--cpu", str(self.n), "--quiet"]]
        else:
            cmds = [[sys.executable, "-c", BUSY_LOOP] for _ in range(self.n)]
        for cmd in cmds:
            self.procs.append(
                subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            )
        return self

    def stop(self) -> None:
        """SIGTERM to each started process's group (stress-ng's workers are its children), SIGKILL after 5 s."""
        for proc in self.procs:
            _signal_group(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
            _signal_group(proc.pid, signal.SIGKILL)  # any child left in its group
        self.procs = []

    def __enter__(self) -> Contention:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
