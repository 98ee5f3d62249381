"""Multi-process test harness: run ``worker(rank, world, *args)`` on ``world`` gloo ranks."""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A port the OS just handed out (fewer collisions than scanning a fixed range)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, worker, world: int, port: int, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        worker(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn(worker, world: int, *args) -> None:
    mp.spawn(_entry, args=(worker, world, free_port(), args), nprocs=world, join=True)
