"""Process groups, gradient reduction and sharded optimizers for data + expert parallel training.

The mesh is ``init_device_mesh(device, (dp // ep, ep), mesh_dim_names=("edp", "ep"))``: EP groups
are ``ep`` consecutive ranks (one node's NVLink domain on GPUs), and the ranks holding the same
experts form the expert-data-parallel (``edp``) group of size ``dp / ep``. Under torchrun::

    mesh = init_from_env(plan)                       # NCCL on GPUs, gloo on CPUs
    model = moec.compile(dense, plan, example_inputs, mesh=mesh)
    reducer = GradientReducer(model, mesh)           # hooks fire during backward
    optimizer = build_optimizer(model, mesh, torch.optim.AdamW, zero=True, lr=1e-3)
    loss.backward(); reducer.finish(); optimizer.step(); optimizer.zero_grad()

Gradients are averaged over the data-parallel ranks: dense (and router) parameters are
all-reduced over the whole DP group; expert parameters over the ``edp`` group, since the EP
exchange's backward already summed the contributions of every token of the EP group. Both are
divided by ``dp``, so the result equals EP = 1 data parallel with every rank's batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from moec.errors import MoecError
from moec.plan import Plan
from moec.program import EPGroup

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class DistributedError(MoecError, RuntimeError):
    """A process-group or mesh setup that cannot work; the message says what to change."""


@dataclasses.dataclass
class MoEMesh:
    """The (edp, ep) device mesh and the groups the runtime reduces over."""

    device_mesh: DeviceMesh
    dp_group: dist.ProcessGroup
    ep_group: dist.ProcessGroup
    edp_group: dist.ProcessGroup
    ep_info: EPGroup
    fsdp_mesh: DeviceMesh | None = None
    """The data-parallel mesh FSDP2 shards the dense parameters over (parallel.dp_shard > 1):
    ``("dp_shard",)``, or ``("dp_replicate", "dp_shard")`` for HSDP."""
    expert_fsdp_mesh: DeviceMesh | None = None
    """The expert-data-parallel mesh FSDP2 shards expert slices over (parallel.dp_shard > 1
    and dp > ep): the ``edp`` dimension, the ranks holding the same experts."""

    @property
    def dense_shard_group(self) -> dist.ProcessGroup | None:
        """The ranks among which each dense parameter is split (None: dense replicated)."""
        return None if self.fsdp_mesh is None else self.fsdp_mesh.get_group("dp_shard")

    @property
    def dp(self) -> int:
        return dist.get_world_size(self.dp_group)


NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
"""Environment that keeps NVLink multicast off in NCCL, symmetric memory and NVSHMEM (needed on
shared hosts, where a program using it can take the host's GPUs out of service); the tests and
benchmarks set it, :func:`join_process_group` does not."""


def join_process_group(backend: str | None = None) -> None:
    """Join the torchrun job (if not joined yet): this process's GPU is ``LOCAL_RANK``'s, NCCL on
    GPUs, gloo on CPUs."""
    if dist.is_initialized():
        return
    missing = [name for name in TORCHRUN_VARS if name not in os.environ]
    if missing:
        raise DistributedError(
            f"joining the job needs the torchrun environment ({', '.join(missing)} unset): "
            "launch with `torchrun --nproc-per-node N script.py`, or call "
            "torch.distributed.init_process_group yourself and then build_mesh(plan)"
        )
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend or ("nccl" if cuda else "gloo"))


def init_from_env(plan: Plan, backend: str | None = None) -> MoEMesh:
    """Join the torchrun job (if not joined yet) and build the mesh for ``plan``."""
    join_plan_job(plan, backend)
    return build_mesh(plan)


def join_plan_job(plan: Plan, backend: str | None = None) -> None:
    """Join the torchrun job of ``plan``'s ``dp x pp`` processes (if not joined yet); outside
    torchrun, say how to launch it."""
    missing = [name for name in TORCHRUN_VARS if name not in os.environ]
    if missing and not dist.is_initialized():
        p = plan.parallel
        ranks = p.dp * p.pp
        raise DistributedError(
            f"plan parallel.dp={p.dp} x parallel.pp={p.pp} (parallel.ep={p.ep}) runs {ranks} "
            f"processes, but this one was not started by torchrun ({', '.join(missing)} unset): "
            f"launch with `torchrun --nproc-per-node {ranks} -m moec train ...` (or your script "
            "in place of `-m moec ...`), or set parallel.dp, parallel.ep and parallel.pp to 1 "
            "for one process"
        )
    join_process_group(backend)


def build_mesh(plan: Plan, device_type: str | None = None) -> MoEMesh:
    """The (edp, ep) mesh over the default process group; checks the plan against the world."""
    if not dist.is_initialized():
        raise DistributedError(
            "no process group: call moec.runtime.distributed.init_from_env(plan) under torchrun "
            "(or torch.distributed.init_process_group) before building the mesh"
        )
    world, p = dist.get_world_size(), plan.parallel
    if p.pp != 1:
        raise DistributedError(f"parallel.pp={p.pp}: pipeline parallel meshes are not built here")
    if world % p.ep:
        raise DistributedError(f"parallel.ep={p.ep} does not divide the world size {world}")
    if world != p.dp:
        raise DistributedError(f"parallel.dp={p.dp} but the job has {world} ranks; set dp={world}")
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device_type, (world // p.ep, p.ep), mesh_dim_names=("edp", "ep"))
    ep_group = mesh.get_group("ep")
    info = EPGroup(mesh.get_local_rank("ep"), p.ep, ep_group.group_name, device_type)
    fsdp_mesh = None
    if p.dp_shard > 1:
        shape, names = fsdp_mesh_dims(plan)
        fsdp_mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    expert_fsdp_mesh = mesh["edp"] if p.shards_experts else None
    return MoEMesh(
        mesh, dist.group.WORLD, ep_group, mesh.get_group("edp"), info, fsdp_mesh, expert_fsdp_mesh
    )


def fsdp_mesh_dims(plan: Plan) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Shape and names of the data-parallel ranks' FSDP mesh: ``("dp_shard",)``, or
    ``("dp_replicate", "dp_shard")`` for HSDP (consecutive ranks share a shard group)."""
    p = plan.parallel
    if p.dp == p.dp_shard:
        return (p.dp_shard,), ("dp_shard",)
    return (p.dp // p.dp_shard, p.dp_shard), ("dp_replicate", "dp_shard")


def parameter_groups(module: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(dense, expert) trainable parameters of ``module`` (a module running a program: the
    ``CompiledModel`` or a pipeline stage) by their role in its program."""
    program = getattr(module, "program", None)
    if program is None:
        raise DistributedError(
            "parameter roles are unknown: compile with example inputs (or run one forward) "
            "before building the reducer or optimizer"
        )
    dense, expert = [], []
    for name, param in module.named_parameters():
        if param.requires_grad:
            role = program.role(name.removeprefix("graph_module."))
            (expert if role == "expert" else dense).append(param)
    return dense, expert


def global_grad_norm(
    dense: list[nn.Parameter],
    expert: list[nn.Parameter],
    device: torch.device,
    ep_group: dist.ProcessGroup | None = None,
    pp_group: dist.ProcessGroup | None = None,
    dense_group: dist.ProcessGroup | None = None,
    expert_shard_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The norm over every gradient of the job, on the device (no host read). Each EP rank holds
    other experts' gradients, so their squares are summed over ``ep_group``; each pipeline rank
    holds other stages', so the total is summed over ``pp_group``; FSDP ranks hold other
    shards of the dense gradients (``DTensor``), summed over ``dense_group`` (the ranks of one
    shard group), and of the experts' when they are sharded, summed over
    ``expert_shard_group`` (the data-parallel group: EP x EDP). Replicated gradients are
    counted once."""
    dense_shards, dense_whole = _by_sharding(dense)
    expert_shards, expert_whole = _by_sharding(expert)
    total = (
        _squared_grad_norm(dense_whole, device)
        + _summed(_squared_grad_norm(dense_shards, device), dense_group)
        + _summed(_squared_grad_norm(expert_whole, device), ep_group)
    )
    if expert_shards:  # other experts over EP, other shards of these over EDP: every DP rank
        total = total + _summed(_squared_grad_norm(expert_shards, device), expert_shard_group)
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


def clip_gradients_(
    params: list[nn.Parameter], norm: torch.Tensor, max_norm: float, optimizer: Any
) -> None:
    """Scale gradients so their global ``norm`` is at most ``max_norm`` (``clip_grad_norm_``'s
    rule). An optimizer whose step takes a ``grad_scale`` (the fused ones, the hook torch's
    GradScaler uses) gets the factor there and divides the gradients as it reads them: no
    separate pass over every gradient. The factor is for the optimizer's next step: clip before
    every step (the Trainer and the pipeline runtime do)."""
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        optimizer.grad_scale = ((norm + 1e-6) / max_norm).clamp(min=1.0)
        return
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0))


def _by_sharding(params: list[nn.Parameter]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(FSDP shards, ``DTensor`` s; whole parameters)."""
    shards = [p for p in params if isinstance(p, DTensor)]
    return shards, [p for p in params if not isinstance(p, DTensor)]


def _summed(value: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``value`` summed over ``group`` in place (None: this rank's)."""
    if group is not None:
        dist.all_reduce(value, group=group)
    return value


def _squared_grad_norm(params: list[nn.Parameter], device: torch.device) -> torch.Tensor:
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), device=device)
    # norms accumulated in float32 whatever the gradients' dtype (working weights': bf16)
    return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum()


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (an FSDP shard's ``DTensor``), or ``tensor`` itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


BUCKET_BYTES = 25 * 2**20
"""Gradient bucket size where the backward hands gradients over as it goes (eager autograd):
small buckets start reducing early, behind the rest of the backward."""
LATE_BUCKET_BYTES = 400 * 2**20
"""Gradient bucket size where every gradient arrives at the end of the backward (a program
lowered to Inductor runs one AOTAutograd backward): nothing is left to hide the reduction
behind, and NCCL's rate grows with the message (``benchmarks/collectives.py``)."""


def bucket_bytes_for(plan: Plan, device_type: str) -> int:
    """The gradient bucket size for ``plan``'s program on a ``device_type`` device:
    :data:`LATE_BUCKET_BYTES` where it is Inductor-lowered (compiled whole: one backward hands
    every gradient over at its end), else :data:`BUCKET_BYTES`."""
    return LATE_BUCKET_BYTES if plan.lowers_to_inductor(device_type) else BUCKET_BYTES


@dataclasses.dataclass
class _Bucket:
    params: list[nn.Parameter]
    group: dist.ProcessGroup
    pending: int = 0
    launched: bool = False
    flat: torch.Tensor | None = None
    work: object | None = None


class GradientReducer:
    """Bucketed, backward-overlapped gradient averaging (dense over DP, experts over EDP; dense
    parameters FSDP shards, ``DTensor`` s, are FSDP's to reduce).

    A post-accumulate-grad hook counts down each bucket; a full bucket is flattened and
    all-reduced asynchronously, scaled by ``1/dp`` (inside NCCL's pre-multiplied sum where the
    group is NCCL's), while backward continues. A bucket whose group is this rank alone (the
    experts at EP = dp) is only scaled, in place: flattening it and copying it back would move
    every expert gradient three times for nothing. ``finish()`` launches the buckets whose
    parameters got no gradient (as zeros), waits, and writes the averages back.
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: MoEMesh,
        bucket_bytes: int = BUCKET_BYTES,
    ):
        self.scale = 1.0 / mesh.dp
        self._enabled = True
        dense, expert = parameter_groups(module)
        # the DTensors are FSDP's (moec.runtime.fsdp), which reduces them
        dense = [p for p in dense if not isinstance(p, DTensor)]
        expert = [p for p in expert if not isinstance(p, DTensor)]
        self.buckets = _buckets(dense[::-1], mesh.dp_group, bucket_bytes) + _buckets(
            expert[::-1], mesh.edp_group, bucket_bytes
        )
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        for param in self._bucket_of:
            param.register_post_accumulate_grad_hook(self._ready)
        self._reset()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (microbatches before the last)."""
        self._enabled = False
        try:
            yield
        finally:
            self._enabled = True

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.pending, bucket.launched = len(bucket.params), False
            bucket.flat, bucket.work = None, None

    def _ready(self, param: nn.Parameter) -> None:
        if not self._enabled:
            return
        bucket = self._bucket_of[param]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        bucket.launched = True
        if dist.get_world_size(bucket.group) == 1:
            for p in bucket.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p, dtype=p.grad_dtype or p.dtype)
            torch._foreach_mul_([p.grad for p in bucket.params], self.scale)
            return
        # reduced in float32 at least, whatever the gradients' dtype (working weights': bf16)
        dtype = functools.reduce(torch.promote_types, [p.dtype for p in bucket.params])
        dtype = torch.promote_types(dtype, torch.float32)
        grads = [
            torch.zeros(p.numel(), dtype=dtype, device=p.device)
            if p.grad is None
            else p.grad.reshape(-1).to(dtype)
            for p in bucket.params
        ]
        bucket.flat = torch.cat(grads)
        op = _scaled_sum(bucket.flat, self.scale, bucket.group)
        bucket.work = dist.all_reduce(bucket.flat, op=op, group=bucket.group, async_op=True)

    def finish(self) -> None:
        """Complete every bucket's reduction and write the averaged gradients back."""
        for bucket in self.buckets:
            if not bucket.launched:
                self._launch(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            if bucket.flat is None:  # scaled in place
                continue
            offset = 0
            for param in bucket.params:
                grad = bucket.flat[offset : offset + param.numel()].view_as(param)
                if param.grad is None:
                    param.grad = grad.to(param.grad_dtype or param.dtype, copy=True)
                else:
                    param.grad.copy_(grad)
                offset += param.numel()
        self._reset()


def _scaled_sum(flat: torch.Tensor, scale: float, group: dist.ProcessGroup) -> Any:
    """The all-reduce op summing ``scale`` x each rank's ``flat``: NCCL's pre-multiplied sum
    (the scaling inside the collective), elsewhere a sum after scaling ``flat`` in place."""
    if dist.get_backend(group) == "nccl" and hasattr(dist, "_make_nccl_premul_sum"):
        return dist._make_nccl_premul_sum(scale)
    flat.mul_(scale)
    return dist.ReduceOp.SUM


def _buckets(
    params: list[nn.Parameter], group: dist.ProcessGroup, bucket_bytes: int
) -> list[_Bucket]:
    buckets: list[_Bucket] = []
    size = bucket_bytes
    for param in params:
        nbytes = param.numel() * param.element_size()
        if size + nbytes > bucket_bytes and (not buckets or buckets[-1].params):
            buckets.append(_Bucket([], group))
            size = 0
        buckets[-1].params.append(param)
        size += nbytes
    return buckets


class Optimizers:
    """Several optimizers stepped as one (dense and expert parameters shard over different
    groups under ZeRO-1)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def build_optimizer(
    module: nn.Module,
    mesh: MoEMesh,
    optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
    *,
    zero: bool = False,
    **kwargs,
) -> Optimizers:
    """``optimizer_class`` over ``module``; ``zero=True`` shards its state (ZeRO-1) with
    ``ZeroRedundancyOptimizer``: dense parameters over DP, expert parameters over EDP (the
    ranks that hold the same experts)."""
    dense, expert = parameter_groups(module)
    if not zero:
        return Optimizers([optimizer_class(dense + expert, **kwargs)])
    # imported here: torch.distributed.optim pulls in FSDP and DTensor (seconds of import time)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    sharded = [
        ZeroRedundancyOptimizer(params, optimizer_class, process_group=group, **kwargs)
        for params, group in ((dense, mesh.dp_group), (expert, mesh.edp_group))
        if params
    ]
    return Optimizers(sharded)
