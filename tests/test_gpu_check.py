"""benchmarks/gpu_check.py runs end to end without a GPU (--device cpu --quick): every step, the JSON and the table.
What it measures on a GPU only a GPU can say; here the float32 check compares the CPU engine with itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.e2e
def test_gpu_check_runs_on_cpu_in_small(tmp_path):
    out = tmp_path / "check.json"
    cmd = [sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--quick", "--dtype", "float32"]
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.run([*cmd, "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["float32_vs_cpu"]["equal"] and len(doc["float32_vs_cpu"]["cpu"]) == 8
    # float32 petrel and float32 transformers on one CPU: the same greedy tokens
    assert doc["agreement_with_transformers"] == {"tokens": 8, "matching_prefix": 8}
    assert doc["problems"] == []
    for workload in ("w1", "w2", "w3"):
        assert doc["petrel"][workload]["problems"] == [] and doc["transformers"][workload]["problems"] == []
        assert doc["limit_tok_s"][workload] > 0
    assert doc["petrel"]["w2"]["output_tokens"] == doc["petrel"]["w2"]["expected_output_tokens"]
    assert doc["weight_bytes"] > 100e6  # SmolLM2-135M in float32: about 0.5 GB
    assert "W1 decode tok/s" in proc.stdout and "PASS  float32 greedy on cpu == CPU greedy (8 tokens)" in proc.stdout
