"""Rank 0's model runner, in the engine process: the engine core drives it as it drives the single-process runner,
and it sends each forward plan to the other ranks before running its own part (their collectives meet inside the
model). Only rank 0's logits reach the sampler."""

from __future__ import annotations

from petrel.distributed.mp_workers import ProcessWorkers
from petrel.distributed.ray_workers import RayWorkers
from petrel.distributed.workers import Workers
from petrel.engine.model_runner import ExecutorDied, ForwardPlan, ModelRunner

DEATH_WAIT_S = 5.0  # after a failed collective: how long to wait for a peer's death to show before naming it


def start_workers(config, source) -> Workers:
    """Start ranks 1..N-1 and join the group as rank 0 (the caller then loads rank 0's shard)."""
    if config.distributed_executor_backend == "ray":
        return RayWorkers(config, source)
    return ProcessWorkers(config, source)


class TensorParallelRunner(ModelRunner):
    def __init__(self, workers: Workers, *args, **kwargs):
        super().__init__(*args, tp=workers.tp, **kwargs)
        self.workers = workers
        workers.wait_ready()
        self.failed: str | None = None

    def forward(self, plan: ForwardPlan):
        if self.failed is not None:
            raise ExecutorDied(self.failed)
        try:
            self.workers.send(plan)
            return super().forward(plan)
        except Exception as exc:
            # the ranks may now be out of step (some ran the plan, some did not): no later step can be trusted
            self.failed = self.workers.dead_worker(DEATH_WAIT_S) or f"tensor-parallel step failed: {exc}"
            raise ExecutorDied(self.failed) from exc

    def check_health(self) -> None:
        if self.failed is None:
            self.failed = self.workers.dead_worker()
        if self.failed is not None:
            raise ExecutorDied(self.failed)

    def shutdown(self) -> None:
        self.workers.shutdown()
