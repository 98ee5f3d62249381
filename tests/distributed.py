"""Multi-process test harness: run ``worker(rank, world, *args)`` on ``world`` ranks, gloo on
CPUs or NCCL with one GPU per rank.

Gloo ranks are forked from a fork server that imported torch, transformers and moec once per
test session (a spawned rank spent seconds importing them again: ~10 s for four ranks on two
cores). The server started from a clean interpreter, not from the pytest process, so a rank
starts as a spawned one would: no test's state, the parent's environment of the moment (passed
along), its own random seeds (torch's and Python's ``random``). NCCL ranks are spawned: a fork
server may have touched CUDA while importing. ``fresh=True`` spawns gloo ranks too, for a test of
a rank's peak RSS: a forked rank faults in the pages of the libraries it runs as it goes (they
count as growth), where a spawned one touched them while importing.
"""

import multiprocessing
import os
import socket
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moec.runtime.distributed import NO_MULTICAST_ENV

_PRELOAD = ["torch", "torch.distributed", "transformers", "moec", "moec.train", "tests.distributed"]


def free_port() -> int:
    """A port the OS just handed out (fewer collisions than scanning a fixed range)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, worker, world: int, port: int, backend: str, args: tuple, env: dict[str, str]
) -> None:
    os.environ.clear()  # the fork server's environment is that of the session's first spawn
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **NO_MULTICAST_ENV)
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    torch.seed()  # a forked rank has the server's generator state; a spawned one seeds at random
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        worker(rank, world, *args)
    except BaseException:
        # printed here: the other ranks then fail at the barrier ("connection closed by peer"),
        # and the spawner may report one of those instead of this, the cause
        print(f"rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    else:
        dist.barrier()  # no rank tears its group down while another still talks to it
    finally:
        dist.destroy_process_group()
    # A rank that got here passed. Leave without the interpreter's teardown: under load a
    # process-group thread still being destroyed there aborted the process ("terminate called
    # without an active exception"), failing a test whose checks had all passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(worker, world: int, *args, backend: str = "gloo", fresh: bool = False) -> None:
    method = "spawn" if backend == "nccl" or fresh else "forkserver"
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(_PRELOAD)  # read when the server first starts
    mp.start_processes(
        _entry,
        args=(worker, world, free_port(), backend, args, dict(os.environ)),
        nprocs=world,
        join=True,
        start_method=method,
    )
