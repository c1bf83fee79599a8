"""The benchmark tools behind the Performance page's tables: the 1B builder (at a tiny scale of the same code), W6's
prompts and plan, the contention helper, and `petrel bench compare`'s --model / --gguf / --contention / w6 handling
(the peers themselves are not installed here: the command lines built for them are checked)."""

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from benchmark_scripts import load_script

from petrel.bench import compare, report, workloads
from petrel.bench.contention import Contention

ROOT = Path(__file__).resolve().parent.parent
make_llama_1b = load_script("make_llama_1b")
TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--intermediate", "128"]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama1b")
    # std 0.5: sharp attention, so that a rotary difference (llama3 scaling lost in the GGUF) changes the logprobs
    assert make_llama_1b.main(["--out", str(out), *TINY, "--context", "4096", "--std", "0.5"]) == 0
    return out


def test_builder_defaults_are_the_published_1b_shapes():
    args = make_llama_1b.parse_args(["--out", "x"])
    assert (args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, args.context) == (
        2048,
        16,
        32,
        8,
        8192,
        131072,
    )
    assert make_llama_1b.llama3_rope_scaling(args.context)["original_max_position_embeddings"] == 8192


def test_rope_divisors_are_llama3_scaling_as_petrel_computes_it():
    """The GGUF's rope_freqs (divisors) give the frequencies petrel's llama3 scaling gives for the HF config."""
    import torch

    from petrel.model.layers import rope_inverse_frequencies

    scaling = make_llama_1b.llama3_rope_scaling(131072)
    divisors = make_llama_1b.rope_freq_divisors(64, make_llama_1b.ROPE_THETA, scaling)
    assert divisors.min() == 1.0 and divisors.max() == 32.0 and ((divisors > 1) & (divisors < 32)).any()
    hf = rope_inverse_frequencies(64, make_llama_1b.ROPE_THETA, scaling)
    from_gguf = {"rope_type": "freq_divisors", "divisors": divisors.tolist()}
    gguf = rope_inverse_frequencies(64, make_llama_1b.ROPE_THETA, from_gguf)
    torch.testing.assert_close(gguf, hf, rtol=1e-6, atol=0)


def test_tiny_1b_builder_hf_and_gguf_give_the_same_greedy_tokens(tiny_llama):
    from petrel import LLM, SamplingParams

    config = json.loads((tiny_llama / "fp32" / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["tie_word_embeddings"] is True
    assert json.loads((tiny_llama / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, logprobs=1)
    prompt = np.random.default_rng(0).integers(100, 30000, 300).tolist()  # long enough for the scaled frequencies
    tokens, logprobs = {}, {}
    for name, path in (("hf", tiny_llama / "fp32"), ("gguf", tiny_llama / "llama-1b-f32.gguf")):
        llm = LLM(model=str(path), kv_cache_memory=64 * 2**20)
        try:
            assert llm.config.dtype == "float32"
            out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            tokens[name] = list(out.token_ids)
            logprobs[name] = [d[t].logprob for t, d in zip(out.token_ids, out.logprobs)]
        finally:
            llm.shutdown()
    assert len(tokens["hf"]) == 12 and tokens["hf"] == tokens["gguf"]
    np.testing.assert_allclose(logprobs["gguf"], logprobs["hf"], atol=1e-4)


# ---------------------------------------------------------------------------------------------- W6


SMOLLM2_KV = workloads.kv_bytes_per_token(30, 3, 64, 4)  # the default model at fp32: 46,080 bytes per token


def test_w6_plan_clips_to_the_models_context_and_says_so():
    plan = workloads.w6_plan(49152, 8192, 4 * 2**30, SMOLLM2_KV)
    assert SMOLLM2_KV == 46080
    assert (plan.num_requests, plan.new_tokens) == (4, 256)
    assert plan.prompt_len == 8192 - 256 and plan.long_context == 8192  # the model's context binds, not the budget
    assert any("cut to 7936" in n for n in plan.notes) and any("set by the model's context" in n for n in plan.notes)
    roomy = workloads.w6_plan(128256, 131072, 4 * 2**30, SMOLLM2_KV)
    assert roomy.prompt_len == 8192 and not any("cut" in n for n in roomy.notes)
    # the KV budget binds: whole blocks of 16 tokens that fit 4 GiB
    assert roomy.long_context == 4 * 2**30 // SMOLLM2_KV // 16 * 16 and "set by the KV budget" in roomy.notes[-1]
    small = workloads.w6_plan(49152, 8192, 2**30, SMOLLM2_KV)  # 4 x 8192 tokens need 1.41 GiB
    assert any("will not all run at once" in n for n in small.notes)
    quick = workloads.w6_plan(49152, 8192, 4 * 2**30, SMOLLM2_KV, workloads.QUICK)
    assert (quick.num_requests, quick.prompt_len, quick.long_context) == (2, 512, 1024)
    with pytest.raises(ValueError, match="leaves no room"):
        workloads.w6_plan(49152, 200, 2**30, SMOLLM2_KV)


def test_w6_prompts_are_fixed_lengths_deterministic_and_in_the_vocabulary():
    plan = workloads.w6_plan(49152, 8192, 4 * 2**30, SMOLLM2_KV)
    batch, long = workloads.make_w6_prompts(plan)
    assert [len(p) for p in batch] == [7936] * 4 and len(long) == 8192 - 256
    assert workloads.make_w6_prompts(plan) == (batch, long)  # same seed, same ids
    assert all(100 <= t < 30000 for p in batch + [long] for t in p)
    assert len({tuple(p[:64]) for p in batch}) == 4 and batch[0][:64] != long[:64]
    quick, _ = workloads.make_w6_prompts(workloads.w6_plan(49152, 8192, 2**30, SMOLLM2_KV, workloads.QUICK))
    assert quick == [p[:512] for p in batch[:2]]  # a smaller plan's prompts begin as the full one's
    tiny = workloads.W6Plan(
        vocab_size=50, num_requests=2, prompt_len=300, new_tokens=8, long_prompt_len=40, kv_bytes_per_token=8
    )
    tb, tl = workloads.make_w6_prompts(tiny)
    assert all(0 <= t < 50 for p in tb + [tl] for t in p) and len(set(tb[0])) > 10  # clipped to the vocabulary
    mid, _ = workloads.make_w6_prompts(workloads.W6Plan(1000, 1, 2000, 8, 40, 8))
    assert min(mid[0]) >= 100 and max(mid[0]) < 1000


def test_w6_plan_travels_to_the_peers_as_one_option():
    plan = workloads.w6_plan(49152, 8192, 4 * 2**30, SMOLLM2_KV)
    argv = plan.to_argv()
    assert argv[0] == "--w6-plan"
    again = workloads.W6Plan.from_arg(argv[1])
    assert workloads.make_w6_prompts(again) == workloads.make_w6_prompts(plan)
    with pytest.raises(ValueError, match="six integers"):
        workloads.W6Plan.from_arg("1,2,3")


def test_w6_metrics_ttft_decode_window_and_kv_bandwidth():
    # two requests sent at 0: first tokens at 1.0 and 2.0, then one token per 0.5 s each, 4 tokens each
    a = {"t_send": 0.0, "prompt_len": 100, "times": [1.0, 1.5, 2.0, 2.5]}
    b = {"t_send": 0.0, "prompt_len": 200, "times": [2.0, 2.5, 3.0, 3.5]}
    m = report.w6_metrics([a, b], kv_bytes_per_token=10)
    assert m["ttft_s"] == [1.0, 2.0] and m["new_tokens"] == [4, 4]
    # the window (2.0, 3.5]: a's tokens at 2.5 (context 103), b's at 2.5, 3.0, 3.5 (contexts 201..203)
    assert m["decode_window_s"] == 1.5 and m["decode_tok_s"] == pytest.approx(4 / 1.5)
    assert m["kv_read_gb_s"] == pytest.approx((103 + 201 + 202 + 203) * 10 / 1.5 / 1e9)
    assert report.w6_metrics([a, {**b, "times": []}], 10)["decode_tok_s"] is None  # a request without tokens


# ---------------------------------------------------------------------------------------------- contention


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_contention_starts_busy_processes_and_leaves_none_behind():
    import psutil

    c = Contention(2, prefer_stress_ng=False)
    assert c.tool == "python" and "2 Python busy-loop" in c.describe()
    with pytest.raises(RuntimeError, match="inside"):
        with c:
            pids = c.pids
            assert len(pids) == 2 and all(_alive(p) for p in pids)
            time.sleep(1.0)
            assert all(psutil.Process(p).cpu_times().user > 0.3 for p in pids)  # busy, not sleeping
            raise RuntimeError("an engine failing inside")
    assert c.pids == [] and not any(_alive(p) for p in pids)
    with Contention(0) as off:
        assert off.pids == [] and off.describe() == "off"
    with pytest.raises(ValueError, match="must be >= 0"):
        Contention(-1)


def test_contention_with_stress_ng_when_installed():
    import shutil

    if not shutil.which("stress-ng"):
        pytest.skip("stress-ng is not installed")
    import psutil

    with Contention(1) as c:
        assert c.tool == "stress-ng"
        time.sleep(0.5)
        tree = [psutil.Process(c.pids[0]), *psutil.Process(c.pids[0]).children(recursive=True)]
    assert not any(_alive(p.pid) for p in tree)


# ---------------------------------------------------------------------------------------------- compare


def _compare(argv, tmp_path) -> compare.Compare:
    return compare.Compare(compare.build_parser().parse_args(["--peers-home", str(tmp_path), *argv]))


def _fake_venv(home: Path, engine: str) -> None:
    python = home / f"venv-{engine}" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)


def test_compare_model_options_are_checked(tmp_path, tiny_llama):
    with pytest.raises(SystemExit, match="--gguf goes with --model"):
        _compare(["--gguf", str(tiny_llama / "llama-1b-f32.gguf")], tmp_path)
    with pytest.raises(SystemExit, match="no such file or directory"):
        _compare(["--model", str(tmp_path / "nothing")], tmp_path)
    with pytest.raises(SystemExit, match="--gguf .*: no such file"):
        _compare(["--model", str(tiny_llama / "fp32"), "--gguf", str(tmp_path / "x.gguf")], tmp_path)
    with pytest.raises(SystemExit, match="must be >= 0"):
        compare.main(["--contention", "-1", "--peers-home", str(tmp_path)])
    with pytest.raises(SystemExit):
        compare.main(["--contention", "x", "--peers-home", str(tmp_path)])


def test_compare_hands_each_peer_the_model_in_its_own_form(tmp_path, tiny_llama):
    hf_dir, gguf = str(tiny_llama / "fp32"), str(tiny_llama / "llama-1b-f32.gguf")
    cmp = _compare(["--model", hf_dir], tmp_path)
    assert cmp.skip_reason("hf") is None and cmp.skip_reason("vllm") is None
    assert "no --gguf" in cmp.skip_reason("llamacpp")
    cmp.w1_ids = [1, 2, 3]
    assert cmp.model_argv("hf") == ["--model-dir", hf_dir, "--w1-ids", "1,2,3"]
    assert cmp.model_argv("vllm") == ["--model", hf_dir, "--w1-ids", "1,2,3"]
    assert cmp.petrel_model_argv() == ["--model", hf_dir]
    with_gguf = _compare(["--model", hf_dir, "--gguf", gguf], tmp_path)
    assert with_gguf.skip_reason("llamacpp") is None and with_gguf.model_argv("llamacpp") == ["--gguf", gguf]
    on_gguf = _compare(["--model", gguf], tmp_path)
    assert "GGUF" in on_gguf.skip_reason("vllm") and on_gguf.model_argv("llamacpp") == ["--gguf", gguf]
    default = _compare([], tmp_path)
    assert default.model_argv("hf") == [] and default.petrel_model_argv() == []


def test_compare_runs_petrel_and_vllm_at_the_dtype_asked_for(tmp_path, tiny_llama):
    """--dtype bfloat16: W1's row says bf16, transformers (float32 only) is left out with its reason."""
    cmp = _compare(["--model", str(tiny_llama / "bf16"), "--dtype", "bfloat16"], tmp_path)
    assert cmp.w1_metric == "decode tok/s (bf16)" and cmp.skip_reason("vllm") is None
    assert "float32 only" in cmp.skip_reason("hf")
    assert _compare([], tmp_path).w1_metric == "decode tok/s (fp32)"
    with pytest.raises(SystemExit):
        _compare(["--dtype", "float16"], tmp_path)


def test_compare_leaves_out_a_peer_that_cannot_run_the_model_and_says_why(tmp_path, tiny_llama, capsys):
    _fake_venv(tmp_path, "llamacpp")
    out = tmp_path / "c.json"
    code = compare.main(
        ["--engines", "llamacpp", "--workloads", "w1", "--model", str(tiny_llama / "fp32")]
        + ["--peers-home", str(tmp_path), "--json", str(out)]
    )
    doc = json.loads(out.read_text())
    assert code == 0 and doc["meta"]["engines"] == [] and "no --gguf" in doc["meta"]["skipped"]["llamacpp"]
    assert "llama.cpp needs a GGUF" in capsys.readouterr().err


def test_the_peer_scripts_take_the_new_options():
    import subprocess

    for script in compare.PEER_SCRIPTS.values():
        r = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "peers" / script), "--help"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0 and "w6" in r.stdout and "--w6-plan" in r.stdout and "--w1-ids" in r.stdout, script
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "peers" / "hf_bench.py"), "w6", "--w6-plan", "1,2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "six integers" in r.stderr


@pytest.mark.e2e
def test_compare_w6_with_model_and_contention_runs_petrel_and_a_peer(tmp_path, tiny_llama):
    """`compare --quick --workloads w6 --model DIR --contention 1` with transformers as an installed peer (its
    venv's python is this one): both engines run W6 on the same plan, made from the model's config, under one busy
    process each, and every figure reaches the table."""
    _fake_venv(tmp_path, "hf")
    out = tmp_path / "compare.json"
    hf_dir = str(tiny_llama / "fp32")
    code = compare.main(
        ["--engines", "petrel,hf", "--workloads", "w6", "--quick", "--model", hf_dir, "--contention", "1"]
        + ["--mem-bandwidth", "20", "--peers-home", str(tmp_path), "--json", str(out)]
    )
    doc = json.loads(out.read_text())
    assert code == 0, doc["meta"]["errors"]
    meta = doc["meta"]
    assert meta["model"] == hf_dir and ("1 Python busy-loop" in meta["contention"] or "stress-ng" in meta["contention"])
    plan = meta["w6_plan"]
    assert (plan["num_requests"], plan["prompt_len"], plan["long_prompt_len"] + plan["new_tokens"]) == (2, 512, 1024)
    assert plan["kv_bytes_per_token"] == workloads.kv_bytes_per_token(2, 2, 16, 4)
    petrel_w6 = doc["raw"]["petrel_w6"]["results"][0]
    assert petrel_w6["valid"] and petrel_w6["plan"]["long_prompt_len"] == plan["long_prompt_len"]
    assert doc["raw"]["hf_w6"]["valid"] and doc["raw"]["hf_w6"]["plan"]["prompt_len"] == 512
    rows = {(r["engine"], r["metric"]) for r in doc["rows"] if r["workload"] == "w6"}
    for engine in ("petrel", "hf"):
        assert (engine, "TTFT (2 x 512, request 2)") in rows and (engine, "decode tok/s (long)") in rows
        assert (engine, "decode KV read GB/s (2 x 512)") in rows
    table = "\n".join(doc["table"])
    assert "Contention ON" in table and "W6: long request: 1024 tokens" in table and "petrel / hf" in table


def test_compare_takes_w1s_prompt_from_the_models_chat_template(tmp_path, tiny_llama):
    from petrel.model.loader import resolve_model
    from petrel.model.tokenizer import load_tokenizer

    hf_dir = str(tiny_llama / "fp32")
    cmp = _compare(["--model", hf_dir], tmp_path)
    compare.prepare_model(cmp, ["w1"])
    assert cmp.w1_ids == workloads.w1_prompt_ids(load_tokenizer(resolve_model(hf_dir))) and len(cmp.w1_ids) > 10
    assert cmp.model_argv("hf")[-2:] == ["--w1-ids", ",".join(map(str, cmp.w1_ids))]
    default = _compare([], tmp_path)
    compare.prepare_model(default, ["w1"])
    assert default.w1_ids is None  # the peers' own reference ids


def test_decode_weight_bytes_counts_a_tokens_share_of_the_routed_experts(tmp_path):
    """Every tensor once, a routed expert's by top-k / experts or the share a step reads (the shared experts whole),
    the input embedding by one row unless the head shares it."""
    import json

    import torch
    from safetensors.torch import save_file

    from petrel.bench.flops import decode_weight_bytes

    tensors = {
        "model.embed_tokens.weight": torch.zeros(100, 8),
        "lm_head.weight": torch.zeros(100, 8),
        "model.layers.0.self_attn.q_proj.weight": torch.zeros(8, 8),
        "model.layers.0.mlp.shared_experts.up_proj.weight": torch.zeros(4, 8, dtype=torch.bfloat16),
        **{f"model.layers.0.mlp.experts.{e}.up_proj.weight": torch.zeros(4, 8) for e in range(8)},
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = {"n_routed_experts": 8, "num_experts_per_tok": 2, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    expected = 4 * (8 + 100 * 8 + 64) + 2 * 32 + 2 * 4 * 32
    assert decode_weight_bytes(str(tmp_path)) == expected
    assert decode_weight_bytes(str(tmp_path), expert_share=0.5) == expected + 2 * 4 * 32  # half of them, not 2 of 8
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    assert decode_weight_bytes(str(tmp_path)) == expected + 4 * 99 * 8  # the shared table read whole, as the head
