"""A tensor-parallel rank outside the engine process: it joins the group, loads its shard of the model with its own
slice of the paged KV cache, then runs every forward plan the engine sends, in order. It samples nothing: the
engine's rank 0 has the full logits (the LM head gathers them on every rank)."""

from __future__ import annotations

import signal
import traceback
from dataclasses import dataclass

import torch

from petrel.config import EngineConfig
from petrel.distributed.group import join_group, leave_group, threads_per_rank
from petrel.engine.attention_windows import apply_attention_windows
from petrel.engine.kv_groups import kv_groups_for
from petrel.engine.model_runner import ForwardPlan, ModelRunner, num_kv_blocks
from petrel.model.loader import ModelSource, load_model


@dataclass
class WorkerSpec:
    config: EngineConfig
    source: ModelSource
    rank: int
    init_method: str  # tcp://host:port where rank 0 waits for the group to form
    device: str


class Worker:
    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        torch.set_num_threads(threads_per_rank(spec.config))
        self.tp = None

    def join(self) -> None:
        config = self.spec.config
        self.tp = join_group(
            self.spec.rank,
            config.tensor_parallel_size,
            self.spec.init_method,
            self.spec.device,
            config.enable_expert_parallel,
        )

    def load(self) -> None:
        config, device = self.spec.config, self.spec.device
        model, cfg = load_model(self.spec.source, config.torch_dtype, device, tp=self.tp)
        apply_attention_windows(model, cfg, config)  # as rank 0's engine does
        groups, _ = kv_groups_for(config, cfg)  # as rank 0's engine lays out its cache
        self.runner = ModelRunner(
            model,
            cfg,
            num_kv_blocks(config, cfg, groups.layers_per_block),
            config.block_size,
            config.torch_dtype,
            device,
            tp=self.tp,
            kv_groups=groups,
            kv_cache_dtype=config.kv_cache_torch_dtype,
        )

    def forward(self, plan: ForwardPlan) -> None:
        self.runner.forward(plan)

    def close(self) -> None:
        leave_group()


def run_process_worker(spec: WorkerSpec, conn) -> None:
    """A worker process's life ('mp' backend): ("hello",) once imported, ("ready",) or ("error", text) once loaded,
    then a forward per plan received until None (shutdown) or the pipe closes (the engine process is gone).
    Ctrl-C in the terminal reaches every process of the group: the worker leaves it to the engine, which may be
    draining its requests, to say when to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    worker = Worker(spec)
    conn.send(("hello",))
    try:
        worker.join()
        worker.load()
    except BaseException as exc:  # noqa: BLE001 - told to the engine, which reports it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    conn.send(("ready",))
    while True:
        try:
            plan = conn.recv()
        except (EOFError, OSError):
            break
        if plan is None:
            break
        try:
            worker.forward(plan)
        except BaseException:
            traceback.print_exc()  # the engine sees this rank die and fails its requests, naming the exit code
            raise SystemExit(1) from None
    worker.close()
