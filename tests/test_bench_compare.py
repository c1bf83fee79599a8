"""`petrel bench compare`: the pieces that do not need the peers installed (the run itself is a benchmark)."""

import json
import sys

import pytest

from petrel.bench import compare, flops, processes, report


def test_run_script_collects_result_lines_and_rss():
    code = (
        "import json; x = bytearray(50 * 2**20); import time; time.sleep(0.5); "
        "print('progress'); print('RESULT a_w1: ' + json.dumps({'decode_tok_s': 12.5})); "
        "print('RESULT a_w2: ' + json.dumps({'output_tok_s': 80.0}))"
    )
    results, peak = processes.run_script([sys.executable, "-c", code])
    assert [r["name"] for r in results] == ["a_w1", "a_w2"]
    assert results[0]["decode_tok_s"] == 12.5 and results[1]["output_tok_s"] == 80.0
    assert peak >= 50  # the 50 MiB buffer was seen by the outside sampler


def test_peak_rss_catches_a_peak_between_samples():
    """A child that holds 300 MB for 0.3 s between two samples a second apart: its high-water mark still counts."""
    import subprocess
    import time

    code = "import time; time.sleep(2.4); b = bytearray(300 << 20); time.sleep(0.3); del b; time.sleep(1.5)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    rss = processes.TreeRSS(proc.pid, interval=1.0)
    proc.wait()
    time.sleep(0.1)
    assert rss.stop() >= 300


def test_run_script_failure_is_an_error():
    with pytest.raises(RuntimeError, match="exited with 3"):
        processes.run_script([sys.executable, "-c", "import sys; sys.exit(3)"])


def test_ratio_table_puts_petrel_over_each_peer():
    rows = [
        {"workload": "w2", "metric": "output tok/s", "engine": "petrel", "value": 120.0, "unit": "tok/s"},
        {"workload": "w2", "metric": "output tok/s", "engine": "vllm", "value": 80.0, "unit": "tok/s"},
        {"workload": "w1", "metric": "TTFT", "engine": "hf", "value": 140.0, "unit": "ms"},
    ]
    table = report.ratio_table(rows, ["petrel", "hf", "vllm"])
    assert table[0] == "| workload | metric | petrel | hf | vllm | petrel / hf | petrel / vllm |"
    w2 = next(line for line in table if line.startswith("| w2"))
    assert w2.split("|")[-2].strip() == "1.50x" and w2.split("|")[-3].strip() == ""  # no hf figure, no ratio
    w1 = next(line for line in table if line.startswith("| w1"))
    assert "140" in w1 and "x" not in w1.split("|")[-2]


def test_ratio_table_over_rounds_gives_medians_and_the_median_of_paired_ratios():
    def row(engine, value, round_):
        return {
            "workload": "w2",
            "metric": "output tok/s",
            "engine": engine,
            "value": value,
            "unit": "tok/s",
            "round": round_,
        }

    # rounds' ratios 1.5, 1.0, 1.25: their median 1.25 (the medians' ratio, 120 / 90, would say 1.33)
    rows = [row("petrel", 120.0, 0), row("vllm", 80.0, 0), row("vllm", 100.0, 1), row("petrel", 100.0, 1),
            row("petrel", 150.0, 2), row("vllm", 120.0, 2)]  # fmt: skip
    line = report.ratio_table(rows, ["petrel", "vllm"])[2]
    assert [c.strip() for c in line.split("|")[1:-1]] == [
        "w2",
        "output tok/s (tok/s)",
        "120",
        "100",
        "1.25x (1.00-1.50)",
    ]
    # a round without the peer's figure (it failed there) has no ratio; the others still pair up
    rows = [r for r in rows if not (r["engine"] == "vllm" and r["round"] == 2)]
    assert report.ratio_table(rows, ["petrel", "vllm"])[2].split("|")[-2].strip() == "1.25x (1.00-1.50)"


def test_rounds_run_the_engines_in_turn_and_keep_each_rounds_figures(tmp_path, monkeypatch):
    """--rounds 3 with two stand-in engines: the order alternates (A B, B A, A B), every row and raw result keeps
    its round, and the table pairs each round's figures."""
    calls = []

    def engine(name, tok_s):
        def run(self, workloads):
            calls.append((self.round, name))
            self.raw[f"{name}_w2"] = {"round": self.round}
            self.add("w2", "output tok/s", name, tok_s[self.round], "tok/s")

        return run

    monkeypatch.setattr(compare.Compare, "installed", lambda self, e: True)
    monkeypatch.setattr(compare.Compare, "petrel", engine("petrel", [130.0, 100.0, 120.0]))
    monkeypatch.setattr(compare.Compare, "vllm", engine("vllm", [100.0, 100.0, 80.0]))
    monkeypatch.setattr(flops, "matmul_peak_gflops", lambda: 100.0)
    out = tmp_path / "c.json"
    code = compare.main(["--engines", "petrel,vllm", "--workloads", "w2", "--quick", "--rounds", "3",
                         "--peers-home", str(tmp_path), "--json", str(out)])  # fmt: skip
    doc = json.loads(out.read_text())
    assert code == 0 and calls == [(0, "petrel"), (0, "vllm"), (1, "vllm"), (1, "petrel"), (2, "petrel"),
                                   (2, "vllm")]  # fmt: skip
    assert doc["meta"]["rounds"] == 3 and [r["round"] for r in doc["rows"]] == [0, 0, 1, 1, 2, 2]
    assert doc["raw"]["round 2"] == {"vllm_w2": {"round": 1}, "petrel_w2": {"round": 1}}
    line = next(line for line in doc["table"] if line.startswith("| w2"))
    assert line.split("|")[-2].strip() == "1.30x (1.00-1.50)" and "3 rounds" in " ".join(doc["table"])
    with pytest.raises(SystemExit, match="--rounds 0"):
        compare.main(["--engines", "petrel", "--rounds", "0", "--peers-home", str(tmp_path)])


def test_w2_flops_counts_every_position_through_every_layer():
    # SmolLM2-135M: 30 layers of 3.54 M linear weights; W2 has ~18.6 k prompt and 8 k output positions
    assert 6.0e12 < flops.w2_matmul_flops() < 7.0e12


def test_missing_peers_are_left_out(tmp_path, capsys):
    out = tmp_path / "c.json"
    code = compare.main(
        ["--engines", "hf,vllm,llamacpp", "--workloads", "w1", "--peers-home", str(tmp_path), "--json", str(out)]
    )
    doc = json.loads(out.read_text())
    assert code == 0 and doc["meta"]["engines"] == [] and doc["meta"]["missing"] == ["hf", "vllm", "llamacpp"]
    assert doc["meta"]["matmul_peak_gflops"] > 1
    assert "not installed" in capsys.readouterr().err


def test_unknown_engine_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="unknown engine 'sglang'"):
        compare.main(["--engines", "sglang", "--peers-home", str(tmp_path)])


def test_the_default_peers_dir_is_this_checkouts_and_holds_every_peers_script(monkeypatch):
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    monkeypatch.delenv("PETREL_PEERS_DIR", raising=False)
    peers_dir = Path(compare.build_parser().parse_args([]).peers_dir)
    assert peers_dir == root / "benchmarks" / "peers"
    assert (peers_dir / "setup_peers.sh").stat().st_mode & 0o100, "setup_peers.sh is not executable"
    for script in compare.PEER_SCRIPTS.values():  # each parses its options without its engine installed
        r = subprocess.run(
            [sys.executable, str(peers_dir / script), "--help"], capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0 and "w4" in r.stdout and "--quick" in r.stdout, (script, r.stderr)


def test_a_peer_runs_through_its_script_and_its_figures_reach_the_table(tmp_path):
    """transformers as an installed peer (its venv's python is this one, its model a tiny random Llama with the
    default model's vocabulary): `compare --quick` runs benchmarks/peers/hf_bench.py on W4 and tabulates it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from petrel.bench.workloads import QUICK

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "models" / "smollm2-135m-instruct")
    python = tmp_path / "venv-hf" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    out = tmp_path / "compare.json"
    code = compare.main(
        ["--engines", "hf", "--workloads", "w4", "--quick", "--peers-home", str(tmp_path), "--json", str(out)]
    )
    doc = json.loads(out.read_text())
    assert code == 0 and doc["meta"]["engines"] == ["hf"] and doc["meta"]["errors"] == {}
    raw = doc["raw"]["hf_w4"]
    assert raw["valid"] and raw["num_requests"] == QUICK.w4_num_requests
    assert raw["output_tokens"] == raw["expected_output_tokens"] == QUICK.w4_num_requests * QUICK.w4_new_tokens
    rows = {r["metric"]: r for r in doc["rows"] if r["engine"] == "hf" and r["workload"] == "w4"}
    assert rows["wall"]["value"] == raw["wall_s"] > 0
    assert rows["prompt tokens from cache"]["value"] == 0  # transformers has no prefix cache
    assert any(line.startswith("| w4 | wall (s) | ") for line in doc["table"])
    assert json.loads((tmp_path / "results" / "hf_w4_compare.json").read_text())["wall_s"] == raw["wall_s"]


def test_llama_server_w3_has_w3_concurrency_slots_on_each_gguf(tmp_path):
    """W3 against llama.cpp's C++ server: found in $PEERS_HOME/llama-server-build/bin, started on the F32 and the
    Q4_1 GGUF with W3's concurrency in slots, its figures in rows named by the GGUF's kind. The server here is a
    stand-in that records its command line and serves the same GGUF through `petrel serve`."""
    from petrel.bench.workloads import W3_CONCURRENCY
    from petrel.model.loader import default_model_path

    models = tmp_path / "models"
    models.mkdir()
    for name in ("smollm2-135m-instruct-f32.gguf", "SmolLM2-135M-Instruct.Q4_1.gguf"):
        (models / name).symlink_to(default_model_path())
    server = tmp_path / "llama-server-build" / "bin" / "llama-server"
    server.parent.mkdir(parents=True)
    argv_log = tmp_path / "argv.jsonl"
    server.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"open({str(argv_log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
        "opt = dict(zip(sys.argv[1::2], sys.argv[2::2]))\n"
        "os.execv(sys.executable, [sys.executable, '-m', 'petrel.cli', 'serve', '--model', opt['--model'], "
        "'--port', opt['--port'], '--served-model-name', opt['--alias'], '--log-level', 'warning'])\n"
    )
    server.chmod(0o755)
    cmp = compare.Compare(compare.build_parser().parse_args(["--peers-home", str(tmp_path), "--quick"]))
    if cmp.llama_server() != str(server):
        pytest.skip("a llama-server on PATH comes first")
    cmp.llamacpp_w3()
    argvs = [json.loads(line) for line in argv_log.read_text().splitlines()]
    assert [a[a.index("--model") + 1] for a in argvs] == [cmp.gguf["f32"], cmp.gguf["q4_1"]]
    assert all(a[a.index("--parallel") + 1] == str(W3_CONCURRENCY) for a in argvs)
    rows = {r["metric"]: r for r in cmp.rows if r["engine"] == "llamacpp" and r["workload"] == "w3"}
    assert rows["output tok/s"]["value"] > 0 and rows["output tok/s (Q4_1)"]["value"] > 0
    assert f"{W3_CONCURRENCY} slots" in rows["output tok/s"]["note"]
    assert cmp.raw["llamacpp_w3_f32"]["valid"] and cmp.raw["llamacpp_w3_q4_1"]["valid"]


def test_quantization_reaches_every_petrel_run_and_names_the_w1_row(tmp_path, monkeypatch):
    """--quantization gguf: each of petrel's benchmark processes gets it (a GGUF's blocks kept, as llama.cpp
    multiplies them), W1's row says so, the meta records it, and the default model's extra Q4_1 run is not repeated."""
    argvs = []

    def fake_run_script(argv, *a, **k):
        argvs.append(argv)
        out = argv[argv.index("--json") + 1]
        r = {"workload": "w1", "valid": True, "decode_tok_s": 50.0, "ttft_s": 0.05}
        with open(out, "w") as f:
            json.dump({"results": [r]}, f)
        return [], 100.0

    monkeypatch.setattr(compare, "run_script", fake_run_script)
    monkeypatch.setattr(compare.Compare, "installed", lambda self, e: True)
    monkeypatch.setattr(flops, "matmul_peak_gflops", lambda: 100.0)
    out = tmp_path / "c.json"
    code = compare.main(["--engines", "petrel", "--workloads", "w1", "--quick", "--quantization", "gguf",
                         "--peers-home", str(tmp_path), "--json", str(out)])  # fmt: skip
    doc = json.loads(out.read_text())
    assert code == 0 and len(argvs) == 1
    assert argvs[0][argvs[0].index("--quantization") + 1] == "gguf"
    assert {r["metric"] for r in doc["rows"]} >= {"decode tok/s (petrel gguf)"}
    assert doc["meta"]["petrel_quantization"] == "gguf"
