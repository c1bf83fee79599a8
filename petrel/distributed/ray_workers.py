"""Ranks 1..N-1 as Ray actors (distributed_executor_backend='ray'), one placement-group bundle per rank.

The engine process joins the Ray cluster at RAY_ADDRESS when that is set (a multi-node cluster started with
`ray start`), else starts a local one; when Ray was initialised before, that connection is used as is. Bundle 0 is
rank 0's, pinned to the engine's node so its resources are counted; bundles 1..N-1 hold the actors, packed onto as
few nodes as fit. Rank 0 listens for the group on its node's IP. Each actor runs its calls one at a time, in the
order sent. A dead actor fails its outstanding calls with RayActorError, which is how its death is noticed: each
actor always has a ping outstanding, so a death shows even while the engine is idle."""

from __future__ import annotations

import os

import torch

from petrel.distributed.group import collective_timeout, free_port, join_group, leave_group
from petrel.distributed.worker import Worker, WorkerSpec
from petrel.distributed.workers import Workers
from petrel.engine.model_runner import ExecutorDied, ForwardPlan

PLACEMENT_WAIT_S = 60.0  # for the cluster to find room for every rank's bundle
STOP_WAIT_S = 10.0


class RayWorker:
    """The actor (wrapped by ray.remote when the backend starts, Ray being an optional dependency)."""

    def __init__(self, spec: WorkerSpec):
        self.worker = Worker(spec)

    def start(self) -> int:
        self.worker.join()
        self.worker.load()
        return os.getpid()

    def forward(self, plan: ForwardPlan) -> None:
        self.worker.forward(plan)

    def ping(self) -> None:
        pass

    def stop(self) -> None:
        self.worker.close()


class RayWorkers(Workers):
    def __init__(self, config, source):
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise ValueError("distributed_executor_backend='ray' needs Ray: pip install 'petrel[ray]'") from None
        self.ray = ray
        self._own_ray = not ray.is_initialized()
        if self._own_ray:
            address = os.environ.get("RAY_ADDRESS")
            ray.init(address=address) if address else ray.init(include_dashboard=False)
        self.actors, self.pending, self.pings, self.pids = [], [], {}, {}
        self.pg = None
        self._stopped = False
        try:
            size = config.tensor_parallel_size
            gpu = torch.device(config.device).type == "cuda"
            ip = ray.util.get_node_ip_address()
            bundle = {"CPU": 1, **({"GPU": 1} if gpu else {})}
            self.pg = placement_group([{**bundle, f"node:{ip}": 0.001}] + [bundle] * (size - 1), strategy="PACK")
            try:
                ray.get(self.pg.ready(), timeout=PLACEMENT_WAIT_S)
            except ray.exceptions.GetTimeoutError:
                raise RuntimeError(
                    f"the Ray cluster found no room for {size} bundles of {bundle} (one per "
                    f"tensor-parallel rank) within {PLACEMENT_WAIT_S:.0f} s; `ray status` shows "
                    "its resources"
                ) from None
            init_method = f"tcp://{ip}:{free_port(ip)}"
            actor_class = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0)(RayWorker)
            device = "cuda:0" if gpu else config.device  # Ray shows an actor only its own GPU
            for rank in range(1, size):
                strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank)
                self.actors.append(
                    actor_class.options(scheduling_strategy=strategy, name=None).remote(
                        WorkerSpec(config, source, rank, init_method, device)
                    )
                )
            self.started = [actor.start.remote() for actor in self.actors]
            self.tp = join_group(0, size, init_method, config.device, config.enable_expert_parallel)
        except BaseException:
            self.shutdown()
            raise

    def wait_ready(self) -> None:
        try:
            for rank, ref in enumerate(self.started, 1):
                try:
                    self.pids[rank] = self.ray.get(ref, timeout=collective_timeout().total_seconds())
                except Exception as exc:  # noqa: BLE001 - named in the error
                    raise RuntimeError(f"tensor-parallel worker {rank} failed to start: {_first_line(exc)}") from None
            self.pings = {rank: actor.ping.remote() for rank, actor in enumerate(self.actors, 1)}
        except BaseException:
            self.shutdown()
            raise

    def send(self, plan: ForwardPlan) -> None:
        failed = self._collect(0.0)
        if failed:
            raise ExecutorDied(failed)
        self.pending.extend((rank, actor.forward.remote(plan)) for rank, actor in enumerate(self.actors, 1))

    def dead_worker(self, wait: float = 0.0) -> str | None:
        if self._stopped:
            return None
        failure = self._collect(wait)
        if failure is None:  # a finished ping is sent again: a death shows on the next check
            for rank, actor in enumerate(self.actors, 1):
                if self.pings.get(rank) is None:
                    self.pings[rank] = actor.ping.remote()
        return failure

    def _collect(self, wait: float) -> str | None:
        """Take the results of the calls that have finished (forwards and pings), waiting up to `wait` s for all of
        them; the first failure, naming its rank, or None."""
        ray = self.ray
        outstanding = {ref: rank for rank, ref in self.pending} | {
            ref: rank for rank, ref in self.pings.items() if ref is not None
        }
        if not outstanding:
            return None
        ready, _ = ray.wait(list(outstanding), num_returns=len(outstanding), timeout=wait)
        failure = None
        for ref in ready:
            rank = outstanding.pop(ref)
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                failure = failure or f"tensor-parallel worker {rank} died (its Ray actor is gone: {_first_line(exc)})"
            except Exception as exc:  # noqa: BLE001 - its forward raised
                failure = failure or f"tensor-parallel worker {rank} failed: {_first_line(exc)}"
        self.pending = [(rank, ref) for rank, ref in self.pending if ref in outstanding]
        self.pings = {rank: ref if ref in outstanding else None for rank, ref in self.pings.items()}
        return failure

    def shutdown(self) -> None:
        """Stop and kill the actors, free the placement group, leave the group; Ray itself too when it was started
        here. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        ray = self.ray
        stops = [actor.stop.remote() for actor in self.actors]
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=STOP_WAIT_S)
        for actor in self.actors:
            ray.kill(actor)
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
        leave_group()
        if self._own_ray:
            ray.shutdown()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]
