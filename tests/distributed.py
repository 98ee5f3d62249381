"""Multi-process test harness: run ``worker(rank, world, *args)`` on ``world`` ranks, gloo on
CPUs or NCCL with one GPU per rank."""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moec.runtime.distributed import NO_MULTICAST_ENV


def free_port() -> int:
    """A port the OS just handed out (fewer collisions than scanning a fixed range)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, worker, world: int, port: int, backend: str, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **NO_MULTICAST_ENV)
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        worker(rank, world, *args)
        dist.barrier()  # no rank tears its group down while another still talks to it
    finally:
        dist.destroy_process_group()
    # A rank that got here passed. Leave without the interpreter's teardown: under load a
    # process-group thread still being destroyed there aborted the process ("terminate called
    # without an active exception"), failing a test whose checks had all passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(worker, world: int, *args, backend: str = "gloo") -> None:
    mp.spawn(_entry, args=(worker, world, free_port(), backend, args), nprocs=world, join=True)
