"""`petrel bench compare`: the pieces that do not need the peers installed (the run itself is a benchmark)."""
import json
import sys

import pytest

from petrel import bench_compare


def test_run_script_collects_result_lines_and_rss():
    code = ("import json; x = bytearray(50 * 2**20); import time; time.sleep(0.5); "
            "print('progress'); print('RESULT a_w1: ' + json.dumps({'decode_tok_s': 12.5})); "
            "print('RESULT a_w2: ' + json.dumps({'output_tok_s': 80.0}))")
    results, peak = bench_compare.run_script([sys.executable, "-c", code])
    assert [r["name"] for r in results] == ["a_w1", "a_w2"]
    assert results[0]["decode_tok_s"] == 12.5 and results[1]["output_tok_s"] == 80.0
    assert peak >= 50            # the 50 MiB buffer was seen by the outside sampler


def test_peak_rss_catches_a_peak_between_samples():
    """A child that holds 300 MB for 0.3 s between two samples a second apart: its high-water mark still counts."""
    import subprocess
    import time
    code = "import time; time.sleep(2.4); b = bytearray(300 << 20); time.sleep(0.3); del b; time.sleep(1.5)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    rss = bench_compare.TreeRSS(proc.pid, interval=1.0)
    proc.wait()
    time.sleep(0.1)
    assert rss.stop() >= 300


def test_run_script_failure_is_an_error():
    with pytest.raises(RuntimeError, match="exited with 3"):
        bench_compare.run_script([sys.executable, "-c", "import sys; sys.exit(3)"])


def test_ratio_table_puts_petrel_over_each_peer():
    rows = [{"workload": "w2", "metric": "output tok/s", "engine": "petrel", "value": 120.0, "unit": "tok/s"},
            {"workload": "w2", "metric": "output tok/s", "engine": "vllm", "value": 80.0, "unit": "tok/s"},
            {"workload": "w1", "metric": "TTFT", "engine": "hf", "value": 140.0, "unit": "ms"}]
    table = bench_compare.ratio_table(rows, ["petrel", "hf", "vllm"])
    assert table[0] == "| workload | metric | petrel | hf | vllm | petrel / hf | petrel / vllm |"
    w2 = next(line for line in table if line.startswith("| w2"))
    assert w2.split("|")[-2].strip() == "1.50x" and w2.split("|")[-3].strip() == ""   # no hf figure, no ratio
    w1 = next(line for line in table if line.startswith("| w1"))
    assert "140" in w1 and "x" not in w1.split("|")[-2]


def test_w2_flops_counts_every_position_through_every_layer():
    # SmolLM2-135M: 30 layers of 3.54 M linear weights; W2 has ~18.6 k prompt and 8 k output positions
    assert 6.0e12 < bench_compare.w2_matmul_flops() < 7.0e12


def test_missing_peers_are_left_out(tmp_path, capsys):
    out = tmp_path / "c.json"
    code = bench_compare.main(["--engines", "hf,vllm,llamacpp", "--workloads", "w1", "--peers-home", str(tmp_path),
                               "--json", str(out)])
    doc = json.loads(out.read_text())
    assert code == 0 and doc["meta"]["engines"] == [] and doc["meta"]["missing"] == ["hf", "vllm", "llamacpp"]
    assert doc["meta"]["matmul_peak_gflops"] > 1
    assert "not installed" in capsys.readouterr().err


def test_unknown_engine_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="unknown engine 'sglang'"):
        bench_compare.main(["--engines", "sglang", "--peers-home", str(tmp_path)])
