"""`petrel bench compare`: petrel and every installed peer on W1-W4 in one run, one table of figures and ratios.

    petrel bench compare                          # every installed peer, every workload (about 25 minutes)
    petrel bench compare --engines petrel,llamacpp --workloads w1
    petrel bench compare --out benchmarks/results/compare.json

The peers are the ones `bench/peers/setup_peers.sh` installs under $PEERS_HOME (default ~/petrel-peers), each in
its own virtual environment: transformers (`venv-hf`), vLLM's CPU build (`venv-vllm`) and llama.cpp through
llama-cpp-python (`venv-llamacpp`). A peer that is not installed is left out (and said so). Each engine runs in its
own process, one after the other (the machine has 2 cores); this process samples the summed RSS of each one's
process tree. Peers run through the peers' own scripts (`--peers-dir`), petrel through `petrel bench` and
`petrel serve`, so every engine does exactly the work of WORKLOADS.md. Figures are float32 unless the row says.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

WORKLOADS = ("w1", "w2", "w3", "w4", "startup")
ENGINES = ("petrel", "hf", "vllm", "llamacpp")
RESULT_LINE = re.compile(r"^RESULT (\S+): (\{.*\})\s*$", re.M)
KV_GIB = 4           # the same KV budget for petrel and vLLM (VLLM_CPU_KVCACHE_SPACE)
STARTUP_PROBE = """import json, time
t = time.perf_counter()
from petrel import LLM, SamplingParams
llm = LLM()
llm.generate("Hi", SamplingParams(max_tokens=1), use_tqdm=False)
print("RESULT petrel_startup: " + json.dumps({"first_token_s": time.perf_counter() - t}))
llm.shutdown()
"""


def _log(msg: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ processes

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
                        self.peak_mib = max(self.peak_mib, _high_water_mark(proc.pid) / 2**20)
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


def _high_water_mark(pid: int) -> int:
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
    _log("$ " + " ".join(cmd))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)
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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess (its own session, killed with its children), ready once `health_path` answers 200."""

    def __init__(self, cmd: list[str], port: int, env: dict | None = None, health_path: str = "/health",
                 timeout: float = 900):
        import httpx
        _log("$ " + " ".join(cmd))
        self.started = time.perf_counter()
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)
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
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.rss.stop()


# ------------------------------------------------------------------------------------------------ engines

class Compare:
    def __init__(self, args):
        self.args = args
        self.peers_home = os.path.expanduser(args.peers_home)
        self.peers_dir = os.path.abspath(args.peers_dir)
        self.model_dir = os.path.join(self.peers_home, "models", "smollm2-135m-instruct")
        self.gguf = {"f32": os.path.join(self.peers_home, "models", "smollm2-135m-instruct-f32.gguf"),
                     "q4_1": os.path.join(self.peers_home, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")}
        self.rows: list[dict] = []      # {"workload", "metric", "engine", "value", "unit", "note"}
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
            self.rows.append({"workload": workload, "metric": metric, "engine": engine, "value": value,
                              "unit": unit, "note": note})

    def peer_script(self, engine: str, script: str, *argv: str, env: dict | None = None):
        cmd = [self.python(engine), os.path.join(self.peers_dir, script), *argv]
        return run_script(cmd, env={"PEERS_HOME": self.peers_home, **(env or {})})

    def serve_client(self, port: int, model: str, name: str, *extra: str) -> dict:
        results, _ = run_script([sys.executable, os.path.join(self.peers_dir, "serve_client.py"), "--port", str(port),
                                 "--model", model, "--name", name, *extra], env={"PEERS_HOME": self.peers_home})
        return results[-1]

    def record_w3(self, engine: str, r: dict, note: str = "") -> None:
        ok = r["output_tokens"] == r["expected_output_tokens"]
        note = note + ("" if ok else f" (only {r['output_tokens']} of {r['expected_output_tokens']} tokens)")
        self.add("w3", "output tok/s", engine, r["output_tok_s"] if ok else None, "tok/s", note)
        self.add("w3", "TTFT p99", engine, r["ttft_p99_s"], "s", note)
        self.add("w3", "TTFT p50", engine, r["ttft_p50_s"], "s", note)
        self.add("w3", "TPOT p50", engine, r["tpot_p50_s"] * 1000, "ms", note)

    # ---- petrel
    @staticmethod
    def petrel_bench(workloads: str, *options: str) -> tuple[dict, float]:
        """`petrel bench --engines petrel` in its own process: its result document and the process's peak RSS."""
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "petrel.json")
            _, peak = run_script([sys.executable, "-m", "petrel.bench", "--engines", "petrel", "--workloads",
                                  workloads, *options, "--json", out])
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
        if "w1" in workloads:   # the GGUF's own Q4_1 blocks kept quantized: the same weights as llama.cpp's Q4_1 run
            r = self.petrel_bench("w1", "--quantization", "gguf")[0]["results"][0]
            self.raw["petrel_w1_gguf"] = r
            self.add("w1", "decode tok/s (Q4_1)", "petrel", r["decode_tok_s"] if r["valid"] else None, "tok/s",
                     "quantization='gguf'")
        if "w4" in workloads:
            for caching in (True, False):
                doc = self.petrel_bench("w4", *([] if caching else ["--no-prefix-caching"]))[0]
                self.raw[f"petrel_w4_{'cache' if caching else 'nocache'}"] = doc
                r = doc["results"][0]
                tag = "" if caching else " (prefix caching off)"
                self.add("w4", "wall" + tag, "petrel", r["wall_s"] if r["valid"] else None, "s")
                if caching:
                    self.add("w4", "prompt tokens from cache", "petrel", r["cached_prompt_tokens"], "tokens",
                             "of 31 × 1,024 shared-prefix tokens that could be (the first request computes it)")
        if "w3" in workloads:
            port = free_port()
            server = Server([sys.executable, "-m", "petrel.cli", "serve", "--port", str(port), "--log-level",
                             "warning", "--served-model-name", "petrel"], port)
            try:
                r = self.serve_client(port, "petrel", "w3_petrel")
            finally:
                peak = server.close()
            self.raw["petrel_w3"] = r
            self.record_w3("petrel", r)
            self.add("w3", "peak RSS (server)", "petrel", peak, "MiB")
        if "startup" in workloads:
            results, _ = run_script([sys.executable, "-c", STARTUP_PROBE])
            self.add("startup", "LLM() to first token", "petrel", results[0]["first_token_s"], "s")
            port = free_port()
            server = Server([sys.executable, "-m", "petrel.cli", "serve", "--port", str(port), "--log-level",
                             "warning"], port)
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
            results, _ = self.peer_script("hf", "hf_bench.py", "w1", "--tag", "compare")
            r = results[-1]
            self.raw["hf_w1"] = r
            self.add("w1", "decode tok/s (fp32)", "hf", r["median_decode_tok_s"], "tok/s")
            self.add("w1", "TTFT", "hf", r["median_ttft_s"] * 1000, "ms")
        if "w2" in workloads:
            results, peak = self.peer_script("hf", "hf_bench.py", "w2", "--batch-size", "16", "--sort",
                                             "--tag", "compare")
            r = results[-1]
            self.raw["hf_w2"] = r
            self.add("w2", "output tok/s", "hf", r["output_tok_s"], "tok/s", "bs 16, length-sorted, left-padded")
            self.add("w2", "wall", "hf", r["wall_s"], "s")

    # ---- vLLM (CPU build)
    def vllm_env(self) -> dict:
        return {"VLLM_CPU_KVCACHE_SPACE": str(KV_GIB), "VLLM_CPU_OMP_THREADS_BIND": "0-1"}

    def vllm(self, workloads: list[str]) -> None:
        batch = [w for w in ("w1", "w2") if w in workloads]
        if batch:
            which = "both" if len(batch) == 2 else batch[0]
            results, peak = self.peer_script("vllm", "vllm_bench.py", which, "--dtype", "float32", "--tag", "compare",
                                             env=self.vllm_env())
            for r in results:
                self.raw[r["name"]] = r
                if "median_decode_tok_s" in r:
                    self.add("w1", "decode tok/s (fp32)", "vllm", r["median_decode_tok_s"], "tok/s")
                    self.add("w1", "TTFT", "vllm", r["median_ttft_s"] * 1000, "ms")
                else:
                    self.add("w2", "output tok/s", "vllm", r["output_tok_s"], "tok/s")
                    self.add("w2", "wall", "vllm", r["wall_s"], "s")
                self.add("startup", "LLM() init (offline engine)", "vllm", r.get("init_s"), "s")
            if "w2" in batch:
                self.add("w2", "peak RSS (w1+w2 process)", "vllm", peak, "MiB", f"KV {KV_GIB} GiB")
        if "w3" in workloads or "startup" in workloads:
            port = free_port()
            server = Server([self.python("vllm"), "-m", "vllm.entrypoints.openai.api_server", "--model",
                             self.model_dir, "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
                             "--served-model-name", "vllm"], port, env=self.vllm_env())
            self.add("startup", "server to /health 200", "vllm", server.ready_s, "s")
            try:
                if "w3" in workloads:
                    r = self.serve_client(port, "vllm", "w3_vllm")
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
                results, _ = self.peer_script("llamacpp", "llamacpp_bench.py", "w1", "--gguf", self.gguf[tag],
                                              "--tag", f"compare_{tag}")
                r = results[-1]
                self.raw[f"llamacpp_w1_{tag}"] = r
                self.add("w1", metric, "llamacpp", r["median_decode_tok_s"], "tok/s")
                if tag == "f32":
                    self.add("w1", "TTFT", "llamacpp", r["median_ttft_s"] * 1000, "ms", "F32 GGUF")
                    self.add("startup", "model load", "llamacpp", r.get("load_s"), "s")
        if "w2" in workloads and self.args.llamacpp_w2:
            gguf = self.gguf["f32"] if os.path.exists(self.gguf["f32"]) else self.gguf["q4_1"]
            results, peak = self.peer_script("llamacpp", "llamacpp_bench.py", "w2", "--gguf", gguf,
                                             "--tag", "compare")
            r = results[-1]
            self.raw["llamacpp_w2"] = r
            self.add("w2", "output tok/s", "llamacpp", r["output_tok_s"], "tok/s",
                     f"{os.path.basename(gguf)}, 64 sequential requests (no batching in its Python API)")
            self.add("w2", "wall", "llamacpp", r["wall_s"], "s")


# ------------------------------------------------------------------------------------------------ the table

def matmul_peak_gflops(threads: int = 2, n: int = 2048, repeats: int = 10) -> float:
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        for _ in range(3):
            a @ b
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t)
        return 2 * n ** 3 / best / 1e9
    finally:
        torch.set_num_threads(before)


def w2_matmul_flops() -> float:
    """The multiply-adds W2 needs (x2): every prompt and output position through every linear layer, attention's
    two products over its context, and the LM head for the output tokens only (prompt positions need no logits)."""
    from petrel.bench import make_w2_prompts
    from petrel.model.config import ModelConfig
    from petrel.model.loader import load_model_config, resolve_model
    cfg: ModelConfig = load_model_config(resolve_model(None))
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    q = cfg.num_attention_heads * cfg.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size
    new = 128
    total = 0.0
    for prompt in make_w2_prompts():
        positions = len(prompt) + new - 1            # the last sampled token is never fed back
        contexts = positions * (positions + 1) / 2   # sum over positions of the context each attends to
        total += 2 * per_layer * cfg.num_hidden_layers * positions
        total += 2 * 2 * q * cfg.num_hidden_layers * contexts
        total += 2 * h * cfg.vocab_size * new
    return total


def ratio_table(rows: list[dict], engines: list[str]) -> list[str]:
    """Markdown: one line per (workload, metric), a column per engine, then petrel / peer for each peer."""
    keys, values = [], {}
    for r in rows:
        key = (r["workload"], r["metric"])
        if key not in values:
            keys.append(key)
            values[key] = {"unit": r["unit"]}
        values[key][r["engine"]] = r["value"]
    peers = [e for e in engines if e != "petrel"]
    head = ["workload", "metric"] + engines + [f"petrel / {p}" for p in peers]
    out = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + " |"]
    for key in keys:
        v = values[key]
        cells = [key[0], f"{key[1]} ({v['unit']})" if v["unit"] else key[1]]
        cells += [_fmt(v.get(e)) for e in engines]
        for p in peers:
            a, b = v.get("petrel"), v.get(p)
            cells.append(f"{a / b:.2f}x" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "")
        out.append("| " + " | ".join(cells) + " |")
    return out


def _fmt(x) -> str:
    if x is None:
        return ""
    if isinstance(x, float):
        return f"{x:,.2f}" if abs(x) < 100 else f"{x:,.0f}"
    return f"{x:,}"


def run(args) -> dict:
    from petrel.bench import parse_choices
    workloads = parse_choices(args.workloads, WORKLOADS, "workload")
    engines = parse_choices(args.engines, ENGINES, "engine")
    cmp = Compare(args)
    missing = [e for e in engines if not cmp.installed(e)]
    for e in missing:
        _log(f"{e}: not installed under {cmp.peers_home} (run bench/peers/setup_peers.sh); left out")
    engines = [e for e in engines if e not in missing]
    needs_scripts = "w3" in workloads or any(e != "petrel" for e in engines)
    if needs_scripts and not os.path.exists(os.path.join(cmp.peers_dir, "serve_client.py")):
        raise SystemExit(f"no peers' scripts at {cmp.peers_dir} (--peers-dir)")
    peak = matmul_peak_gflops()
    _log(f"fp32 matmul peak (torch, 2 threads, 2048²): {peak:.1f} GFLOP/s")
    errors = {}
    for engine in engines:
        try:
            getattr(cmp, engine)(workloads)
        except Exception as e:  # noqa: BLE001 - one engine failing leaves the others' figures
            errors[engine] = repr(e)
            _log(f"{engine} FAILED: {e!r}")
    flops = w2_matmul_flops() if "w2" in workloads else None
    if flops is not None:
        for r in [r for r in cmp.rows if r["workload"] == "w2" and r["metric"] == "wall"]:
            achieved = flops / r["value"] / 1e9
            cmp.add("w2", "matmul GFLOP/s (share of peak)", r["engine"], achieved, "GFLOP/s",
                    f"{100 * achieved / peak:.0f}% of {peak:.0f}")
    return {"meta": {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": platform.machine(),
                     "cpu_count": os.cpu_count(), "matmul_peak_gflops": peak, "engines": engines,
                     "missing": missing, "workloads": workloads, "errors": errors,
                     "w2_matmul_tflop": flops / 1e12 if flops is not None else None},
            "rows": cmp.rows, "raw": cmp.raw, "table": ratio_table(cmp.rows, engines)}


def build_parser() -> argparse.ArgumentParser:
    here = os.path.dirname(os.path.abspath(__file__))
    default_peers_dir = os.path.normpath(os.path.join(here, "..", "..", "shared", "bench", "peers"))
    p = argparse.ArgumentParser(prog="petrel bench compare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=",".join(ENGINES), help=f"from {','.join(ENGINES)} (default: all installed)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"from {','.join(WORKLOADS)} (default: all)")
    p.add_argument("--peers-home", default=os.environ.get("PEERS_HOME", "~/petrel-peers"))
    p.add_argument("--peers-dir", default=os.environ.get("PETREL_PEERS_DIR", default_peers_dir),
                   help="the directory of the peers' scripts (bench/peers)")
    p.add_argument("--llamacpp-w2", action="store_true",
                   help="also run W2 on llama.cpp (64 sequential requests: about 5 minutes)")
    p.add_argument("--json", "--out", dest="out", default=None, metavar="FILE.json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    doc = run(args)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        _log(f"saved {args.out}")
    print("\n".join(doc["table"]))
    return 1 if doc["meta"]["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
