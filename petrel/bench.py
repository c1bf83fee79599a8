"""petrel vs Hugging Face transformers on the benchmark workloads, in one process, side by side.

    petrel bench                       # W1 + W2, petrel and transformers, float32
    petrel bench --workloads w1,w2,w4 --out results.json
    petrel bench --quick --engines petrel   # a smoke test (seconds, not minutes)
    petrel bench latency | throughput | prefix [options]     # W1 / W2 / W4 alone
    petrel bench serve [--url URL] [--sweep 1,4,16] [--plot out.png]   # W3, see petrel/bench_serve.py

The workloads are those of the project's bench/WORKLOADS.md (regenerated here, nothing read from disk):
  W1  single stream: the chat template applied to W1_USER_MESSAGE, greedy, exactly 256 new tokens;
      TTFT and decode tok/s = (n - 1) / (t_last - t_first) from timestamps taken as each token streams in.
  W2  offline batch: 64 prompts of token ids from numpy default_rng(0), exactly 128 new tokens each, greedy,
      all submitted at once (transformers: left-padded, length-sorted batches of --hf-batch-size);
      wall time, output tok/s, (prompt + output) tok/s.
  W4  shared prefix: a 1,024-token prefix from default_rng(1) then 32 suffixes of 32 tokens from the same
      generator, 64 new tokens each, greedy, submitted at once; wall time and prompt tokens served from
      petrel's prefix cache (RequestOutput.num_cached_tokens). transformers has no prefix cache: it runs
      the same prompts as batches of --hf-batch-size.

Every figure is checked: a request that did not produce exactly the requested number of tokens makes its
workload's figure invalid ("valid": false, with the problem named), and no ratio is formed from it.

Output: one JSON object per line on stdout for each (engine, workload), then one per ratio
(petrel / transformers); progress goes to stderr. --out FILE writes everything as one JSON document.

`main(argv)` is the entry point for a `petrel bench` subcommand; `build_parser()` gives its options.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace

import numpy as np


W1_USER_MESSAGE = "Write a short story about a robot learning to paint."
# The W1 prompt of the default model (SmolLM2-135M-Instruct) as the peer scripts tokenize it
# (bench/peers/w1_prompt.json); used only to report whether petrel's tokenizer agrees.
W1_REFERENCE_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
                    19712, 8182, 2, 198, 1, 4093, 198, 19161, 253, 1890, 1977, 563, 253, 8085, 1380, 288, 7670, 30,
                    2, 198, 1, 520, 9531, 198]

W2_SEED, W2_NUM_REQUESTS, W2_MIN_LEN, W2_MAX_LEN = 0, 64, 64, 512   # lengths inclusive
W4_SEED = 1
TOKEN_LOW, TOKEN_HIGH = 100, 30000                                  # [low, high)
WORKLOADS = ("w1", "w2", "w4")
ENGINES = ("petrel", "hf")
ENGINE_LABELS = {"petrel": "petrel", "hf": "hf-transformers"}


@dataclass(frozen=True)
class Sizes:
    w1_new_tokens: int = 256
    w1_runs: int = 3
    w2_num_requests: int = 64
    w2_new_tokens: int = 128
    w2_max_prompt_len: int | None = None   # truncate prompts (--quick only)
    w4_num_requests: int = 32
    w4_prefix_len: int = 1024
    w4_suffix_len: int = 32
    w4_new_tokens: int = 64


FULL = Sizes()
QUICK = Sizes(w1_new_tokens=32, w1_runs=1, w2_num_requests=8, w2_new_tokens=16, w2_max_prompt_len=128,
              w4_num_requests=4, w4_prefix_len=128, w4_suffix_len=16, w4_new_tokens=8)


# ---------------------------------------------------------------------------------------------- workloads

def make_w2_prompts(num_requests: int = W2_NUM_REQUESTS, max_prompt_len: int | None = None) -> list[list[int]]:
    """W2's prompts exactly as bench/peers/workload.py makes them (all 64 drawn, then the first `num_requests`)."""
    rng = np.random.default_rng(W2_SEED)
    lengths = rng.integers(W2_MIN_LEN, W2_MAX_LEN + 1, size=W2_NUM_REQUESTS)
    prompts = [rng.integers(TOKEN_LOW, TOKEN_HIGH, size=int(n)).tolist() for n in lengths]
    prompts = prompts[:num_requests]
    if max_prompt_len is not None:
        prompts = [p[:max_prompt_len] for p in prompts]
    return prompts


def make_w4_prompts(num_requests: int = 32, prefix_len: int = 1024, suffix_len: int = 32) -> list[list[int]]:
    """W4: one 1,024-token prefix from default_rng(1), then 32 suffixes of 32 tokens from the same generator."""
    rng = np.random.default_rng(W4_SEED)
    prefix = rng.integers(TOKEN_LOW, TOKEN_HIGH, size=1024).tolist()
    suffixes = [rng.integers(TOKEN_LOW, TOKEN_HIGH, size=32).tolist() for _ in range(32)]
    return [prefix[:prefix_len] + s[:suffix_len] for s in suffixes[:num_requests]]


def w1_prompt_ids(tokenizer) -> list[int]:
    """The chat template applied to the W1 message, as LLM.apply_chat_template does."""
    from petrel.model.tokenizer import chat_prompt
    return list(chat_prompt(tokenizer, [{"role": "user", "content": W1_USER_MESSAGE}])["prompt_token_ids"])


def w1_metrics(t_start: float, token_times: list[float]) -> dict:
    n = len(token_times)
    if n == 0:
        return {"new_tokens": 0, "ttft_s": None, "decode_s": None, "decode_tok_s": None, "total_s": None}
    decode_s = token_times[-1] - token_times[0]
    return {"new_tokens": n, "ttft_s": token_times[0] - t_start, "decode_s": decode_s,
            "decode_tok_s": (n - 1) / decode_s if decode_s > 0 else None, "total_s": token_times[-1] - t_start}


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _count_problems(counts: list[int], expected: int, what: str = "request") -> list[str]:
    bad = [(i, c) for i, c in enumerate(counts) if c != expected]
    if not bad:
        return []
    shown = ", ".join(f"#{i}: {c}" for i, c in bad[:5]) + (" ..." if len(bad) > 5 else "")
    return [f"{len(bad)} of {len(counts)} {what}s did not produce {expected} tokens ({shown})"]


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- engines

class PetrelRunner:
    name = "petrel"

    def __init__(self, args):
        from petrel import LLM
        self.options = {"dtype": args.dtype}
        for key in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory", "num_threads", "block_size",
                    "quantization", "tensor_parallel_size", "distributed_executor_backend"):
            value = getattr(args, key, None)
            if value is not None:
                self.options[key] = value
        if args.no_prefix_caching:
            self.options["enable_prefix_caching"] = False
        t0 = time.perf_counter()
        self.llm = LLM(model=args.model, **self.options)
        self.load_s = time.perf_counter() - t0
        self.tokenizer = self.llm.tokenizer
        self._salt = f"bench-{os.getpid()}-{time.time_ns()}"   # a cold prefix cache for every timed request

    def info(self) -> dict:
        import petrel
        cfg = self.llm.config
        return {"engine": "petrel", "version": petrel.__version__, "load_s": self.load_s,
                "options": {k: getattr(cfg, k) for k in ("dtype", "max_num_seqs", "max_num_batched_tokens",
                                                         "kv_cache_memory", "block_size", "enable_prefix_caching",
                                                         "enable_chunked_prefill", "num_threads", "quantization",
                                                         "tensor_parallel_size", "distributed_executor_backend")}}

    @staticmethod
    def _params(n: int):
        from petrel import SamplingParams
        # min_tokens = max_tokens masks EOS until the end, as transformers' min_new_tokens does
        return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, detokenize=True)

    def warmup(self, prompt_ids: list[int]) -> float:
        t0 = time.perf_counter()
        self.llm.generate([prompt_ids, prompt_ids[: max(1, len(prompt_ids) // 2)]], self._params(8),
                          use_tqdm=False, cache_salt=f"{self._salt}-warmup")
        return time.perf_counter() - t0

    def w1(self, prompt_ids: list[int], n: int, run: int) -> tuple[dict, list[int]]:
        times: list[float] = []
        seen = 0
        last = None
        t_start = time.perf_counter()
        future = self.llm.generate_async(prompt_ids, self._params(n), streaming=True,
                                         cache_salt=f"{self._salt}-w1-{run}")
        for snap in future:
            k = len(snap.outputs[0].token_ids)
            if k > seen:
                now = time.perf_counter()
                times.extend([now] * (k - seen))   # tokens that arrived together share a timestamp
                seen = k
            last = snap
        m = w1_metrics(t_start, times)
        m["cached_prompt_tokens"] = last.num_cached_tokens
        m["finish_reason"] = last.outputs[0].finish_reason
        return m, list(last.outputs[0].token_ids)

    def batch(self, prompts: list[list[int]], n: int, tag: str) -> dict:
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, self._params(n), use_tqdm=False, cache_salt=f"{self._salt}-{tag}")
        wall = time.perf_counter() - t0
        return {"wall_s": wall, "counts": [len(o.outputs[0].token_ids) for o in outs],
                "cached": [o.num_cached_tokens for o in outs]}

    def close(self) -> None:
        self.llm.shutdown()


class HFRunner:
    name = "hf"

    def __init__(self, args, model_path: str, pad_token_id: int):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM
        transformers.logging.set_verbosity_error()
        self.torch = torch
        from petrel.config import TORCH_DTYPES
        self.dtype = TORCH_DTYPES[args.dtype]
        self.batch_size = args.hf_batch_size
        self.pad = pad_token_id
        t0 = time.perf_counter()
        if model_path.endswith(".gguf"):
            self.model = AutoModelForCausalLM.from_pretrained(os.path.dirname(model_path),
                                                              gguf_file=os.path.basename(model_path),
                                                              dtype=self.dtype)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype)
        self.model.eval()
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
        self.load_s = time.perf_counter() - t0

    def info(self) -> dict:
        import transformers
        return {"engine": "hf-transformers", "version": transformers.__version__, "load_s": self.load_s,
                "options": {"dtype": str(self.dtype).replace("torch.", ""), "batch_size": self.batch_size,
                            "sorted_by_length": True, "padding": "left"}}

    def _gen(self, ids, mask, n: int, streamer=None):
        with self.torch.inference_mode():
            return self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                       do_sample=False, pad_token_id=self.pad, streamer=streamer)

    def _make_batch(self, seqs: list[list[int]]):
        torch = self.torch
        length = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), length), self.pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), length), dtype=torch.long)
        for j, s in enumerate(seqs):  # left padding
            ids[j, length - len(s):] = torch.tensor(s)
            mask[j, length - len(s):] = 1
        return ids, mask

    def _row_count(self, row_ids: list[int]) -> int:
        """Tokens a batch row really generated: a row that stopped at EOS early is padded out with pad_token_id."""
        for k, token in enumerate(row_ids):
            if token in self.eos_ids and all(t == self.pad for t in row_ids[k + 1:]):
                return k + 1
        return len(row_ids)

    def warmup(self, prompt_ids: list[int]) -> float:
        t0 = time.perf_counter()
        ids, mask = self._make_batch([prompt_ids])
        self._gen(ids, mask, 8)
        ids, mask = self._make_batch([prompt_ids, prompt_ids[: max(1, len(prompt_ids) // 2)]])
        self._gen(ids, mask, 8)
        return time.perf_counter() - t0

    def w1(self, prompt_ids: list[int], n: int, run: int) -> tuple[dict, list[int]]:
        from transformers.generation.streamers import BaseStreamer

        class TimingStreamer(BaseStreamer):
            """generate() first puts the prompt, then each new token: time each token as it is handed out."""

            def __init__(self):
                self.times: list[float] = []
                self.prompt_seen = False

            def put(self, value):
                now = time.perf_counter()
                if not self.prompt_seen:
                    self.prompt_seen = True
                    return
                self.times.extend([now] * int(value.reshape(-1).shape[0]))

            def end(self):
                pass

        ids, mask = self._make_batch([prompt_ids])
        streamer = TimingStreamer()
        t_start = time.perf_counter()
        out = self._gen(ids, mask, n, streamer)
        m = w1_metrics(t_start, streamer.times)
        new_ids = out[0, ids.shape[1]:].tolist()
        new_ids = new_ids[:self._row_count(new_ids)]
        m["generated_tokens"] = len(new_ids)   # from the output tensor, next to the streamer's count
        return m, new_ids

    def batch(self, prompts: list[list[int]], n: int, tag: str) -> dict:
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        counts = [0] * len(prompts)
        padded = 0
        t0 = time.perf_counter()
        for b in range(0, len(order), self.batch_size):
            idx = order[b:b + self.batch_size]
            ids, mask = self._make_batch([prompts[i] for i in idx])
            padded += ids.numel()
            out = self._gen(ids, mask, n)
            new = out[:, ids.shape[1]:]
            for row, i in enumerate(idx):
                counts[i] = self._row_count(new[row].tolist())
            _log(f"  hf {tag} batch {b // self.batch_size}: {len(idx)} seqs, padded len {ids.shape[1]}, "
                 f"t={time.perf_counter() - t0:.1f}s")
        wall = time.perf_counter() - t0
        return {"wall_s": wall, "counts": counts, "cached": [0] * len(prompts), "padded_prompt_tokens": padded}

    def close(self) -> None:
        del self.model


# ---------------------------------------------------------------------------------------------- running

def run_w1(runner, prompt_ids: list[int], sizes: Sizes) -> dict:
    n = sizes.w1_new_tokens
    runs, problems, output_ids = [], [], []
    for r in range(sizes.w1_runs):
        m, ids = runner.w1(prompt_ids, n, r)
        runs.append(m)
        output_ids = ids
        counts = [m["new_tokens"], len(ids)]
        if any(c != n for c in counts):
            problems.append(f"run {r}: {m['new_tokens']} tokens streamed, {len(ids)} returned, expected {n}")
        _log(f"  {runner.name} w1 run {r}: TTFT {1000 * (m['ttft_s'] or float('nan')):.1f} ms, "
             f"decode {m['decode_tok_s'] or float('nan'):.2f} tok/s, {m['new_tokens']} tokens")
    return {"prompt_tokens": len(prompt_ids), "new_tokens": n, "num_runs": len(runs),
            "ttft_s": _median(r["ttft_s"] for r in runs), "decode_tok_s": _median(r["decode_tok_s"] for r in runs),
            "total_s": _median(r["total_s"] for r in runs), "runs": runs,
            "output_ids_first32": output_ids[:32], "_output_ids": output_ids, "problems": problems}


def run_batch(runner, prompts: list[list[int]], n: int, tag: str) -> dict:
    res = runner.batch(prompts, n, tag)
    prompt_tokens = sum(len(p) for p in prompts)
    out_tokens = sum(res["counts"])
    wall = res["wall_s"]
    result = {"num_requests": len(prompts), "new_tokens": n, "prompt_tokens": prompt_tokens,
              "output_tokens": out_tokens, "expected_output_tokens": n * len(prompts), "wall_s": wall,
              "output_tok_s": out_tokens / wall, "total_tok_s": (prompt_tokens + out_tokens) / wall,
              "problems": _count_problems(res["counts"], n)}
    if "padded_prompt_tokens" in res:
        result["padded_prompt_tokens"] = res["padded_prompt_tokens"]
    result["cached_prompt_tokens"] = sum(res["cached"])
    if tag == "w4":
        result["cached_per_request_min"] = min(res["cached"])
        result["cached_per_request_max"] = max(res["cached"])
    _log(f"  {runner.name} {tag}: wall {wall:.2f}s, {result['output_tok_s']:.1f} output tok/s, "
         f"{result['total_tok_s']:.1f} total tok/s, cached prompt tokens {result['cached_prompt_tokens']}")
    return result


def _ratio(workload: str, metric: str, a: dict | None, b: dict | None, extra: dict | None = None) -> dict:
    ratio = {"workload": workload, "ratio": "petrel/hf-transformers", "metric": metric, "value": None}
    if a is None or b is None:
        ratio["note"] = "not measured on both engines"
    elif not a["valid"] or not b["valid"]:
        bad = [r["engine"] for r in (a, b) if not r["valid"]]
        ratio["note"] = f"does not count: wrong token counts from {', '.join(bad)}"
    elif a.get(metric) and b.get(metric):
        ratio["value"] = a[metric] / b[metric]
    for key, value in (extra or {}).items():   # the side figures count only when the main one does
        ratio[key] = value if ratio["value"] is not None else None
    return ratio


def _matching_prefix(x: list[int], y: list[int]) -> int:
    k = 0
    for p, q in zip(x, y):
        if p != q:
            break
        k += 1
    return k


def _git_commit() -> str | None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return (commit + ("-dirty" if dirty else "")) or None
    except Exception:  # noqa: BLE001 - not a git checkout
        return None


def parse_choices(text: str, known, what: str) -> list[str]:
    """A comma-separated option as a list, every item one of `known` (SystemExit naming one that is not)."""
    items = [x.strip().lower() for x in text.split(",") if x.strip()]
    for x in items:
        if x not in known:
            raise SystemExit(f"unknown {what} {x!r}; known: {', '.join(known)}")
    return items


def run(args) -> dict:
    """Run the benchmark for parsed options; returns the whole result document."""
    import torch
    import transformers
    from petrel.model.loader import resolve_model
    from petrel.model.tokenizer import load_tokenizer

    workloads = parse_choices(args.workloads, WORKLOADS, "workload")
    engines = parse_choices(args.engines, ENGINES, "engine")
    sizes = QUICK if args.quick else FULL
    if args.w1_runs is not None:
        sizes = replace(sizes, w1_runs=args.w1_runs)

    source = resolve_model(args.model)
    tokenizer = load_tokenizer(source)
    w1_ids = w1_prompt_ids(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    prompts = {"w2": make_w2_prompts(sizes.w2_num_requests, sizes.w2_max_prompt_len),
               "w4": make_w4_prompts(sizes.w4_num_requests, sizes.w4_prefix_len, sizes.w4_suffix_len)}

    doc = {"meta": {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), "quick": bool(args.quick),
                    "sizes": asdict(sizes), "dtype": args.dtype, "model": source.path, "model_kind": source.kind,
                    "w1_prompt_tokens": len(w1_ids),
                    "w1_prompt_matches_peers": w1_ids == W1_REFERENCE_IDS if args.model is None else None,
                    "git_commit": _git_commit(), "python": platform.python_version(), "torch": torch.__version__,
                    "transformers": transformers.__version__, "cpu_count": os.cpu_count(),
                    "machine": platform.machine(), "engines": {}},
           "results": [], "ratios": []}

    runners = {}
    try:
        for name in engines:
            _log(f"loading {ENGINE_LABELS[name]} ...")
            runners[name] = PetrelRunner(args) if name == "petrel" else HFRunner(args, source.path, pad)
            info = runners[name].info()
            info["torch_threads"] = torch.get_num_threads()
            info["warmup_s"] = runners[name].warmup(w1_ids)
            doc["meta"]["engines"][name] = info
            _log(f"{ENGINE_LABELS[name]}: loaded in {info['load_s']:.1f}s, warm-up {info['warmup_s']:.1f}s")

        by_key = {}
        for workload in workloads:
            for name in engines:   # engines alternate workload by workload, so drifting load hits both alike
                runner = runners[name]
                _log(f"{ENGINE_LABELS[name]} {workload} ...")
                if workload == "w1":
                    body = run_w1(runner, w1_ids, sizes)
                elif workload == "w2":
                    body = run_batch(runner, prompts["w2"], sizes.w2_new_tokens, "w2")
                else:
                    body = run_batch(runner, prompts["w4"], sizes.w4_new_tokens, "w4")
                result = {"engine": ENGINE_LABELS[name], "workload": workload, "dtype": args.dtype,
                          "quick": bool(args.quick), "valid": not body["problems"], **body}
                if not result["valid"]:
                    _log(f"{ENGINE_LABELS[name]} {workload}: FIGURE DOES NOT COUNT: {'; '.join(body['problems'])}")
                by_key[(name, workload)] = result
                doc["results"].append(result)
                print(json.dumps({k: v for k, v in result.items() if not k.startswith("_")}), flush=True)
    finally:
        for runner in runners.values():
            runner.close()

    if "petrel" in engines and "hf" in engines:
        for workload in workloads:
            a, b = by_key.get(("petrel", workload)), by_key.get(("hf", workload))
            if workload == "w1":
                extra = {"ttft_s_ratio": (a["ttft_s"] / b["ttft_s"]) if a["ttft_s"] and b["ttft_s"] else None,
                         "greedy_matching_prefix_tokens": _matching_prefix(a["_output_ids"], b["_output_ids"])}
                ratio = _ratio("w1", "decode_tok_s", a, b, extra)
            else:
                extra = {"total_tok_s_ratio": a["total_tok_s"] / b["total_tok_s"],
                         "wall_s_ratio": a["wall_s"] / b["wall_s"]}
                ratio = _ratio(workload, "output_tok_s", a, b, extra)
            doc["ratios"].append(ratio)
            print(json.dumps(ratio), flush=True)
    for result in doc["results"]:
        result.pop("_output_ids", None)
    doc["all_valid"] = all(r["valid"] for r in doc["results"])
    return doc


def _size(text: str) -> int:
    """Bytes, with an optional K/M/G suffix (powers of 1024): 2G, 512M, 2147483648."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}.get(text[-1:], 1)
    number = text[:-1] if scale != 1 else text
    try:
        return int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use bytes or e.g. 512M, 2G)") from None


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--workloads", default="w1,w2", help="comma-separated, from w1,w2,w4 (default: w1,w2); "
                        "or a subcommand: latency (W1), throughput (W2), prefix (W4), serve (W3, its own options)")
    parser.add_argument("--engines", default="petrel,hf", help="comma-separated, from petrel,hf (default: both)")
    parser.add_argument("--dtype", default="float32", help="model dtype for both engines (default: float32)")
    parser.add_argument("--model", default=None,
                        help="a .gguf file or Hugging Face directory (default: petrel's default GGUF)")
    parser.add_argument("--quick", action="store_true",
                        help=f"a shrunken smoke test: W1 {QUICK.w1_new_tokens} tokens x {QUICK.w1_runs} run, "
                             f"W2 {QUICK.w2_num_requests} prompts (<= {QUICK.w2_max_prompt_len} tokens) x "
                             f"{QUICK.w2_new_tokens} new, W4 {QUICK.w4_num_requests} x ({QUICK.w4_prefix_len}+"
                             f"{QUICK.w4_suffix_len}) x {QUICK.w4_new_tokens} new")
    parser.add_argument("--w1-runs", type=int, default=None,
                        help=f"timed W1 runs per engine, median reported (default: {FULL.w1_runs}, quick: 1)")
    parser.add_argument("--json", "--out", dest="out", default=None, metavar="FILE.json",
                        help="also write all results to this file")
    group = parser.add_argument_group("petrel engine options")
    group.add_argument("--max-num-seqs", type=int, default=None)
    group.add_argument("--max-num-batched-tokens", type=int, default=None)
    group.add_argument("--kv-cache-memory", type=_size, default=None, help="bytes, or e.g. 2G, 512M")
    group.add_argument("--block-size", type=int, default=None)
    group.add_argument("--num-threads", type=int, default=None, help="torch threads (applies to both engines)")
    group.add_argument("--no-prefix-caching", action="store_true")
    group.add_argument("--quantization", default=None, choices=["none", "int8", "gguf"],
                       help="petrel's weights kept quantized (see benchmarks/quantization.py for all three at once)")
    from petrel.cli import parallel_arguments
    parallel_arguments(group)
    group = parser.add_argument_group("transformers options")
    group.add_argument("--hf-batch-size", type=int, default=16,
                       help="batch size for W2/W4 (left-padded, length-sorted; default: 16)")
    return parser


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(
        prog=prog, description="Benchmark petrel against Hugging Face transformers (same process, same run)."))


SUBCOMMANDS = {"latency": "w1", "throughput": "w2", "prefix": "w4"}


def main(argv: list[str] | None = None) -> int:
    """Entry point of `petrel bench`: 0 when every figure counts, 1 otherwise.

    `petrel bench latency|throughput|prefix [options]` runs W1 / W2 / W4 (the same as --workloads w1 / w2 / w4);
    `petrel bench serve [options]` runs W3 against a server (see petrel/bench_serve.py); `petrel bench compare`
    runs petrel and every installed peer on W1-W4 (petrel/bench_compare.py); with no subcommand the
    options pick the workloads (--workloads w1,w2 by default)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        from petrel.bench_serve import main as serve_main
        return serve_main(argv[1:])
    if argv and argv[0] == "compare":
        from petrel.bench_compare import main as compare_main
        return compare_main(argv[1:])
    if argv and argv[0] in SUBCOMMANDS:
        name = argv.pop(0)
        args = build_parser(f"petrel bench {name}").parse_args(argv + ["--workloads", SUBCOMMANDS[name]])
        return run_parsed(args)
    return run_parsed(build_parser("petrel bench").parse_args(argv))


def run_parsed(args: argparse.Namespace) -> int:
    """For a CLI that parsed the options itself (a subparser filled by add_arguments): run, save, summarize."""
    doc = run(args)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        _log(f"saved {args.out}")
    _summary(doc)
    return 0 if doc["all_valid"] else 1


def _summary(doc: dict) -> None:
    _log(f"summary ({doc['meta']['dtype']}{', QUICK (not comparable)' if doc['meta']['quick'] else ''}):")
    for r in doc["results"]:
        flag = "" if r["valid"] else "  [DOES NOT COUNT]"
        if r["workload"] == "w1":
            ttft = f"{1000 * r['ttft_s']:.1f} ms" if r["ttft_s"] is not None else "n/a"
            dec = f"{r['decode_tok_s']:.2f}" if r["decode_tok_s"] is not None else "n/a"
            _log(f"  {r['engine']:16s} w1: TTFT {ttft}, decode {dec} tok/s{flag}")
        else:
            _log(f"  {r['engine']:16s} {r['workload']}: wall {r['wall_s']:.2f}s, "
                 f"{r['output_tok_s']:.1f} output tok/s, {r['total_tok_s']:.1f} total tok/s, "
                 f"cached {r['cached_prompt_tokens']}{flag}")
    for q in doc["ratios"]:
        value = f"{q['value']:.2f}x" if q["value"] is not None else q.get("note", "n/a")
        _log(f"  ratio petrel/hf {q['workload']} {q['metric']}: {value}")


if __name__ == "__main__":
    sys.exit(main())
