"""Smoke test of the benchmark harness: `--quick`, petrel only, in-process, on the default model."""

import json

import numpy as np
import pytest

from petrel import bench
from petrel.bench import report, workloads


def test_workload_generation_matches_the_spec():
    w2 = workloads.make_w2_prompts()
    assert len(w2) == 64
    assert [len(p) for p in w2] == np.random.default_rng(0).integers(64, 513, size=64).tolist()
    assert all(100 <= t < 30000 for p in w2 for t in p)
    assert workloads.make_w2_prompts(8, 128) == [p[:128] for p in w2[:8]]
    w4 = workloads.make_w4_prompts()
    assert len(w4) == 32 and all(len(p) == 1024 + 32 for p in w4)
    assert all(p[:1024] == w4[0][:1024] for p in w4)
    assert len({tuple(p[1024:]) for p in w4}) == 32


@pytest.mark.e2e
def test_quick_petrel_only(tmp_path, capsys):
    out = tmp_path / "quick.json"
    rc = bench.main(["--quick", "--engines", "petrel", "--workloads", "w1,w2,w4", "--out", str(out)])
    assert rc == 0
    q = workloads.QUICK

    # one JSON object per (engine, workload) on stdout, no ratio without the second engine
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["engine"], r["workload"]) for r in lines] == [("petrel", "w1"), ("petrel", "w2"), ("petrel", "w4")]

    doc = json.loads(out.read_text())
    assert set(doc) >= {"meta", "results", "ratios", "all_valid"}
    assert doc["all_valid"] is True and doc["ratios"] == []
    meta = doc["meta"]
    assert meta["quick"] is True and meta["dtype"] == "float32"
    assert meta["w1_prompt_matches_peers"] is True
    assert set(meta["engines"]) == {"petrel"}
    assert {"load_s", "warmup_s", "options", "torch_threads"} <= set(meta["engines"]["petrel"])

    res = {r["workload"]: r for r in doc["results"]}
    for r in res.values():
        assert r["engine"] == "petrel" and r["valid"] is True and r["problems"] == []

    w1 = res["w1"]
    assert w1["new_tokens"] == q.w1_new_tokens and w1["num_runs"] == q.w1_runs
    assert w1["prompt_tokens"] == len(workloads.W1_REFERENCE_IDS)
    for run in w1["runs"]:
        assert run["new_tokens"] == q.w1_new_tokens and run["finish_reason"] == "length"
        assert run["cached_prompt_tokens"] == 0
        assert 0 < run["ttft_s"] < run["total_s"] and run["decode_tok_s"] > 0
    assert w1["ttft_s"] > 0 and w1["decode_tok_s"] > 0
    assert len(w1["output_ids_first32"]) == min(32, q.w1_new_tokens)

    w2 = res["w2"]
    assert w2["num_requests"] == q.w2_num_requests and w2["new_tokens"] == q.w2_new_tokens
    assert w2["output_tokens"] == w2["expected_output_tokens"] == q.w2_num_requests * q.w2_new_tokens
    assert w2["prompt_tokens"] == sum(len(p) for p in workloads.make_w2_prompts(q.w2_num_requests, q.w2_max_prompt_len))
    assert w2["wall_s"] > 0
    assert w2["output_tok_s"] == pytest.approx(w2["output_tokens"] / w2["wall_s"])
    assert w2["total_tok_s"] == pytest.approx((w2["prompt_tokens"] + w2["output_tokens"]) / w2["wall_s"])

    w4 = res["w4"]
    assert w4["num_requests"] == q.w4_num_requests
    assert w4["output_tokens"] == w4["expected_output_tokens"] == q.w4_num_requests * q.w4_new_tokens
    assert w4["prompt_tokens"] == q.w4_num_requests * (q.w4_prefix_len + q.w4_suffix_len)
    assert 0 <= w4["cached_prompt_tokens"] <= (q.w4_num_requests - 1) * q.w4_prefix_len
    assert w4["wall_s"] > 0


def test_ratio_is_withheld_when_a_figure_does_not_count():
    good = {"engine": "hf-transformers", "valid": True, "output_tok_s": 10.0}
    bad = {"engine": "petrel", "valid": False, "output_tok_s": 20.0}
    r = report.ratio("w2", "output_tok_s", bad, good)
    assert r["value"] is None and "does not count" in r["note"] and "petrel" in r["note"]
    ok = report.ratio("w2", "output_tok_s", dict(bad, valid=True), good)
    assert ok["value"] == pytest.approx(2.0)
    assert report.count_problems([4, 4, 3], 4) and not report.count_problems([4, 4], 4)
