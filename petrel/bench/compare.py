"""`petrel bench compare`: petrel and every installed peer on W1-W4 in one run, one table of figures and ratios.

    petrel bench compare                          # every installed peer, every workload (about half an hour)
    petrel bench compare --engines petrel,llamacpp --workloads w1
    petrel bench compare --out benchmarks/results/compare.json
    petrel bench compare --quick                  # every workload at smoke-test size: checks the set-up

The peers are the ones `benchmarks/peers/setup_peers.sh` installs under $PEERS_HOME (default ~/petrel-peers), each
in its own virtual environment: transformers (`venv-hf`), vLLM's CPU build (`venv-vllm`) and llama.cpp through
llama-cpp-python (`venv-llamacpp`). A peer that is not installed is left out (and said so). Each engine runs in its
own process, one after the other (the machine has 2 cores); this process samples the summed RSS of each one's
process tree. Peers run W1, W2 and W4 through the scripts in benchmarks/peers (`--peers-dir`), petrel through
`petrel bench`; W3 is `petrel bench serve`'s client against each engine's own server (`petrel serve`, vLLM's
OpenAI server). Every engine does exactly the work of petrel/bench/workloads.py. Figures are float32 unless the
row says; a figure whose engine did not produce the right number of tokens is left out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time

from petrel.bench.processes import Server, free_port, log, run_script
from petrel.bench.report import ratio_table
from petrel.cli_options import parse_choices

WORKLOADS = ("w1", "w2", "w3", "w4", "startup")
ENGINES = ("petrel", "hf", "vllm", "llamacpp")
PEER_SCRIPTS = {"hf": "hf_bench.py", "vllm": "vllm_bench.py", "llamacpp": "llamacpp_bench.py"}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_PEERS_DIR = os.path.join(REPO, "benchmarks", "peers")
KV_GIB = 4  # the same KV budget for petrel and vLLM (VLLM_CPU_KVCACHE_SPACE)
W4_CACHE_NOTE = "of 31 × 1,024 shared-prefix tokens that could be (the first request computes it)"
STARTUP_PROBE = """import json, time
t = time.perf_counter()
from petrel import LLM, SamplingParams
llm = LLM()
llm.generate("Hi", SamplingParams(max_tokens=1), use_tqdm=False)
print("RESULT petrel_startup: " + json.dumps({"first_token_s": time.perf_counter() - t}))
llm.shutdown()
"""


def w3_against(port: int, model: str, quick: bool = False) -> dict:
    """W3 (petrel bench serve's client; with `quick`, its --quick size) against the server on 127.0.0.1:port."""
    from petrel.bench.serve import run_client
    from petrel.bench.workloads import W3_CONCURRENCY, W3_NEW_TOKENS, make_w2_prompts

    log(f"W3 against 127.0.0.1:{port} (model {model!r}), concurrency {W3_CONCURRENCY}")
    prompts, max_tokens = (make_w2_prompts(8, 128), 16) if quick else (make_w2_prompts(), W3_NEW_TOKENS)
    return asyncio.run(run_client(f"http://127.0.0.1:{port}", model, prompts, max_tokens, W3_CONCURRENCY))


class Compare:
    """One compare run: where the peers are, and the rows of figures gathered so far."""

    def __init__(self, args):
        self.args = args
        self.peers_home = os.path.expanduser(args.peers_home)
        self.peers_dir = os.path.abspath(args.peers_dir)
        self.model_dir = os.path.join(self.peers_home, "models", "smollm2-135m-instruct")
        self.gguf = {
            "f32": os.path.join(self.peers_home, "models", "smollm2-135m-instruct-f32.gguf"),
            "q4_1": os.path.join(self.peers_home, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"),
        }
        self.rows: list[dict] = []  # {"workload", "metric", "engine", "value", "unit", "note"}
        self.raw: dict = {}

    def python(self, engine: str) -> str | None:
        path = os.path.join(self.peers_home, f"venv-{engine}", "bin", "python")
        return path if os.path.exists(path) else None

    def installed(self, engine: str) -> bool:
        if engine == "petrel":
            return True
        if self.python(engine) is None:
            return False
        if engine == "llamacpp":
            return os.path.exists(self.gguf["f32"]) or os.path.exists(self.gguf["q4_1"])
        return os.path.exists(os.path.join(self.model_dir, "config.json"))

    def add(self, workload: str, metric: str, engine: str, value, unit: str = "", note: str = "") -> None:
        if value is not None:
            self.rows.append(
                {"workload": workload, "metric": metric, "engine": engine, "value": value, "unit": unit, "note": note}
            )

    def peer_script(self, engine: str, *argv: str, env: dict | None = None):
        """A peer's benchmark script in the peer's own virtual environment: its results and its peak RSS."""
        cmd = [
            self.python(engine),
            os.path.join(self.peers_dir, PEER_SCRIPTS[engine]),
            *argv,
            *(["--quick"] if self.args.quick else []),
        ]
        return run_script(cmd, env={"PEERS_HOME": self.peers_home, **(env or {})})

    def record_w3(self, engine: str, r: dict, note: str = "") -> None:
        expected = r["requests"] * r["max_tokens"]
        note = note + ("" if r["valid"] else f" (only {r['output_tokens']} of {expected} tokens)")
        self.add("w3", "output tok/s", engine, r["output_tok_s"] if r["valid"] else None, "tok/s", note)
        self.add("w3", "TTFT p99", engine, r["ttft_p99_s"], "s", note)
        self.add("w3", "TTFT p50", engine, r["ttft_p50_s"], "s", note)
        self.add("w3", "TPOT p50", engine, r["tpot_p50_s"] * 1000, "ms", note)

    def record_w4(self, engine: str, r: dict, note: str = "") -> None:
        """A peer's W4: its wall time, and the prompt tokens its prefix cache served where it has one."""
        self.add("w4", "wall", engine, r["wall_s"] if r["valid"] else None, "s", note)
        self.add("w4", "prompt tokens from cache", engine, r.get("cached_prompt_tokens"), "tokens", note)

    # ---- petrel
    def petrel_bench(self, workloads: str, *options: str) -> tuple[dict, float]:
        """`petrel bench --engines petrel` in its own process: its result document and the process's peak RSS."""
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "petrel.json")
            _, peak = run_script(
                [
                    sys.executable,
                    "-m",
                    "petrel.bench",
                    "--engines",
                    "petrel",
                    "--workloads",
                    workloads,
                    *options,
                    *(["--quick"] if self.args.quick else []),
                    "--json",
                    out,
                ]
            )
            with open(out) as f:
                return json.load(f), peak

    def petrel(self, workloads: list[str]) -> None:
        batch = [w for w in ("w1", "w2") if w in workloads]
        if batch:
            doc, peak = self.petrel_bench(",".join(batch), "--kv-cache-memory", f"{KV_GIB}G")
            self.raw["petrel_w1w2"] = doc
            for r in doc["results"]:
                self._petrel_result(r)
            if "w2" in batch:
                self.add("w2", "peak RSS (w1+w2 process)", "petrel", peak, "MiB", f"KV {KV_GIB} GiB")
        if "w1" in workloads:  # the GGUF's own Q4_1 blocks kept quantized: the same weights as llama.cpp's Q4_1 run
            r = self.petrel_bench("w1", "--quantization", "gguf")[0]["results"][0]
            self.raw["petrel_w1_gguf"] = r
            self.add(
                "w1",
                "decode tok/s (Q4_1)",
                "petrel",
                r["decode_tok_s"] if r["valid"] else None,
                "tok/s",
                "quantization='gguf'",
            )
        if "w4" in workloads:
            for caching in (True, False):
                doc = self.petrel_bench("w4", *([] if caching else ["--no-prefix-caching"]))[0]
                self.raw[f"petrel_w4_{'cache' if caching else 'nocache'}"] = doc
                r = doc["results"][0]
                tag = "" if caching else " (prefix caching off)"
                self.add("w4", "wall" + tag, "petrel", r["wall_s"] if r["valid"] else None, "s")
                if caching:
                    self.add(
                        "w4",
                        "prompt tokens from cache",
                        "petrel",
                        r["cached_prompt_tokens"],
                        "tokens",
                        "" if self.args.quick else W4_CACHE_NOTE,
                    )
        if "w3" in workloads:
            port = free_port()
            server = Server(
                [
                    sys.executable,
                    "-m",
                    "petrel.cli",
                    "serve",
                    "--port",
                    str(port),
                    "--log-level",
                    "warning",
                    "--served-model-name",
                    "petrel",
                ],
                port,
            )
            try:
                r = w3_against(port, "petrel", self.args.quick)
            finally:
                peak = server.close()
            self.raw["petrel_w3"] = r
            self.record_w3("petrel", r)
            self.add("w3", "peak RSS (server)", "petrel", peak, "MiB")
        if "startup" in workloads:
            results, _ = run_script([sys.executable, "-c", STARTUP_PROBE])
            self.add("startup", "LLM() to first token", "petrel", results[0]["first_token_s"], "s")
            port = free_port()
            server = Server(
                [sys.executable, "-m", "petrel.cli", "serve", "--port", str(port), "--log-level", "warning"], port
            )
            server.close()
            self.add("startup", "server to /health 200", "petrel", server.ready_s, "s")

    def _petrel_result(self, r: dict) -> None:
        if r["workload"] == "w1":
            self.add("w1", "decode tok/s (fp32)", "petrel", r["decode_tok_s"] if r["valid"] else None, "tok/s")
            self.add("w1", "TTFT", "petrel", r["ttft_s"] * 1000, "ms")
        else:
            self.add("w2", "output tok/s", "petrel", r["output_tok_s"] if r["valid"] else None, "tok/s")
            self.add("w2", "wall", "petrel", r["wall_s"], "s")

    # ---- transformers
    def hf(self, workloads: list[str]) -> None:
        if "w1" in workloads:
            r = self.peer_script("hf", "w1", "--tag", "compare")[0][-1]
            self.raw["hf_w1"] = r
            self.add("w1", "decode tok/s (fp32)", "hf", r["median_decode_tok_s"] if r["valid"] else None, "tok/s")
            self.add("w1", "TTFT", "hf", r["median_ttft_s"] * 1000, "ms")
        if "w2" in workloads:
            r = self.peer_script("hf", "w2", "--batch-size", "16", "--tag", "compare")[0][-1]
            self.raw["hf_w2"] = r
            self.add(
                "w2",
                "output tok/s",
                "hf",
                r["output_tok_s"] if r["valid"] else None,
                "tok/s",
                "bs 16, length-sorted, left-padded",
            )
            self.add("w2", "wall", "hf", r["wall_s"], "s")
        if "w4" in workloads:
            r = self.peer_script("hf", "w4", "--batch-size", "16", "--tag", "compare")[0][-1]
            self.raw["hf_w4"] = r
            self.record_w4("hf", r, "no prefix cache: bs 16, left-padded")

    # ---- vLLM (CPU build)
    def vllm_env(self) -> dict:
        return {"VLLM_CPU_KVCACHE_SPACE": str(KV_GIB), "VLLM_CPU_OMP_THREADS_BIND": "0-1"}

    def vllm(self, workloads: list[str]) -> None:
        batch = [w for w in ("w1", "w2") if w in workloads]
        if batch:
            which = "both" if len(batch) == 2 else batch[0]
            results, peak = self.peer_script(
                "vllm", which, "--dtype", "float32", "--tag", "compare", env=self.vllm_env()
            )
            for r in results:
                self.raw[r["name"]] = r
                if r["workload"] == "w1":
                    self.add(
                        "w1", "decode tok/s (fp32)", "vllm", r["median_decode_tok_s"] if r["valid"] else None, "tok/s"
                    )
                    self.add("w1", "TTFT", "vllm", r["median_ttft_s"] * 1000, "ms")
                else:
                    self.add("w2", "output tok/s", "vllm", r["output_tok_s"] if r["valid"] else None, "tok/s")
                    self.add("w2", "wall", "vllm", r["wall_s"], "s")
                self.add("startup", "LLM() init (offline engine)", "vllm", r.get("init_s"), "s")
            if "w2" in batch:
                self.add("w2", "peak RSS (w1+w2 process)", "vllm", peak, "MiB", f"KV {KV_GIB} GiB")
        if "w4" in workloads:  # its own process: prefix caching on (the W1 runs above need it off)
            r = self.peer_script("vllm", "w4", "--dtype", "float32", "--tag", "compare", env=self.vllm_env())[0][-1]
            self.raw["vllm_w4"] = r
            self.record_w4("vllm", r, "prefix caching on")
        if "w3" in workloads or "startup" in workloads:
            port = free_port()
            server = Server(
                [
                    self.python("vllm"),
                    "-m",
                    "vllm.entrypoints.openai.api_server",
                    "--model",
                    self.model_dir,
                    "--dtype",
                    "float32",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--served-model-name",
                    "vllm",
                ],
                port,
                env=self.vllm_env(),
            )
            self.add("startup", "server to /health 200", "vllm", server.ready_s, "s")
            try:
                if "w3" in workloads:
                    r = w3_against(port, "vllm", self.args.quick)
                    self.raw["vllm_w3"] = r
                    self.record_w3("vllm", r)
            finally:
                peak = server.close()
            if "w3" in workloads:
                self.add("w3", "peak RSS (server)", "vllm", peak, "MiB")

    # ---- llama.cpp
    def llamacpp(self, workloads: list[str]) -> None:
        if "w1" in workloads:
            for tag, metric in (("f32", "decode tok/s (fp32)"), ("q4_1", "decode tok/s (Q4_1)")):
                if not os.path.exists(self.gguf[tag]):
                    continue
                r = self.peer_script("llamacpp", "w1", "--gguf", self.gguf[tag], "--tag", f"compare_{tag}")[0][-1]
                self.raw[f"llamacpp_w1_{tag}"] = r
                self.add("w1", metric, "llamacpp", r["median_decode_tok_s"] if r["valid"] else None, "tok/s")
                if tag == "f32":
                    self.add("w1", "TTFT", "llamacpp", r["median_ttft_s"] * 1000, "ms", "F32 GGUF")
                    self.add("startup", "model load", "llamacpp", r.get("load_s"), "s")
        gguf = self.gguf["f32"] if os.path.exists(self.gguf["f32"]) else self.gguf["q4_1"]
        if "w2" in workloads and self.args.llamacpp_w2:
            r = self.peer_script("llamacpp", "w2", "--gguf", gguf, "--tag", "compare")[0][-1]
            self.raw["llamacpp_w2"] = r
            self.add(
                "w2",
                "output tok/s",
                "llamacpp",
                r["output_tok_s"] if r["valid"] else None,
                "tok/s",
                f"{os.path.basename(gguf)}, 64 sequential requests (no batching in its Python API)",
            )
            self.add("w2", "wall", "llamacpp", r["wall_s"], "s")
        if "w4" in workloads:
            r = self.peer_script("llamacpp", "w4", "--gguf", gguf, "--tag", "compare")[0][-1]
            self.raw["llamacpp_w4"] = r
            self.record_w4(
                "llamacpp",
                r,
                f"{os.path.basename(gguf)}, 32 sequential requests, each reusing the "
                "previous one's KV for the prefix they share",
            )


def run(args) -> dict:
    """The whole comparison for parsed options; returns the result document (its "table" is the markdown)."""
    from petrel.bench.flops import matmul_peak_gflops, w2_matmul_flops

    workloads = parse_choices(args.workloads, WORKLOADS, "workload")
    engines = parse_choices(args.engines, ENGINES, "engine")
    cmp = Compare(args)
    missing = [e for e in engines if not cmp.installed(e)]
    for e in missing:
        log(f"{e}: not installed under {cmp.peers_home} (run benchmarks/peers/setup_peers.sh); left out")
    engines = [e for e in engines if e not in missing]
    for engine in engines:
        script = os.path.join(cmp.peers_dir, PEER_SCRIPTS.get(engine, ""))
        if engine != "petrel" and not os.path.exists(script):
            raise SystemExit(f"no {engine} script at {script} (--peers-dir)")
    peak = matmul_peak_gflops()
    log(f"fp32 matmul peak (torch, 2 threads, 2048²): {peak:.1f} GFLOP/s")
    errors = {}
    for engine in engines:
        try:
            getattr(cmp, engine)(workloads)
        except Exception as e:  # noqa: BLE001 - one engine failing leaves the others' figures
            errors[engine] = repr(e)
            log(f"{engine} FAILED: {e!r}")
    flops = w2_matmul_flops() if "w2" in workloads and not args.quick else None  # the full W2's arithmetic
    if flops is not None:
        for r in [r for r in cmp.rows if r["workload"] == "w2" and r["metric"] == "wall"]:
            achieved = flops / r["value"] / 1e9
            cmp.add(
                "w2",
                "matmul GFLOP/s (share of peak)",
                r["engine"],
                achieved,
                "GFLOP/s",
                f"{100 * achieved / peak:.0f}% of {peak:.0f}",
            )
    return {
        "meta": {
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "quick": bool(args.quick),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "matmul_peak_gflops": peak,
            "engines": engines,
            "missing": missing,
            "workloads": workloads,
            "errors": errors,
            "w2_matmul_tflop": flops / 1e12 if flops is not None else None,
        },
        "rows": cmp.rows,
        "raw": cmp.raw,
        "table": ratio_table(cmp.rows, engines),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="petrel bench compare",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--engines", default=",".join(ENGINES), help=f"from {','.join(ENGINES)} (default: all installed)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"from {','.join(WORKLOADS)} (default: all)")
    p.add_argument(
        "--peers-home",
        default=os.environ.get("PEERS_HOME", "~/petrel-peers"),
        help="where setup_peers.sh installed the peers (default: $PEERS_HOME, else ~/petrel-peers)",
    )
    p.add_argument(
        "--peers-dir",
        default=os.environ.get("PETREL_PEERS_DIR", DEFAULT_PEERS_DIR),
        help="the directory of the peers' scripts (default: $PETREL_PEERS_DIR, else this checkout's benchmarks/peers)",
    )
    p.add_argument(
        "--llamacpp-w2", action="store_true", help="also run W2 on llama.cpp (64 sequential requests: about 5 minutes)"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="every workload at its smoke-test size (`petrel bench --quick`): checks a set-up in minutes; "
        "the figures do not compare with full runs",
    )
    p.add_argument("--json", "--out", dest="out", default=None, metavar="FILE.json")
    return p


def main(argv: list[str] | None = None) -> int:
    """`petrel bench compare [options]`: prints the table; 1 when an engine failed, else 0."""
    args = build_parser().parse_args(argv)
    doc = run(args)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        log(f"saved {args.out}")
    print("\n".join(doc["table"]))
    return 1 if doc["meta"]["errors"] else 0
