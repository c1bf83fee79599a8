"""Joining and leaving the tensor-parallel process group, and what each rank runs on."""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from petrel.model.parallel import TensorParallel

TIMEOUT_ENV = "PETREL_TP_TIMEOUT"  # seconds a collective may wait for the other ranks (a hung peer, not a dead one)
DEFAULT_TIMEOUT_S = 120.0


def collective_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))


def join_group(rank: int, size: int, init_method: str, device: str, expert_parallel: bool = False) -> TensorParallel:
    """Join torch.distributed's default group (gloo on CPU, NCCL on CUDA); returns this rank's TensorParallel
    (expert_parallel: a mixture of experts' ranks hold whole experts). A dead peer's closed connection fails a gloo
    collective at once; the timeout bounds a peer that hangs."""
    if dist.is_initialized():
        raise RuntimeError(
            "this process is already in a torch.distributed group: one tensor-parallel engine per process"
        )
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=size, timeout=collective_timeout()
    )
    return TensorParallel(rank, size, expert_parallel)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port(host: str) -> int:
    """A TCP port free on `host` now (rank 0 listens there for the others to join)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def threads_per_rank(config) -> int:
    """torch threads for one rank: num_threads when given, else this machine's cores shared by the ranks."""
    if config.num_threads:
        return config.num_threads
    return max(1, len(os.sched_getaffinity(0)) // config.tensor_parallel_size)


def local_rank_device(device: str, rank: int) -> str:
    """The device of a rank on the engine's own machine: CUDA ranks take consecutive GPUs from the engine's."""
    d = torch.device(device)
    if d.type != "cuda":
        return device
    first = d.index or 0
    if first + rank >= torch.cuda.device_count():
        raise ValueError(
            f"tensor_parallel_size needs GPU {first + rank} for rank {rank}; "
            f"this machine has {torch.cuda.device_count()}"
        )
    return f"cuda:{first + rank}"
