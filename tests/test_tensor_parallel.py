"""Tensor parallelism (tensor_parallel_size > 1).

The sharded layers first, fast and without processes: every rank's shard of a tiny random model runs in its own
thread, joined by an in-process group, and rank 0's logits must equal the unsharded model's over a prefill and
paged decode steps (uneven splits included: 3 ranks over 2 or 4 KV heads, a vocabulary that does not divide).
Then the real thing over torch.distributed (gloo, two processes): the default model's greedy tokens at
tensor_parallel_size=2 equal tensor_parallel_size=1's; the same through Ray actors; and a worker killed during
generation fails the request in bounded time, the engine reports unhealthy, and shutdown leaves no process behind.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
import torch
from test_model_families import COMMON, FAMILIES  # noqa: E402
from tiny_llama import _tokens, redraw_weights  # noqa: E402

from petrel import LLM, DisaggregatedParams, SamplingParams
from petrel.config import EngineConfig
from petrel.engine.kv_groups import split_by_window
from petrel.engine.model_runner import ForwardPlan, ModelRunner, QuerySpan
from petrel.model.loader import load_model, resolve_model
from petrel.model.parallel import TensorParallel, check_tensor_parallel

transformers = pytest.importorskip("transformers")

WAIT = 20.0  # seconds any single wait may take before the test fails


# ----------------------------------------------------------------------------- sharded layers, ranks as threads


class ThreadGroup:
    """Collectives between threads of one process, for TensorParallel ranks that run side by side."""

    def __init__(self, size: int):
        self.size, self.slots, self.barrier = size, [None] * size, threading.Barrier(size, timeout=WAIT)

    def exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = x.clone()
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()
        return parts


class ThreadRank(TensorParallel):
    def __init__(self, group: ThreadGroup, rank: int):
        super().__init__(rank, group.size)
        self.group = group

    def all_reduce(self, x):
        return x.copy_(sum(self.group.exchange(self.rank, x)))

    def all_gather(self, x):
        return torch.cat(self.group.exchange(self.rank, x), dim=-1)


def _on_ranks(size: int, fn):
    """fn(tp) on `size` threads, one per rank; returns their results in rank order."""
    group, results, errors = ThreadGroup(size), [None] * size, []

    def run(rank):
        try:
            results[rank] = fn(ThreadRank(group, rank))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    if errors:
        raise errors[0]
    return results


def _prefill_then_decode(model, cfg, tp, prompt: list[int], steps: list[int], kv_groups=None) -> list[torch.Tensor]:
    """Logits of the prompt's positions, then of each decode step, through a paged cache of blocks of 4 (with
    kv_groups: a block table per group, the 16 blocks split between them)."""
    runner = ModelRunner(
        model, cfg, num_blocks=16, block_size=4, dtype=torch.float32, device="cpu", tp=tp, kv_groups=kv_groups
    )
    n = kv_groups.num_groups if kv_groups else 1
    tables = [list(range(g * 16 // n, (g + 1) * 16 // n))[::-1] for g in range(n)]

    def span(tokens, start):
        return QuerySpan(tokens, start, tables[0], tables if n > 1 else None)

    _, prefill = runner.forward(ForwardPlan([span(prompt, 0)], list(range(len(prompt)))))
    out = [prefill]
    for i, token in enumerate(steps):
        _, logits = runner.forward(ForwardPlan([span([token], len(prompt) + i)], [0]))
        out.append(logits)
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """checkpoint(family name or None for Llama, **config) -> path of a tiny random checkpoint (cached)."""
    cache = {}

    def build(family: str | None = None, **overrides) -> str:
        key = (family, tuple(sorted(overrides.items())))
        if key not in cache:
            config_cls, model_cls, base = FAMILIES[family] if family else ("LlamaConfig", "LlamaForCausalLM", {})
            config = getattr(transformers, config_cls)(**{**COMMON, **base, **overrides})
            torch.manual_seed(0)
            hf = getattr(transformers, model_cls)(config)
            redraw_weights(hf, 0)
            path = tmp_path_factory.mktemp(family or "llama")
            hf.float().save_pretrained(path, safe_serialization=True)
            cache[key] = str(path)
        return cache[key]

    return build


SHARDED_CASES = {  # id -> (ranks, family, config overrides)
    "llama-2ranks": (2, None, dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "llama-3ranks-uneven-kv-and-vocab": (3, None, dict(num_key_value_heads=4, vocab_size=250, intermediate_size=100)),
    "llama-3ranks-gqa-tied": (3, None, dict(num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True)),
    "qwen3-bias": (2, "qwen3-bias", {}),  # biases on q/k/v and o_proj (row-parallel: added once), q/k norms
    "phi3-fused": (2, "phi3", {}),  # qkv_proj and gate_up_proj fused in the checkpoint
    "gemma3-softcap": (2, "gemma3-scaled", {}),  # Gemma's MLP, soft-capped logits after the gather, untied head
}


@pytest.mark.parametrize("case", list(SHARDED_CASES))
def test_sharded_ranks_give_the_unsharded_logits(checkpoint, case):
    size, family, overrides = SHARDED_CASES[case]
    source = resolve_model(checkpoint(family, **overrides))
    full, cfg = load_model(source, torch.float32, "cpu")
    vocab = cfg.vocab_size
    prompt, steps = _tokens(11, seed=1), [t % vocab for t in _tokens(3, seed=2)]
    prompt = [t % vocab for t in prompt]
    expected = _prefill_then_decode(full, cfg, TensorParallel(), prompt, steps)

    def rank(tp):
        model, _ = load_model(source, torch.float32, "cpu", tp=tp)
        return _prefill_then_decode(model, cfg, tp, prompt, steps)

    for got in _on_ranks(size, rank):  # every rank ends with the full logits
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, atol=2e-4, rtol=1e-4)


def test_sharded_ranks_with_kv_groups_give_the_unsharded_logits(checkpoint):
    """Gemma 3 (sliding, full, sliding, full; window 8): each rank's cache and metadata per KV group, as
    petrel/distributed/worker.py lays them out, give the logits of the unsharded model with one table."""
    source = resolve_model(checkpoint("gemma3"))
    full, cfg = load_model(source, torch.float32, "cpu")
    groups = split_by_window(cfg.sliding_windows, cfg.num_hidden_layers)
    assert groups.windows == (None, 8) and groups.layers_per_block == 2
    prompt, steps = _tokens(11, seed=1), _tokens(6, seed=2)  # 17 positions, past the window
    expected = _prefill_then_decode(full, cfg, TensorParallel(), prompt, steps)

    def rank(tp):
        model, _ = load_model(source, torch.float32, "cpu", tp=tp)
        return _prefill_then_decode(model, cfg, tp, prompt, steps, groups)

    for got in _on_ranks(2, rank):
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, atol=2e-4, rtol=1e-4)


def test_a_shard_holds_only_its_slice(checkpoint, monkeypatch):
    source = resolve_model(checkpoint(None, num_key_value_heads=2))
    monkeypatch.setenv("PETREL_F32_PANELS", "0")  # the whole model's projections as parameters (rows), as a rank's
    full, cfg = load_model(source, torch.float32, "cpu")

    def rank(tp):
        model, _ = load_model(source, torch.float32, "cpu", tp=tp)
        return sum(p.numel() for p in model.parameters())

    per_rank = _on_ranks(2, rank)
    replicated = sum(p.numel() for n, p in full.named_parameters() if "norm" in n)
    sharded = sum(p.numel() for p in full.parameters()) - replicated
    assert per_rank == [sharded // 2 + replicated] * 2


def test_too_many_ranks_and_unsupported_options_are_refused(checkpoint):
    cfg = load_model(resolve_model(checkpoint(None, num_key_value_heads=2)), torch.float32, "cpu")[1]
    with pytest.raises(ValueError, match="tensor_parallel_size=3 is larger than the model's 2 key/value heads"):
        check_tensor_parallel(cfg, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        EngineConfig(tensor_parallel_size=2, distributed_executor_backend="slurm")
    with pytest.raises(ValueError, match="enable_lora is not supported with tensor_parallel_size=2"):
        EngineConfig(tensor_parallel_size=2, enable_lora=True)
    with pytest.raises(ValueError, match="quantization 'int8' is not supported with tensor_parallel_size=2"):
        EngineConfig(tensor_parallel_size=2, quantization="int8")
    with pytest.raises(ValueError, match="tensor_parallel_size=4 is larger"):  # before any worker starts
        LLM(checkpoint(None, num_key_value_heads=2), tokenizer=_tokenizer_dir(), tensor_parallel_size=4)


# ----------------------------------------------------------------------------- worker processes (gloo)

_TOKENIZER = {}


def _tokenizer_dir() -> str:
    """The default model's tokenizer saved once, for the tiny checkpoints (which have none)."""
    if "path" not in _TOKENIZER:
        import tempfile

        from petrel.model.tokenizer import load_tokenizer

        path = tempfile.mkdtemp(prefix="petrel-tp-tokenizer-")
        load_tokenizer(resolve_model(None)).save_pretrained(path)
        _TOKENIZER["path"] = path
    return _TOKENIZER["path"]


def _greedy(llm, prompts, n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def _worker_processes() -> list[psutil.Process]:
    """This process's spawned children still running (multiprocessing's resource tracker is not one)."""
    return [p for p in psutil.Process().children(recursive=True) if "spawn_main" in " ".join(_cmdline(p))]


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


@pytest.mark.e2e
def test_two_processes_give_the_default_models_greedy_tokens(llm):
    prompts = ["The capital of France is", "Write a haiku about seabirds.", "1, 2, 3, 4,", "def fibonacci(n):"]
    expected = _greedy(llm, prompts, 24)
    tp = LLM(tensor_parallel_size=2)
    try:
        runner = tp.engine.core.runner
        assert [p.exitcode for p in runner.workers.procs] == [None]
        assert _greedy(tp, prompts, 24) == expected
    finally:
        tp.shutdown()
    assert all(not p.is_alive() for p in runner.workers.procs)


def test_a_killed_worker_fails_the_request_and_the_engine_reports_it(checkpoint):
    llm = LLM(
        checkpoint(None, num_key_value_heads=2),
        tokenizer=_tokenizer_dir(),
        tensor_parallel_size=2,
        kv_cache_memory=1 << 22,
    )
    try:
        (proc,) = llm.engine.core.runner.workers.procs
        worker = psutil.Process(proc.pid)
        llm.engine.check_health()
        with pytest.raises(ValueError, match="disaggregated_params is not supported with tensor_parallel_size=2"):
            llm.generate_async([5, 6], disaggregated_params=DisaggregatedParams(request_type="context_only"))
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        futures = [llm.generate_async([5 + i, 6, 7], long, streaming=True) for i in range(4)]
        next(iter(futures[0]))  # generation is under way
        worker.suspend()  # holds the step mid-flight (rank 0 waits in a collective) ...
        worker.kill()  # ... and dies there
        t0 = time.monotonic()
        cause = r"tensor-parallel worker 1 died \(exit code -9\)"
        for future in futures:
            with pytest.raises(RuntimeError, match=cause):
                future.result(timeout=WAIT)
        assert time.monotonic() - t0 < 10.0
        with pytest.raises(RuntimeError, match=cause):
            llm.engine.check_health()
        with pytest.raises(RuntimeError, match=cause):  # new work is refused at once
            llm.generate([5, 6], SamplingParams(max_tokens=2), use_tqdm=False)

        from fastapi.testclient import TestClient

        from petrel.serve.app import build_app

        r = TestClient(build_app(llm, health_timeout=2.0)).get("/health")
        assert r.status_code == 503 and "tensor-parallel worker 1 died" in r.json()["error"]["message"]
    finally:
        llm.shutdown()
    assert not _worker_processes()


def test_self_speculation_and_a_worker_that_dies_while_idle(checkpoint):
    """Early-exit drafts run on every rank too (greedy tokens as one process gives them); then a worker dies with
    nothing running: check_health names it, shutdown is clean."""
    path, prompts = checkpoint(None, num_key_value_heads=2), [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11]]
    with LLM(path, tokenizer=_tokenizer_dir()) as single:
        expected = _greedy(single, prompts, 12)
    llm = LLM(
        path,
        tokenizer=_tokenizer_dir(),
        tensor_parallel_size=2,
        kv_cache_memory=1 << 22,
        speculative_config={"method": "self", "draft_num_layers": 1},
    )
    try:
        (proc,) = llm.engine.core.runner.workers.procs
        assert _greedy(llm, prompts, 12) == expected
        assert llm.engine.core.num_draft_tokens > 0
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(WAIT)
        with pytest.raises(RuntimeError, match=r"tensor-parallel worker 1 died \(exit code -9\)"):
            llm.engine.check_health()
    finally:
        llm.shutdown()
    assert not _worker_processes()


def test_lookahead_trees_and_their_slot_copies_run_on_every_rank(checkpoint):
    """A lookahead step's draft tree, and the copies of its accepted nodes' K/V to their slots after it, reach every
    rank: greedy tokens are one process's plain ones."""
    path, prompts = checkpoint(None, num_key_value_heads=2), [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11]]
    with LLM(path, tokenizer=_tokenizer_dir()) as single:
        expected = _greedy(single, prompts, 40)
    spec = {"method": "lookahead", "max_window_size": 4, "max_ngram_size": 3, "max_verification_set_size": 4}
    llm = LLM(
        path, tokenizer=_tokenizer_dir(), tensor_parallel_size=2, kv_cache_memory=1 << 22, speculative_config=spec
    )
    try:
        runner, copied = llm.engine.core.runner, []
        move = runner.move_slots
        runner.move_slots = lambda copies: (copied.append(len(copies)), move(copies))
        assert _greedy(llm, prompts, 40) == expected
        assert sum(copied) > 0
    finally:
        llm.shutdown()
    assert not _worker_processes()


# ----------------------------------------------------------------------------- Ray actors


def test_ray_actors_give_the_same_tokens_and_a_dead_actor_shows(checkpoint):
    ray = pytest.importorskip("ray")
    path = checkpoint(None, num_key_value_heads=2)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    with LLM(path, tokenizer=_tokenizer_dir()) as single:
        expected = _greedy(single, prompts, 12)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        llm = LLM(path, tokenizer=_tokenizer_dir(), tensor_parallel_size=2, distributed_executor_backend="ray")
        try:
            assert _greedy(llm, prompts, 12) == expected
            workers = llm.engine.core.runner.workers
            (pid,) = workers.pids.values()
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + WAIT
            while time.monotonic() < deadline:
                try:
                    llm.engine.check_health()
                except RuntimeError as exc:
                    assert "tensor-parallel worker 1 died" in str(exc)
                    break
                time.sleep(0.1)
            else:
                pytest.fail("a dead Ray actor never showed on check_health")
        finally:
            llm.shutdown()
        assert ray.util.placement_group_table(workers.pg)["state"] == "REMOVED"
    finally:
        ray.shutdown()


# ----------------------------------------------------------------------------- Executor post-processors
STEERED: list[tuple[int, str]] = []  # (process id, thread name) of each call of _steer


def _steer(request_id, logits, beam_tokens, stream, client_id):
    STEERED.append((os.getpid(), threading.current_thread().name))
    logits[:, 100:120] += 4.0  # pulls the tokens towards 100..119


def test_post_processors_run_on_rank_0_only_and_the_workers_take_its_tokens(checkpoint):
    """LogitsPostProcessorConfig(replicate=False) at tensor_parallel_size=2: the callback runs in the engine process
    (rank 0) once per step, and the worker continues from the tokens it steered: the same tokens as one process."""
    from petrel.executor import Executor, ExecutorConfig, LogitsPostProcessorConfig, OutputConfig, Request

    path = checkpoint(None, num_key_value_heads=2)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]

    def run(ranks: int) -> tuple[list, list]:
        config = EngineConfig.from_kwargs(
            model=path, tokenizer=_tokenizer_dir(), tensor_parallel_size=ranks, kv_cache_memory=1 << 22
        )
        lpp = LogitsPostProcessorConfig({"steer": _steer}, replicate=False)
        with Executor(config, ExecutorConfig(logits_post_processor_config=lpp)) as ex:
            if ranks > 1:
                assert len(ex.engine.core.runner.workers.procs) == ranks - 1
            out = {}
            for name in ("steer", None):
                ids = [
                    ex.enqueue_request(
                        Request(
                            p,
                            8,
                            end_id=255,
                            logits_post_processor_name=name,
                            output_config=OutputConfig(False, False, False, True),
                        )
                    )
                    for p in prompts
                ]
                out[name] = [ex.await_responses(i, timeout=WAIT)[-1].result.output_token_ids[0] for i in ids]
        return out["steer"], out[None]

    STEERED.clear()
    steered, plain = run(1)
    assert steered != plain and sum(100 <= t < 120 for tokens in steered for t in tokens) > 8
    STEERED.clear()
    assert run(2) == (steered, plain)
    assert len(STEERED) == 2 * 8 and {pid for pid, _ in STEERED} == {os.getpid()}  # rank 0, once per step
    assert {name for _, name in STEERED} == {"petrel-engine"}
