"""Rank 0's model runner, in the engine process: the engine core drives it as it drives the single-process runner,
and it sends each forward plan to the other ranks before running its own part (their collectives meet inside the
model). Only rank 0's logits reach the sampler."""
from __future__ import annotations

from petrel.engine.model_runner import ExecutorDied, ForwardPlan, ModelRunner

DEATH_WAIT_S = 5.0   # after a failed collective: how long to wait for a peer's death to show before naming it


class Workers:
    """Ranks 1..N-1, whichever way they run (ProcessWorkers, RayWorkers). `tp` is rank 0's TensorParallel."""
    tp = None

    def wait_ready(self) -> None:
        """Block until every rank has loaded its shard; RuntimeError naming a rank that failed to."""
        raise NotImplementedError

    def send(self, plan: ForwardPlan) -> None:
        """Hand a plan to every rank (they run it as soon as they get it); ExecutorDied if one is gone."""
        raise NotImplementedError

    def dead_worker(self, wait: float = 0.0) -> str | None:
        """'tensor-parallel worker R died (...)' for a rank that has died (waiting up to `wait` s for one), or None."""
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError


def start_workers(config, source) -> Workers:
    """Start ranks 1..N-1 and join the group as rank 0 (the caller then loads rank 0's shard)."""
    if config.distributed_executor_backend == "ray":
        from petrel.distributed.ray_workers import RayWorkers
        return RayWorkers(config, source)
    from petrel.distributed.mp_workers import ProcessWorkers
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
