"""What rank 0 needs of ranks 1..N-1, however they run: the interface ProcessWorkers (mp_workers.py) and RayWorkers
(ray_workers.py) implement and TensorParallelRunner (runner.py) drives. It lives apart from both sides so that
neither imports the other."""

from __future__ import annotations

from petrel.engine.model_runner import ForwardPlan


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
