"""Tensor parallelism's processes: the engine process is rank 0 and starts ranks 1..N-1 as local processes ('mp')
or Ray actors ('ray'); each step's forward plan goes to every rank and all run it together.

    group.py        joining torch.distributed (gloo on CPU, NCCL on CUDA), threads and devices per rank
    worker.py       a rank outside the engine process: its model shard, its runner, its message loop
    workers.py      the interface rank 0 drives ranks 1..N-1 through, whichever way they run
    mp_workers.py   ranks as local processes, driven over pipes
    ray_workers.py  ranks as Ray actors in a placement group
    runner.py       rank 0's ModelRunner, which sends each plan to the others before running it, and
                    start_workers, which starts ranks 1..N-1 the configured way
"""
