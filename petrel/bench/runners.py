"""The two engines `petrel bench` drives in its own process, behind one interface: load, warm up, one W1 stream
timed token by token, one batch of prompts timed as a whole. petrel through LLM; transformers through generate(),
in left-padded, length-sorted batches (it has no continuous batching and no prefix cache)."""

from __future__ import annotations

import os
import time

from petrel.bench.report import log, w1_metrics

# `petrel bench` options that are EngineConfig fields of the same name
PETREL_OPTIONS = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "kv_cache_memory",
    "num_threads",
    "block_size",
    "quantization",
    "tensor_parallel_size",
    "distributed_executor_backend",
    "device",
)


class PetrelRunner:
    name = "petrel"

    def __init__(self, args):
        from petrel.llm import LLM

        self.options = {"dtype": args.dtype}
        for key in PETREL_OPTIONS:
            value = getattr(args, key, None)
            if value is not None:
                self.options[key] = value
        if args.no_prefix_caching:
            self.options["enable_prefix_caching"] = False
        t0 = time.perf_counter()
        self.llm = LLM(model=args.model, **self.options)
        self.load_s = time.perf_counter() - t0
        self.tokenizer = self.llm.tokenizer
        self._salt = f"bench-{os.getpid()}-{time.time_ns()}"  # a cold prefix cache for every timed request

    def info(self) -> dict:
        import petrel

        cfg = self.llm.config
        return {
            "engine": "petrel",
            "version": petrel.__version__,
            "load_s": self.load_s,
            "options": {
                k: getattr(cfg, k)
                for k in (
                    "dtype",
                    "max_num_seqs",
                    "max_num_batched_tokens",
                    "kv_cache_memory",
                    "block_size",
                    "enable_prefix_caching",
                    "enable_chunked_prefill",
                    "num_threads",
                    "quantization",
                    "tensor_parallel_size",
                    "distributed_executor_backend",
                )
            },
        }

    @staticmethod
    def _params(n: int):
        from petrel.sampling_params import SamplingParams

        # min_tokens = max_tokens masks EOS until the end, as transformers' min_new_tokens does
        return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, detokenize=True)

    def warmup(self, prompt_ids: list[int]) -> float:
        t0 = time.perf_counter()
        self.llm.generate(
            [prompt_ids, prompt_ids[: max(1, len(prompt_ids) // 2)]],
            self._params(8),
            use_tqdm=False,
            cache_salt=f"{self._salt}-warmup",
        )
        return time.perf_counter() - t0

    def w1(self, prompt_ids: list[int], n: int, run: int) -> tuple[dict, list[int]]:
        times: list[float] = []
        seen = 0
        last = None
        t_start = time.perf_counter()
        future = self.llm.generate_async(
            prompt_ids, self._params(n), streaming=True, cache_salt=f"{self._salt}-w1-{run}"
        )
        for snap in future:
            k = len(snap.outputs[0].token_ids)
            if k > seen:
                now = time.perf_counter()
                times.extend([now] * (k - seen))  # tokens that arrived together share a timestamp
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
        return {
            "wall_s": wall,
            "counts": [len(o.outputs[0].token_ids) for o in outs],
            "cached": [o.num_cached_tokens for o in outs],
        }

    def streams(self, prompts: list[list[int]], n: int, tag: str) -> list[dict]:
        """Every prompt submitted at once, each streamed (a thread each): its send time, prompt length and each new
        token's arrival time (report.w6_metrics's input)."""
        import threading

        records = [{"prompt_len": len(p), "times": [], "t_send": 0.0} for p in prompts]
        futures = []
        for i, prompt in enumerate(prompts):
            records[i]["t_send"] = time.perf_counter()
            futures.append(
                self.llm.generate_async(prompt, self._params(n), streaming=True, cache_salt=f"{self._salt}-{tag}-{i}")
            )

        def follow(future, record):
            seen = 0
            for snap in future:
                k = len(snap.outputs[0].token_ids)
                if k > seen:
                    record["times"].extend([time.perf_counter()] * (k - seen))
                    seen = k

        threads = [threading.Thread(target=follow, args=(f, r), daemon=True) for f, r in zip(futures, records)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return records

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
        self.device = getattr(args, "device", None) or "cpu"
        self.batch_size = args.hf_batch_size
        self.pad = pad_token_id
        t0 = time.perf_counter()
        if model_path.endswith(".gguf"):
            self.model = AutoModelForCausalLM.from_pretrained(
                os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=self.dtype
            )
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype)
        self.model.to(self.device).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
        self.load_s = time.perf_counter() - t0

    def info(self) -> dict:
        import transformers

        return {
            "engine": "hf-transformers",
            "version": transformers.__version__,
            "load_s": self.load_s,
            "options": {
                "dtype": str(self.dtype).replace("torch.", ""),
                "device": self.device,
                "batch_size": self.batch_size,
                "sorted_by_length": True,
                "padding": "left",
            },
        }

    def _gen(self, ids, mask, n: int, streamer=None):
        with self.torch.inference_mode():
            return self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=self.pad,
                streamer=streamer,
            )

    def _make_batch(self, seqs: list[list[int]]):
        torch = self.torch
        length = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), length), self.pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), length), dtype=torch.long)
        for j, s in enumerate(seqs):  # left padding
            ids[j, length - len(s) :] = torch.tensor(s)
            mask[j, length - len(s) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def _row_count(self, row_ids: list[int]) -> int:
        """Tokens a batch row really generated: a row that stopped at EOS early is padded out with pad_token_id."""
        for k, token in enumerate(row_ids):
            if token in self.eos_ids and all(t == self.pad for t in row_ids[k + 1 :]):
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
        self.last_times = (t_start, streamer.times)  # for W6's figures (benchmarks/peers/hf_bench.py)
        new_ids = out[0, ids.shape[1] :].tolist()
        new_ids = new_ids[: self._row_count(new_ids)]
        m["generated_tokens"] = len(new_ids)  # from the output tensor, next to the streamer's count
        return m, new_ids

    def batch(self, prompts: list[list[int]], n: int, tag: str) -> dict:
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        counts = [0] * len(prompts)
        padded = 0
        t0 = time.perf_counter()
        for b in range(0, len(order), self.batch_size):
            idx = order[b : b + self.batch_size]
            ids, mask = self._make_batch([prompts[i] for i in idx])
            padded += ids.numel()
            out = self._gen(ids, mask, n)
            new = out[:, ids.shape[1] :]
            for row, i in enumerate(idx):
                counts[i] = self._row_count(new[row].tolist())
            log(
                f"  hf {tag} batch {b // self.batch_size}: {len(idx)} seqs, padded len {ids.shape[1]}, "
                f"t={time.perf_counter() - t0:.1f}s"
            )
        wall = time.perf_counter() - t0
        return {"wall_s": wall, "counts": counts, "cached": [0] * len(prompts), "padded_prompt_tokens": padded}

    def close(self) -> None:
        del self.model
