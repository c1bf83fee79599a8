"""`petrel bench compare`: petrel and every installed peer on W1-W4 in one run, one table of figures and ratios.

    petrel bench compare                          # every installed peer, every workload (about half an hour)
    petrel bench compare --engines petrel,llamacpp --workloads w1
    petrel bench compare --out benchmarks/results/compare.json
    petrel bench compare --quick                  # every workload at smoke-test size: checks the set-up
    petrel bench compare --model DIR_OR_GGUF [--gguf FILE.gguf] --workloads w1,w2 [--w2-requests 16]
    petrel bench compare --workloads w6           # long contexts (W6), every engine
    petrel bench compare --contention 1           # a competing CPU-bound process during each engine's run
    petrel bench compare --engines petrel,vllm --workloads w2 --rounds 3   # the engines in turn, three times

The peers are the ones `benchmarks/peers/setup_peers.sh` installs under $PEERS_HOME (default ~/petrel-peers), each
in its own virtual environment: transformers (`venv-hf`), vLLM's CPU build (`venv-vllm`) and llama.cpp through
llama-cpp-python (`venv-llamacpp`). A peer that is not installed is left out (and said so). Each engine runs in its
own process, one after the other (the machine has 2 cores); this process samples the summed RSS of each one's
process tree. Peers run W1, W2 and W4 through the scripts in benchmarks/peers (`--peers-dir`), petrel through
`petrel bench`; W3 is `petrel bench serve`'s client against each engine's own server: `petrel serve` (float32
and, on the default model, the Q4_1 GGUF kept quantized), vLLM's OpenAI server, and llama.cpp's own C++ server
with 16 slots on the F32 and Q4_1 GGUFs (`llama-server` on PATH, or built by `setup_peers.sh llamaserver`;
llama-cpp-python's server runs one request at a time). Every engine does exactly the work of
petrel/bench/workloads.py. Figures are float32 unless the row says; a figure whose engine did not produce the right
number of tokens is left out.

--model PATH (any Hugging Face directory or GGUF file petrel loads) runs every engine on that model instead of the
default one: petrel on PATH; transformers on PATH; vLLM on PATH when it is a Hugging Face directory (a GGUF: left
out, said so); llama.cpp on PATH when it is a GGUF, else on --gguf FILE (neither: left out, said so). The W1 prompt
is then the chat template of PATH's tokenizer (as petrel applies it), handed to each peer as token ids.
W6's plan (workloads.w6_plan: prompt lengths, the long request's context) is made here from the model's config and
the KV budget, stated in the output, and handed to every engine. --contention N keeps N CPU-bound processes busy
(stress-ng --cpu N if installed, else Python busy loops; petrel/bench/contention.py) during each engine's run.

--rounds N runs the engines in turn N times, every other round in the reverse order (A B, B A, A B, ...), so that
a drift in the machine's speed over the run (this shared machine's memory rate moves by a third within minutes)
meets every engine alike: the table gives each engine's median over the rounds and, as the ratio, the median of the
rounds' own ratios with their range; the rows keep each round's figure ("round") and "raw" each round's results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import time

from petrel.bench.contention import Contention
from petrel.bench.processes import Server, free_port, log, run_script
from petrel.bench.report import ratio_table
from petrel.cli_options import parse_choices

WORKLOADS = ("w1", "w2", "w3", "w4", "w6", "startup")
ENGINES = ("petrel", "hf", "vllm", "llamacpp")
PEER_SCRIPTS = {"hf": "hf_bench.py", "vllm": "vllm_bench.py", "llamacpp": "llamacpp_bench.py"}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_PEERS_DIR = os.path.join(REPO, "benchmarks", "peers")
KV_GIB = 4  # the same KV budget for petrel and vLLM (VLLM_CPU_KVCACHE_SPACE)
W4_CACHE_NOTE = "of 31 × 1,024 shared-prefix tokens that could be (the first request computes it)"
STARTUP_PROBE = """import json, sys, time
t = time.perf_counter()
from petrel import LLM, SamplingParams
llm = LLM(model=sys.argv[1] if len(sys.argv) > 1 else None)
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
        self.rows: list[dict] = []  # {"workload", "metric", "engine", "value", "unit", "note", "round"}
        self.raw: dict = {}  # this round's results by name
        self.round = 0  # the round being run (--rounds)
        self.model = os.path.abspath(os.path.expanduser(args.model)) if args.model else None
        self.model_is_gguf = bool(self.model) and self.model.endswith(".gguf")
        if args.gguf and not args.model:
            raise SystemExit("--gguf goes with --model (the default model's GGUFs are the peers' own)")
        if self.model and not os.path.exists(self.model):
            raise SystemExit(f"--model {args.model}: no such file or directory")
        if args.gguf and not os.path.isfile(args.gguf):
            raise SystemExit(f"--gguf {args.gguf}: no such file")
        self.w1_ids: list[int] | None = None  # --model's W1 prompt (None: the peers' reference ids)
        self.w6 = None  # W6's plan (workloads.W6Plan), made in run() when W6 is asked for
        self.mem_gb_s: float | None = None

    def llamacpp_gguf(self) -> str | None:
        """--model's GGUF for llama.cpp: the model itself, else --gguf, else None (llama.cpp is left out)."""
        if self.model_is_gguf:
            return self.model
        return os.path.abspath(self.args.gguf) if self.args.gguf else None

    @property
    def w1_metric(self) -> str:
        """W1's row: decode tok/s at --dtype ("fp32", "bf16"), or petrel's --quantization where one is given."""
        held = self.args.quantization
        return f"decode tok/s ({DTYPE_LABELS[self.args.dtype] if held is None else 'petrel ' + held})"

    def petrel_quantization_argv(self) -> list[str]:
        """--quantization for each of petrel's runs (none given: [])."""
        return [] if self.args.quantization is None else ["--quantization", self.args.quantization]

    def skip_reason(self, engine: str) -> str | None:
        """Why an installed engine cannot run --model at --dtype (None: it can)."""
        if engine == "hf" and self.args.dtype != "float32":
            return "the transformers peer runs float32 only"
        if not self.model:
            return None
        if engine == "vllm" and self.model_is_gguf:
            return "--model is a GGUF file; vLLM runs Hugging Face directories here"
        if engine == "llamacpp" and self.llamacpp_gguf() is None:
            return "--model is a Hugging Face directory and no --gguf was given; llama.cpp needs a GGUF"
        return None

    def model_argv(self, engine: str) -> list[str]:
        """The model options of a peer script: --model's path in the form it takes, and W1's prompt ids."""
        if not self.model:
            return []
        path = {"hf": ["--model-dir", self.model], "vllm": ["--model", self.model]}.get(engine)
        if engine == "llamacpp":
            path = ["--gguf", self.llamacpp_gguf()]
        return path + (["--w1-ids", ",".join(map(str, self.w1_ids))] if self.w1_ids is not None else [])

    def petrel_model_argv(self) -> list[str]:
        return ["--model", self.model] if self.model else []

    def python(self, engine: str) -> str | None:
        path = os.path.join(self.peers_home, f"venv-{engine}", "bin", "python")
        return path if os.path.exists(path) else None

    def installed(self, engine: str) -> bool:
        if engine == "petrel":
            return True
        if self.python(engine) is None:
            return False
        if self.model:  # the peers' own copies of the default model are not needed
            return True
        if engine == "llamacpp":
            return os.path.exists(self.gguf["f32"]) or os.path.exists(self.gguf["q4_1"])
        return os.path.exists(os.path.join(self.model_dir, "config.json"))

    def add(self, workload: str, metric: str, engine: str, value, unit: str = "", note: str = "") -> None:
        if value is not None:
            self.rows.append(
                {
                    "workload": workload,
                    "metric": metric,
                    "engine": engine,
                    "value": value,
                    "unit": unit,
                    "note": note,
                    "round": self.round,
                }
            )

    def peer_script(self, engine: str, *argv: str, env: dict | None = None):
        """A peer's benchmark script in the peer's own virtual environment: its results and its peak RSS."""
        cmd = [
            self.python(engine),
            os.path.join(self.peers_dir, PEER_SCRIPTS[engine]),
            *argv,
            *self.model_argv(engine),
            *self.size_argv("--runs"),
        ]
        return run_script(cmd, env={"PEERS_HOME": self.peers_home, **(env or {})})

    def size_argv(self, runs_option: str) -> list[str]:
        """--quick, --w1-runs and --w2-requests as the engine's script takes them (peers call the first --runs)."""
        argv = ["--quick"] if self.args.quick else []
        if self.args.w1_runs is not None:
            argv += [runs_option, str(self.args.w1_runs)]
        if self.args.w2_requests is not None:
            argv += ["--w2-requests", str(self.args.w2_requests)]
        return argv

    def record_w3(self, engine: str, r: dict, note: str = "", label: str = "") -> None:
        """W3's rows; `label` names the weights' kind in each metric (" (Q4_1)"), empty for float32."""
        expected = r["requests"] * r["max_tokens"]
        note = note + ("" if r["valid"] else f" (only {r['output_tokens']} of {expected} tokens)")
        self.add("w3", "output tok/s" + label, engine, r["output_tok_s"] if r["valid"] else None, "tok/s", note)
        self.add("w3", "TTFT p99" + label, engine, r["ttft_p99_s"], "s", note)
        self.add("w3", "TTFT p50" + label, engine, r["ttft_p50_s"], "s", note)
        self.add("w3", "TPOT p50" + label, engine, r["tpot_p50_s"] * 1000, "ms", note)

    def w3_server(self, engine: str, cmd: list[str], port: int, raw_key: str, note: str, label: str) -> None:
        """W3 against the server `cmd` starts on `port` (its model named `engine`): its result under raw[raw_key],
        its rows and its peak RSS recorded (record_w3's note and label)."""
        server = Server(cmd, port)
        try:
            r = w3_against(port, engine, self.args.quick)
        finally:
            peak = server.close()
        self.raw[raw_key] = r
        self.record_w3(engine, r, note, label)
        self.add("w3", "peak RSS (server)" + label, engine, peak, "MiB")

    def w6_argv(self) -> list[str]:
        return ["w6", *self.w6.to_argv(), "--tag", "compare"]

    def record_w6(self, engine: str, r: dict, note: str = "") -> None:
        """W6's rows: TTFT per request, decode tok/s and the KV read bandwidth (and its share of the machine's)."""
        plan = r.get("plan") or {}
        if plan and (plan.get("prompt_len"), plan.get("long_prompt_len")) != (
            self.w6.prompt_len,
            self.w6.long_prompt_len,
        ):
            note += f" (ran a different plan: {plan.get('prompt_len')} / {plan.get('long_prompt_len')} tokens)"
        ok = r.get("valid", not r.get("problems"))
        for key, label in (("batch", f"{self.w6.num_requests} x {self.w6.prompt_len}"), ("long", "long")):
            m = r[key]
            for i, ttft in enumerate(m["ttft_s"]):
                name = f"TTFT ({label}" + (f", request {i + 1})" if key == "batch" else f" {m['prompt_tokens'][0]})")
                self.add("w6", name, engine, ttft, "s", note)
            self.add("w6", f"decode tok/s ({label})", engine, m["decode_tok_s"] if ok else None, "tok/s", note)
            bw = m["kv_read_gb_s"] if ok else None
            share = f"{100 * bw / self.mem_gb_s:.0f}% of {self.mem_gb_s:.1f} GB/s" if bw and self.mem_gb_s else ""
            self.add("w6", f"decode KV read GB/s ({label})", engine, bw, "GB/s", (note + " " + share).strip())

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
                    *self.petrel_model_argv(),
                    "--dtype",
                    self.args.dtype,
                    *self.petrel_quantization_argv(),
                    *options,
                    *self.size_argv("--w1-runs"),
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
        if "w6" in workloads:
            options = ["--kv-cache-memory", f"{KV_GIB}G", "--mem-bandwidth", str(self.mem_gb_s)]
            doc = self.petrel_bench("w6", *options)[0]
            self.raw["petrel_w6"] = doc
            self.record_w6("petrel", doc["results"][0])
        if "w1" in workloads and not self.model and self.args.quantization is None:
            # the GGUF's Q4_1 blocks kept quantized: llama.cpp's Q4_1 weights
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
        # W3 in float32, and (the default model) with the GGUF's Q4_1 blocks kept quantized, as llama-server runs it
        extra = not self.model and self.args.quantization is None
        w3_runs = (("", self.petrel_quantization_argv()), *((" (Q4_1)", ["--quantization", "gguf"]),) * extra)
        for label, quantization in w3_runs if "w3" in workloads else ():
            port = free_port()
            serve = [sys.executable, "-m", "petrel.cli", "serve", "--port", str(port), "--log-level", "warning"]
            serve += ["--served-model-name", "petrel", *self.petrel_model_argv(), "--dtype", self.args.dtype]
            serve += quantization
            raw_key = "petrel_w3" + (f"_{quantization[1]}" if quantization else "")
            note = f"quantization={quantization[1]!r}" if quantization else ""
            self.w3_server("petrel", serve, port, raw_key, note, label)
        if "startup" in workloads:
            results, _ = run_script([sys.executable, "-c", STARTUP_PROBE, *([self.model] if self.model else [])])
            self.add("startup", "LLM() to first token", "petrel", results[0]["first_token_s"], "s")
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
                    *self.petrel_model_argv(),
                    "--dtype",
                    self.args.dtype,
                    *self.petrel_quantization_argv(),
                ],
                port,
            )
            server.close()
            self.add("startup", "server to /health 200", "petrel", server.ready_s, "s")

    def _petrel_result(self, r: dict) -> None:
        if r["workload"] == "w1":
            self.add("w1", self.w1_metric, "petrel", r["decode_tok_s"] if r["valid"] else None, "tok/s")
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
        if "w6" in workloads:
            r = self.peer_script("hf", *self.w6_argv())[0][-1]
            self.raw["hf_w6"] = r
            self.record_w6("hf", r, "requests one at a time")

    # ---- vLLM (CPU build)
    def vllm_env(self) -> dict:
        return {"VLLM_CPU_KVCACHE_SPACE": str(KV_GIB), "VLLM_CPU_OMP_THREADS_BIND": "0-1"}

    def vllm(self, workloads: list[str]) -> None:
        batch = [w for w in ("w1", "w2") if w in workloads]
        if batch:
            which = "both" if len(batch) == 2 else batch[0]
            results, peak = self.peer_script(
                "vllm", which, "--dtype", self.args.dtype, "--tag", "compare", env=self.vllm_env()
            )
            for r in results:
                self.raw[r["name"]] = r
                if r["workload"] == "w1":
                    self.add("w1", self.w1_metric, "vllm", r["median_decode_tok_s"] if r["valid"] else None, "tok/s")
                    self.add("w1", "TTFT", "vllm", r["median_ttft_s"] * 1000, "ms")
                else:
                    self.add("w2", "output tok/s", "vllm", r["output_tok_s"] if r["valid"] else None, "tok/s")
                    self.add("w2", "wall", "vllm", r["wall_s"], "s")
                self.add("startup", "LLM() init (offline engine)", "vllm", r.get("init_s"), "s")
            if "w2" in batch:
                self.add("w2", "peak RSS (w1+w2 process)", "vllm", peak, "MiB", f"KV {KV_GIB} GiB")
        if "w4" in workloads:  # its own process: prefix caching on (the W1 runs above need it off)
            results, _ = self.peer_script(
                "vllm", "w4", "--dtype", self.args.dtype, "--tag", "compare", env=self.vllm_env()
            )
            r = results[-1]
            self.raw["vllm_w4"] = r
            self.record_w4("vllm", r, "prefix caching on")
        if "w6" in workloads:
            r = self.peer_script("vllm", *self.w6_argv(), "--dtype", self.args.dtype, env=self.vllm_env())[0][-1]
            self.raw["vllm_w6"] = r
            self.record_w6("vllm", r)
        if "w3" in workloads or "startup" in workloads:
            port = free_port()
            server = Server(
                [
                    self.python("vllm"),
                    "-m",
                    "vllm.entrypoints.openai.api_server",
                    "--model",
                    self.model or self.model_dir,
                    "--dtype",
                    self.args.dtype,
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
    def llama_server(self) -> str | None:
        """llama.cpp's own C++ server: `llama-server` on PATH, else the one `setup_peers.sh llamaserver` builds."""
        built = os.path.join(self.peers_home, "llama-server-build", "bin", "llama-server")
        return shutil.which("llama-server") or (built if os.access(built, os.X_OK) else None)

    def llamacpp_w3(self) -> None:
        """W3 against llama-server with W3's concurrency in slots (llama-cpp-python's server runs one request at a
        time), on the F32 and the Q4_1 GGUF (--model: its GGUF)."""
        binary = self.llama_server()
        if binary is None:
            log("llama.cpp's W3 left out: no llama-server on PATH or in $PEERS_HOME/llama-server-build/bin")
            return
        from petrel.bench.workloads import W3_CONCURRENCY

        ggufs = (
            (("model", "", self.llamacpp_gguf()),)
            if self.model
            else (("f32", "", self.gguf["f32"]), ("q4_1", " (Q4_1)", self.gguf["q4_1"]))
        )
        for tag, label, gguf in ggufs:
            if not gguf or not os.path.exists(gguf):
                continue
            port = free_port()
            serve = [
                binary,
                *("--model", gguf, "--alias", "llamacpp", "--host", "127.0.0.1", "--port", str(port)),
                *("--threads", str(os.cpu_count() or 1), "--parallel", str(W3_CONCURRENCY)),
                *("--ctx-size", str(W3_CONCURRENCY * 1024)),  # per slot: W2's longest prompt (512) + 128 new
            ]
            note = f"llama-server, {os.path.basename(gguf)}, {W3_CONCURRENCY} slots"
            self.w3_server("llamacpp", serve, port, f"llamacpp_w3_{tag}", note, label)

    def llamacpp(self, workloads: list[str]) -> None:
        # --model: its own GGUF (peer_script adds --gguf), its figures in the fp32 row whatever its type (said so)
        ggufs = (
            (("model", self.w1_metric),)
            if self.model
            else (
                ("f32", "decode tok/s (fp32)"),
                ("q4_1", "decode tok/s (Q4_1)"),
            )
        )
        if "w1" in workloads:
            for tag, metric in ggufs:
                if tag != "model" and not os.path.exists(self.gguf[tag]):
                    continue
                given = [] if tag == "model" else ["--gguf", self.gguf[tag]]
                r = self.peer_script("llamacpp", "w1", *given, "--tag", f"compare_{tag}")[0][-1]
                self.raw[f"llamacpp_w1_{tag}"] = r
                self.add("w1", metric, "llamacpp", r["median_decode_tok_s"] if r["valid"] else None, "tok/s")
                if tag in ("f32", "model"):
                    gguf_note = "F32 GGUF" if tag == "f32" else os.path.basename(self.llamacpp_gguf())
                    self.add("w1", "TTFT", "llamacpp", r["median_ttft_s"] * 1000, "ms", gguf_note)
                    self.add("startup", "model load", "llamacpp", r.get("load_s"), "s")
        gguf = self.gguf["f32"] if os.path.exists(self.gguf["f32"]) else self.gguf["q4_1"]
        given = [] if self.model else ["--gguf", gguf]  # --model: peer_script adds its GGUF
        gguf = self.llamacpp_gguf() if self.model else gguf
        if "w2" in workloads and self.args.llamacpp_w2:
            r = self.peer_script("llamacpp", "w2", *given, "--tag", "compare")[0][-1]
            self.raw["llamacpp_w2"] = r
            self.add(
                "w2",
                "output tok/s",
                "llamacpp",
                r["output_tok_s"] if r["valid"] else None,
                "tok/s",
                f"{os.path.basename(gguf)}, {r['num_requests']} sequential requests (no batching in its Python API)",
            )
            self.add("w2", "wall", "llamacpp", r["wall_s"], "s")
        if "w6" in workloads:
            r = self.peer_script("llamacpp", *self.w6_argv(), *given)[0][-1]
            self.raw["llamacpp_w6"] = r
            self.record_w6("llamacpp", r, f"{os.path.basename(gguf)}, requests one at a time")
        if "w3" in workloads:
            self.llamacpp_w3()
        if "w4" in workloads:
            r = self.peer_script("llamacpp", "w4", *given, "--tag", "compare")[0][-1]
            self.raw["llamacpp_w4"] = r
            self.record_w4(
                "llamacpp",
                r,
                f"{os.path.basename(gguf)}, 32 sequential requests, each reusing the "
                "previous one's KV for the prefix they share",
            )


DTYPE_LABELS = {"float32": "fp32", "bfloat16": "bf16"}


def run(args) -> dict:
    """The whole comparison for parsed options; returns the result document (its "table" is the markdown)."""
    from petrel.bench.flops import matmul_peak_gflops, w2_matmul_flops

    workloads = parse_choices(args.workloads, WORKLOADS, "workload")
    engines = parse_choices(args.engines, ENGINES, "engine")
    if args.contention < 0:
        raise SystemExit(f"--contention {args.contention}: the number of competing processes must be >= 0")
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: the number of rounds must be >= 1")
    cmp = Compare(args)
    missing = [e for e in engines if not cmp.installed(e)]
    for e in missing:
        log(f"{e}: not installed under {cmp.peers_home} (run benchmarks/peers/setup_peers.sh); left out")
    skipped = {e: cmp.skip_reason(e) for e in engines if e not in missing and cmp.skip_reason(e)}
    for e, why in skipped.items():
        log(f"{e}: left out: {why}")
    engines = [e for e in engines if e not in missing and e not in skipped]
    prepare_model(cmp, workloads)
    contention = Contention(args.contention)
    if args.contention:
        log(f"contention: {contention.describe()}")
    for engine in engines:
        script = os.path.join(cmp.peers_dir, PEER_SCRIPTS.get(engine, ""))
        if engine != "petrel" and not os.path.exists(script):
            raise SystemExit(f"no {engine} script at {script} (--peers-dir)")
    peak = matmul_peak_gflops()
    log(f"fp32 matmul peak (torch, 2 threads, 2048²): {peak:.1f} GFLOP/s")
    errors, raws = {}, []
    for cmp.round in range(args.rounds):
        cmp.raw = {}
        if args.rounds > 1:
            log(f"round {cmp.round + 1} of {args.rounds}")
        for engine in engines if cmp.round % 2 == 0 else engines[::-1]:
            try:
                with contention:
                    getattr(cmp, engine)(workloads)
            except Exception as e:  # noqa: BLE001 - one engine failing leaves the others' figures
                errors[engine if args.rounds == 1 else f"{engine} (round {cmp.round + 1})"] = repr(e)
                log(f"{engine} FAILED: {e!r}")
        raws.append(cmp.raw)
    # the full W2's arithmetic (its first --w2-requests prompts) on the compared model
    flops = w2_matmul_flops(args.model, args.w2_requests) if "w2" in workloads and not args.quick else None
    if flops is not None:
        for r in [r for r in cmp.rows if r["workload"] == "w2" and r["metric"] == "wall"]:
            achieved = flops / r["value"] / 1e9
            cmp.round = r["round"]
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
            "skipped": skipped,
            "model": cmp.model or "default (SmolLM2-135M-Instruct)",
            "dtype": args.dtype,
            "petrel_quantization": args.quantization,
            "w1_prompt_ids": cmp.w1_ids,
            "contention": contention.describe(),
            "rounds": args.rounds,
            "w6_plan": None if cmp.w6 is None else {**cmp.w6.__dict__, "notes": list(cmp.w6.notes)},
            "memory_read_gb_s": cmp.mem_gb_s,
            "workloads": workloads,
            "errors": errors,
            "w2_matmul_tflop": flops / 1e12 if flops is not None else None,
        },
        "rows": cmp.rows,
        "raw": raws[0] if args.rounds == 1 else {f"round {i + 1}": raw for i, raw in enumerate(raws)},
        "table": table_head(cmp, contention) + ratio_table(cmp.rows, engines),
    }


def table_head(cmp: Compare, contention: Contention) -> list[str]:
    """The lines above the table: the model, whether contention was on, W6's plan."""
    lines = [f"Model: {cmp.model or 'the default model (SmolLM2-135M-Instruct)'}."]
    if cmp.args.contention:
        lines.append(f"Contention ON: {contention.describe()}.")
    if cmp.args.rounds > 1:
        lines.append(
            f"{cmp.args.rounds} rounds, the engines in turn (every other round reversed): each engine's median over "
            "the rounds; each ratio the median of the rounds' ratios (lowest-highest)."
        )
    if cmp.w6 is not None:
        lines += [f"W6: {note}." for note in cmp.w6.notes]
        if cmp.mem_gb_s:
            lines.append(
                f"Memory read bandwidth (torch sum over 512 MiB, or --mem-bandwidth): {cmp.mem_gb_s:.1f} GB/s."
            )
    return lines + [""]


def prepare_model(cmp: Compare, workloads: list[str]) -> None:
    """What --model and W6 need before any engine runs: W1's prompt from the model's tokenizer, W6's plan from its
    config and the KV budget, and the machine's memory bandwidth."""
    if not (cmp.model or "w6" in workloads):
        return
    from petrel.bench.workloads import DTYPE_BYTES, FULL, QUICK, kv_bytes_per_token, w1_prompt_ids, w6_plan
    from petrel.model.loader import load_model_config, resolve_model

    source = resolve_model(cmp.model)
    if cmp.model and "w1" in workloads:
        from petrel.model.tokenizer import load_tokenizer

        cmp.w1_ids = w1_prompt_ids(load_tokenizer(source))
        log(f"W1 prompt: {len(cmp.w1_ids)} tokens from {cmp.model}'s chat template")
    if "w6" in workloads:
        from petrel.bench.flops import memory_read_gbs

        config = load_model_config(source)
        # both engines' caches hold --dtype (petrel's kv_cache_dtype 'auto', vLLM's 'auto')
        kv_bytes = DTYPE_BYTES.get(cmp.args.dtype, 4)
        kv = kv_bytes_per_token(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, kv_bytes)
        sizes = QUICK if cmp.args.quick else FULL
        cmp.w6 = w6_plan(config.vocab_size, config.max_position_embeddings, KV_GIB * 2**30, kv, sizes)
        for note in cmp.w6.notes:
            log(f"W6: {note}")
        cmp.mem_gb_s = cmp.args.mem_bandwidth or memory_read_gbs()


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
        "--llamacpp-w2",
        action="store_true",
        help="also run W2 on llama.cpp (its requests one after another: about 5 minutes on the default model)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="every workload at its smoke-test size (`petrel bench --quick`): checks a set-up in minutes; "
        "the figures do not compare with full runs",
    )
    p.add_argument(
        "--model",
        default=None,
        help="a Hugging Face directory or GGUF file petrel loads, for every engine (default: the default model)",
    )
    p.add_argument("--gguf", default=None, help="with an HF --model: the same weights as a GGUF, for llama.cpp")
    p.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "gguf", "bf16"],
        help="petrel's weights kept quantized in all its runs (gguf: a GGUF --model's own blocks, the types "
        "llama.cpp multiplies; default: none, a GGUF's blocks dequantized to --dtype)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=sorted(DTYPE_LABELS),
        help="petrel's and vLLM's dtype (default float32; bfloat16: petrel holds bfloat16 weights with float32 "
        "arithmetic on the CPU, vLLM runs bfloat16; llama.cpp runs --gguf's types; transformers is left out)",
    )
    p.add_argument(
        "--w2-requests",
        type=int,
        default=None,
        metavar="N",
        help="W2 with its first N prompts only, on every engine (a bigger --model; default: all 64)",
    )
    p.add_argument("--w1-runs", type=int, default=None, metavar="N", help="timed W1 runs per engine (default: 3)")
    p.add_argument(
        "--contention",
        type=int,
        default=0,
        metavar="N",
        help="N competing CPU-bound processes during each engine's run (stress-ng --cpu N if installed, else "
        "Python busy loops; default 0: off)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="N",
        help="run the engines in turn N times, every other round reversed; the table gives medians and each "
        "ratio's median over the rounds with its range (default 1)",
    )
    p.add_argument(
        "--mem-bandwidth",
        type=float,
        default=None,
        metavar="GB/s",
        help="this machine's memory bandwidth, for W6's KV-bandwidth share (default: measured)",
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
