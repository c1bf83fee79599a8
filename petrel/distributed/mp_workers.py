"""Ranks 1..N-1 as local processes (distributed_executor_backend='mp'), each driven over a pipe.

Workers are spawned (not forked: the engine process has threads) as daemon processes, so they end with the engine
process; a worker whose pipe closes exits too. A dead worker is seen through its process sentinel."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import pickle

from petrel.distributed.group import collective_timeout, free_port, join_group, leave_group, local_rank_device
from petrel.distributed.worker import WorkerSpec, run_process_worker
from petrel.distributed.workers import Workers
from petrel.engine.model_runner import ExecutorDied, ForwardPlan

STOP_WAIT_S = 10.0  # a worker told to stop gets this long before it is killed


class ProcessWorkers(Workers):
    def __init__(self, config, source):
        ctx = multiprocessing.get_context("spawn")
        host = "127.0.0.1"
        init_method = f"tcp://{host}:{free_port(host)}"
        self.procs, self.conns = [], []
        self._stopped = False
        try:
            for rank in range(1, config.tensor_parallel_size):
                parent, child = ctx.Pipe()
                spec = WorkerSpec(config, source, rank, init_method, local_rank_device(config.device, rank))
                proc = ctx.Process(
                    target=run_process_worker, args=(spec, child), name=f"petrel-tp-worker-{rank}", daemon=True
                )
                proc.start()
                child.close()
                self.procs.append(proc)
                self.conns.append(parent)
            self._expect("hello")  # imported and about to join: a worker that cannot start fails here, not in a wait
            self.tp = join_group(
                0, config.tensor_parallel_size, init_method, config.device, config.enable_expert_parallel
            )
        except BaseException:
            self.shutdown()
            raise

    def _expect(self, kind: str) -> None:
        timeout = collective_timeout().total_seconds()
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), 1):
            ready = multiprocessing.connection.wait([conn, proc.sentinel], timeout)
            if conn in ready:
                try:
                    message = conn.recv()
                except EOFError:
                    message = None
                if message is not None and message[0] == kind:
                    continue
                if message is not None and message[0] == "error":
                    raise RuntimeError(f"tensor-parallel worker {rank} failed to start: {message[1]}")
            if not ready:
                raise RuntimeError(f"tensor-parallel worker {rank} did not start within {timeout:.0f} s")
            proc.join(1.0)
            raise RuntimeError(f"tensor-parallel worker {rank} died while starting (exit code {proc.exitcode})")

    def wait_ready(self) -> None:
        try:
            self._expect("ready")
        except BaseException:
            self.shutdown()
            raise

    def send(self, plan: ForwardPlan) -> None:
        message = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)  # once for every worker (conn.recv reads it)
        for conn in self.conns:
            try:
                conn.send_bytes(message)
            except OSError:  # a closed pipe: the worker is gone
                raise ExecutorDied(self.dead_worker(1.0) or "a tensor-parallel worker's pipe closed") from None

    def dead_worker(self, wait: float = 0.0) -> str | None:
        if self._stopped:
            return None
        ended = multiprocessing.connection.wait([p.sentinel for p in self.procs], wait)
        for rank, proc in enumerate(self.procs, 1):
            if proc.sentinel in ended:
                proc.join(1.0)  # the sentinel closes a moment before the process can be reaped for its exit code
                return f"tensor-parallel worker {rank} died (exit code {proc.exitcode})"
        return None

    def shutdown(self) -> None:
        """Tell every worker to stop, kill any that does not within STOP_WAIT_S, leave the group. Idempotent."""
        self._stopped = True
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(STOP_WAIT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self.conns = []
        leave_group()
