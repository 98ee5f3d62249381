"""FSDP2 over a program's dense parameters (``program.data_parallel``, pass ``fsdp``).

``shard_dense_parameters(root, layout, mesh, graph)`` calls ``torch.distributed.fsdp.fully_shard``
with the mesh's ``dp_shard`` mesh (1-D: FSDP; 2-D ``(dp_replicate, dp_shard)``: HSDP) on each
block the pass made a parameter group (``layout.groups``, found in ``graph`` by path) and then on
``root``, which takes the remaining sharded parameters (embeddings, final norm, head). At PP = 1
the root and the graph are the compiled model (``CompiledModel._adopt``); under pipeline
parallelism each local stage's ``StageModule`` is a root over its stage graph, whose layout names
only the stage's parameters and groups (:mod:`moec.runtime.pipeline`). The
expert slices are ``ignored_params`` (each EP rank holds its own experts whole; their gradients
are averaged over the expert-data-parallel group by
:class:`~moec.runtime.distributed.GradientReducer`), and so are the dense parameters the pass
left whole (read in float32 by a bf16 program: norm weights, embeddings), which it averages
over the data-parallel group as under DDP. Every graph the runtime runs (train, eval,
forward-only variants, pipeline stages) enters through a root's forward and calls the groups.

Precision: shards are all-gathered in ``program.data_parallel.gather_dtype`` (bf16 in bf16
programs, so the step casts 1/dp_shard of the dense weights, on the shard, and never a whole
weight), gradients are reduce-scattered in float32 and land on the float32 shards.
A group's parameters are gathered when its block starts, freed when it ends, gathered again
when backward reaches it and reduce-scattered (then freed) when its backward is done (see
:mod:`moec.ops.param_groups`); the next group's all-gather is issued when a group is gathered
(forward) and by FSDP2's backward prefetch, so it overlaps the running block. The
root's parameters stay gathered from forward to the end of backward.

Parameters built on the meta device stay there: :func:`moec.runtime.materialize.materialize`
then writes each rank's shard (``DTensor`` parameters) after this call.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from moec.program import ShardedDataParallel
from moec.runtime.distributed import DistributedError, MoEMesh


def shard_dense_parameters(
    root: nn.Module,
    layout: ShardedDataParallel | None,
    mesh: MoEMesh | None,
    graph: nn.Module | None = None,
) -> None:
    """Shard the dense parameters of ``graph`` (default: ``root``), which holds them under the
    names of ``layout`` and its groups under their paths, with FSDP2 as ``layout`` says (nothing
    when it is None): the groups ``graph`` holds (a pipeline stage's: ``layout`` may name
    others), then ``root``, the FSDP root, whose forward runs ``graph``."""
    if layout is None:
        return
    if mesh is None or mesh.fsdp_mesh is None:
        raise DistributedError(
            f"the program shards its dense parameters (parallel.dp_shard={layout.shard}) but "
            "was compiled without a data-parallel mesh: pass "
            "mesh=moec.runtime.distributed.init_from_env(plan) under torchrun "
            "(moec.runtime.pipeline.build_pipeline_mesh(plan) when parallel.pp > 1)"
        )
    if mesh.fsdp_mesh.size() != layout.replicate * layout.shard:
        raise DistributedError(
            f"the program was compiled for {layout.replicate} x {layout.shard} data-parallel "
            f"ranks but the mesh has {mesh.fsdp_mesh.size()}"
        )
    graph = root if graph is None else graph
    named = dict(graph.named_parameters())
    layout = layout.restricted_to(set(named))
    sharded = {id(named[name]) for name in layout.params}
    ignored = {p for p in root.parameters() if id(p) not in sharded}
    gather = None if layout.gather_dtype is None else getattr(torch, layout.gather_dtype)
    policy = MixedPrecisionPolicy(
        param_dtype=gather, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    # a group returns its inputs, the previous block's released output (a view); FSDP warns
    # that an in-place op on it would skip its hook: a program's graph has no in-place ops
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    _shard_experts(root, graph, layout, mesh, policy)
    groups = [graph.get_submodule(path) for path in layout.groups]
    for group in groups:  # gathered around their block (moec.ops.param_groups)
        fully_shard(
            group,
            mesh=mesh.fsdp_mesh,
            mp_policy=policy,
            ignored_params=ignored,
            reshard_after_forward=False,  # the block's ReleaseParams frees them
        )
    for group, following in zip(groups, groups[1:]):  # the next block's all-gather overlaps
        group.set_modules_to_forward_prefetch([following])
    fully_shard(root, mesh=mesh.fsdp_mesh, mp_policy=policy, ignored_params=ignored)


def _shard_experts(
    root: nn.Module,
    graph: nn.Module,
    layout: ShardedDataParallel,
    mesh: MoEMesh,
    policy: MixedPrecisionPolicy,
) -> None:
    """Each module holding sharded expert slices becomes an FSDP unit over the
    expert-data-parallel ranks (first: the block units around them then skip it), split on dim
    1 (each EP rank's slice is its own tensor: dim 0 is its experts). The gradients are
    divided by dp, not by the unit's size: the EP exchange's backward already summed the
    tokens of the EP group, as under DDP (:class:`~moec.runtime.distributed.GradientReducer`)."""
    if not layout.expert_groups:
        return
    if mesh.expert_fsdp_mesh is None or mesh.expert_fsdp_mesh.size() != layout.expert_shard:
        raise DistributedError(
            f"the program shards its experts over {layout.expert_shard} expert-data-parallel "
            "ranks but the mesh has no such dimension: build it from the same plan "
            "(moec.runtime.distributed.build_mesh)"
        )
    named = dict(graph.named_parameters())
    experts = {id(named[name]) for name in layout.expert_params}
    others = {p for p in root.parameters() if id(p) not in experts}
    for path in layout.expert_groups:
        unit = graph.get_submodule(path)
        fully_shard(
            unit,
            mesh=mesh.expert_fsdp_mesh,
            mp_policy=policy,
            ignored_params=others,
            reshard_after_forward=False,  # the experts' ReleaseParams frees them
            shard_placement_fn=lambda param: Shard(1),
        )
        unit.set_gradient_divide_factor(float(mesh.dp))
        if mesh.ep_info.device_type != "cuda":  # gloo has no pre-multiplied sum: scale apart
            unit.set_force_sum_reduction_for_comms(True)


def set_gradient_sync(compiled: nn.Module, enabled: bool) -> None:
    """Whether this backward reduce-scatters the sharded gradients (False: accumulate the
    unsharded gradients locally, for microbatches before the last)."""
    if isinstance(compiled, FSDPModule):
        compiled.set_requires_gradient_sync(enabled)
