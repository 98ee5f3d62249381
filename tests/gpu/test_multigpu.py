"""Several GPUs (NCCL, one process per GPU): expert parallelism on every path, the rowwise
symmetric-memory transport included, equals EP = 1; a steady-state EP training step on the
rowwise path never waits for the device: CUDA's sync debug mode raises nothing, and the profiler
trace of the step holds no stream/event/device synchronize and no device-to-host copy (the
report's B.6 check), while the same trace of a step that reads its loss on the host shows the
wait (the check's positive control; the synchronized ``sync_1d`` baseline is a benchmark's now,
``benchmarks/ep.py``).

Runs for every world of 2, 4 and 8 that the machine's GPUs allow; on one GPU only the rowwise
transport with a group of one rank (every route pushed to itself through symmetric memory).
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from moec.plan import Plan
from moec.runtime.metrics import run_without_host_sync
from moec.train import DEMO_PLAN, TrainConfig, Trainer, demo_model
from tests import test_ep
from tests.distributed import spawn

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORLDS = [w for w in (2, 4, 8) if w <= GPUS] or [2]
pytestmark = pytest.mark.gpu
multigpu = pytest.mark.skipif(GPUS < 2, reason="needs 2 or more CUDA devices")

OPS_CASES = [  # (path, capacity factor, poison[, split]); cf = 4.0 = N/K never binds, 0.6 binds
    ("rowwise", 4.0, True),
    ("rowwise", 0.6, True),  # the rank capacity drops routes: EP = 1 without them
    ("rowwise", 4.0, True, True),  # pass overlap's issue/wait ops, on the comm stream
    ("a2a_capacity", 0.6, True),
    ("sync_1d", 4.0, False),
]
HOST_WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")


def _equal_worker(rank: int, world: int) -> None:
    device = torch.device("cuda", rank)
    for case in OPS_CASES:  # float64: the transports exactly
        test_ep._ops_worker(rank, world, *case, device=device)
    test_ep._llama_worker(rank, world, ("rowwise", "a2a_capacity"), device)


def _rowwise_layer_step(device: torch.device, world: int, split: bool = False):
    """One bf16 MoE layer on the rowwise path, forward and backward (router included);
    ``split``: its exchanges as pass overlap's issue and wait ops."""
    n, k, cf = 8, 2, 1.25
    tokens, dim, hidden = 512, 128, 64
    leaf = {"device": device, "dtype": torch.bfloat16, "requires_grad": True}
    x = torch.randn(tokens, dim, **leaf)
    gate = (torch.randn(dim, n, device=device) * 0.1).requires_grad_()
    w_up = (torch.randn(n // world, dim, 2 * hidden, **leaf) * 0.1).detach().requires_grad_()
    w_down = (torch.randn(n // world, hidden, dim, **leaf) * 0.1).detach().requires_grad_()
    grad = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16)

    def step() -> None:
        logits = x.float() @ gate
        _, weights, rows, offsets, _ = torch.ops.moec.route(
            logits, k, cf, "softmax", True, "learned"
        )
        out, _, _ = test_ep.rowwise_layer(x, weights, rows, offsets, (w_up, w_down), cf, split)
        out.backward(grad)

    return step


def _one_gpu_worker(rank: int, world: int) -> None:
    device = torch.device("cuda", rank)
    for case in OPS_CASES:
        if case[0] == "rowwise":
            test_ep._ops_worker(rank, world, *case, device=device)
    for split in (False, True):
        step = _rowwise_layer_step(device, world, split)
        step()  # compiles the kernels, makes the symmetric workspaces
        run_without_host_sync(step, 2)


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device")
def test_rowwise_transport_on_one_gpu():
    """Ops at EP = 1 through the rowwise transport equal the plain ops (drops included), and a
    bf16 layer step on it (router, layout, every exchange, both directions) never syncs."""
    spawn(_one_gpu_worker, 1, backend="nccl")


@multigpu
@pytest.mark.parametrize("world", WORLDS)
def test_ep_equals_ep1_on_every_path(world):
    """Ops (outputs, drops, every gradient; poisoned buffers) and the compiled Llama (outputs,
    loss, reduced gradients) at EP = world against EP = 1."""
    spawn(_equal_worker, world, backend="nccl")


def host_waits(step) -> collections.Counter:
    """Synchronizing CUDA runtime calls made while ``step`` runs, and device-to-host copies, in
    the profiler trace of one ``step``. Calls outside the step's window are the profiler's own
    (it synchronizes the device when it stops)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        with record_function("moec_step"):
            step()
    events = trace.events()
    window = next(e.time_range for e in events if e.name == "moec_step")
    return collections.Counter(
        e.name
        for e in events
        if "DtoH" in e.name
        or (e.name in HOST_WAITS and window.start <= e.time_range.start <= window.end)
    )


def _trainer(world: int, path: str, out: str, dp_shard: int = 1, ep: int | None = None) -> Trainer:
    ep = world if ep is None else ep
    plan = Plan.from_dict(
        {
            **DEMO_PLAN,
            "parallel": {"dp": world, "ep": ep, "ep_path": path, "dp_shard": dp_shard},
            "precision": {"compute_dtype": "bf16"},
        }
    )
    torch.manual_seed(0)  # the same dense init on every rank
    device = f"cuda:{torch.cuda.current_device()}"
    cfg = TrainConfig(steps=10, batch_size=16, seq_len=128, device=device, out=out, plots=False)
    return Trainer(demo_model(), plan, cfg)


def _sync_worker(rank: int, world: int, out: str) -> None:
    rowwise = _trainer(world, "rowwise", f"{out}/rowwise")
    assert rowwise.compiled.pass_results["expert_parallel"].stats["path"] == "rowwise"
    for _ in range(3):
        rowwise.train_step()
    losses = run_without_host_sync(rowwise.train_step, 2)
    assert all(torch.isfinite(loss) for loss in losses)
    waits = host_waits(rowwise.train_step)
    assert not waits, f"rank {rank}: the rowwise step waited for the device: {dict(waits)}"

    waits = host_waits(lambda: float(rowwise.train_step()))  # the loss read on the host
    assert sum(n for name, n in waits.items() if "DtoH" in name) >= 1, dict(waits)


@multigpu
@pytest.mark.parametrize("world", WORLDS[-1:])
def test_rowwise_ep_step_is_sync_free_and_a_host_read_is_seen(world, tmp_path):
    spawn(_sync_worker, world, str(tmp_path), backend="nccl")


def _fsdp_sync_worker(rank: int, world: int, out: str, ep: int) -> None:
    sharded = _trainer(world, "rowwise", out, dp_shard=world, ep=ep)
    layout = sharded.compiled.program.data_parallel
    assert layout is not None and bool(layout.expert_groups) == (ep < world)
    for _ in range(3):
        sharded.train_step()
    losses = run_without_host_sync(sharded.train_step, 2)
    assert all(torch.isfinite(loss) for loss in losses)
    waits = host_waits(sharded.train_step)
    assert not waits, f"rank {rank}: the FSDP + rowwise step waited for the device: {dict(waits)}"


@multigpu
@pytest.mark.parametrize("world", WORLDS[-1:])
@pytest.mark.parametrize("experts", ["ep", "edp"])
def test_fsdp_rowwise_ep_step_is_sync_free(world, experts, tmp_path):
    """FSDP2 over the dense parameters (all-gather, reduce-scatter, sharded AdamW and clipping)
    with rowwise EP over every rank, or with the experts sharded over the expert-data-parallel
    ranks (EP = 1): no host sync in a steady-state step."""
    ep = world if experts == "ep" else 1
    spawn(_fsdp_sync_worker, world, str(tmp_path), ep, backend="nccl")
