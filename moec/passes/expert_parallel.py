"""Pass ``expert_parallel``: local dispatch/expert MLP/combine -> EP ops over an EP group.

Runs after ``moe`` when ``plan.parallel.ep = n > 1``. Matches, per MoE block (N experts, T local
tokens, top-K, x: f32[B, S, D])::

    _, weights, rows, offsets, counts = moec.route(logits, K, cf, ...)
    buffer = moec.dispatch(x, rows)                                          # [T*K, D]
    y, _ = moec.expert_mlp(buffer, w_up[N], w_down[N], offsets, b_up[N]?, b_down[N]?, act)
    out = moec.combine(y, weights, rows)                                     # [B, S, D]

Emits (``L = N/n`` experts on this rank, ``R`` rows received: see :mod:`moec.ops.ep`)::

    slots, recv, local_offsets, ep_counts, sent, dropped = moec.ep_layout(rows, offsets, group,
                                                                          n, cf, path)
    buffer = moec.ep_dispatch(x, slots, recv, sent, ep_counts, group, n, path)   # [R, D]
    y, _ = moec.expert_mlp(buffer, w_up[L], w_down[L], local_offsets, b_up[L]?, b_down[L]?, act)
    out, _ = moec.ep_combine(y, weights, slots, recv, sent, ep_counts, group, n, path)

The expert parameters are replaced by this rank's slice ``[rank*L, (rank+1)*L)`` of the full
(seeded, identical on every rank) tensors, so EP = n holds exactly the experts EP = 1 holds;
the program's ``provenance`` records each as ``ExpertSlice(rank*L, (rank+1)*L, of=<its global
source>)`` so a materializer builds only those experts.

Precondition: every rank of the EP group runs the same graph on local batches of the same shape
(the exchanged buffers have static, equal sizes). The rank comes from the context's
:class:`~moec.program.EPGroup`, never from global state, so the pass stays a pure function.

Options: ``plan.parallel.ep``, ``plan.parallel.ep_path`` (``auto`` resolved for the program's
target, :meth:`~moec.kernels.target.Target.ep_path`: ``rowwise`` on CUDA, else
``a2a_capacity``), the group. Invariants: those of :mod:`moec.passes.rewrite`; the user outputs
are unchanged; one aux output ``(block, "ep_dropped")`` per block is appended; the program's
``expert_parallel`` records the group and the resolved path for the runtime and dumps (its
``param_roles`` from ``moe`` say which parameters are expert slices).
Statistics: ``blocks_rewritten``, ``experts_per_rank``, ``path``, ``params_removed``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

import moec.ops.ep  # noqa: F401  (registers the moec::ep_* ops)
from moec.errors import MoecError
from moec.passes.base import Pass, PassContext, PassResult, register_pass
from moec.passes.rewrite import GraphEditor
from moec.plan import Plan
from moec.program import EPGroup, ExpertParallelLayout, ExpertSlice, Program

moec_ops = torch.ops.moec

EXPERT_ARGS = {1: "w_up", 2: "w_down", 4: "b_up", 5: "b_down"}
"""expert_mlp argument positions that hold [N, ...] expert parameters."""


class ExpertParallelError(MoecError, RuntimeError):
    """The pass cannot apply; the message names the node, module or setting that stopped it."""


@dataclasses.dataclass
class _Site:
    dispatch: fx.Node
    mlp: fx.Node
    combine: fx.Node
    prefix: str


@register_pass
class ExpertParallelPass(Pass):
    name = "expert_parallel"
    requires: tuple[str, ...] = ("moe",)

    @staticmethod
    def applies(plan: Plan) -> bool:
        """parallel.ep > 1"""
        return plan.parallel.ep > 1

    @staticmethod
    def options(plan: Plan) -> str:
        return f"ep={plan.parallel.ep},path={plan.parallel.ep_path}"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        ep = ctx.plan.parallel.ep
        group = ctx.ep_group
        if group is None:
            raise ExpertParallelError(
                f"plan.parallel.ep={ep} needs a process group: launch with "
                f"`torchrun --nproc-per-node {ctx.plan.parallel.dp} script.py`, call "
                "moec.runtime.distributed.init_from_env(plan) there and pass its mesh "
                "to moec.compile(model, plan, example_inputs, mesh=mesh)"
            )
        if group.size != ep:
            raise ExpertParallelError(
                f"EP group {group.group!r} has {group.size} ranks but plan.parallel.ep={ep}"
            )
        program = ctx.require_program(self.name)
        sites = [self._match(gm, node, group) for node in gm.graph.nodes if _is(node, "dispatch")]
        if not sites:
            raise ExpertParallelError("pass expert_parallel found no moec.dispatch: run moe first")
        path = ctx.target.ep_path(ctx.plan.parallel.ep_path)
        editor = GraphEditor(gm, self.name)
        removed = 0
        dropped: list[fx.Node] = []
        for site in sites:
            removed += self._shard_params(editor, site, group, program)
            dropped.append(self._rewrite(editor, site, group, path))
        output = gm.graph.output_node()
        output.args = (tuple(output.args[0]) + tuple(dropped),)
        program.signature.aux_outputs += [(site.prefix, "ep_dropped") for site in sites]
        program.expert_parallel = ExpertParallelLayout(group, path)
        gm.graph.eliminate_dead_code()
        gm.recompile()
        stats = {
            "blocks_rewritten": len(sites),
            "experts_per_rank": ctx.plan.moe.num_experts // ep,
            "path": path,
            "params_removed": removed,
        }
        return PassResult(gm, True, stats)

    # --- legality ----------------------------------------------------------------------------

    def _match(self, gm: fx.GraphModule, dispatch: fx.Node, group: EPGroup) -> _Site:
        mlps = [u for u in dispatch.users if _is(u, "expert_mlp")]
        if len(dispatch.users) != 1 or len(mlps) != 1:
            raise ExpertParallelError(
                f"moec.dispatch {dispatch.name} must feed exactly one moec.expert_mlp"
            )
        mlp = mlps[0]
        combines = [c for g in mlp.users for c in g.users if _is(c, "combine")]
        if len(combines) != 1 or combines[0].args[2] is not dispatch.args[1]:
            raise ExpertParallelError(
                f"moec.expert_mlp {mlp.name} must feed one moec.combine using the rows of "
                f"{dispatch.name}"
            )
        num_experts = mlp.args[3].meta["val"].shape[0]
        if num_experts % group.size:
            raise ExpertParallelError(
                f"{num_experts} experts of {mlp.name} cannot be split over ep={group.size}"
            )
        for index in EXPERT_ARGS:
            param = mlp.args[index]
            if param is not None and (param.op != "get_attr" or len(param.users) != 1):
                raise ExpertParallelError(
                    f"expert_mlp {mlp.name} argument {EXPERT_ARGS[index]} must be a parameter "
                    "read only by it"
                )
        prefix = str(mlp.args[1].target).rpartition(".")[0]
        return _Site(dispatch, mlp, combines[0], prefix)

    # --- rewrite -----------------------------------------------------------------------------

    def _shard_params(
        self, editor: GraphEditor, site: _Site, group: EPGroup, program: Program
    ) -> int:
        """Keep this rank's experts of every expert parameter (and record their source);
        return the elements removed."""
        removed = 0
        for index in EXPERT_ARGS:
            node = site.mlp.args[index]
            if node is None:
                continue
            owner_path, _, name = str(node.target).rpartition(".")
            owner = editor.gm.get_submodule(owner_path)
            full = getattr(owner, name)
            local = full.shape[0] // group.size
            start, stop = group.rank * local, (group.rank + 1) * local
            part = full.detach()[start:stop].clone()
            target = str(node.target)
            program.provenance[target] = ExpertSlice(start, stop, program.source(target))
            setattr(owner, name, torch.nn.Parameter(part, full.requires_grad))
            node.meta["val"] = editor.mode.from_tensor(getattr(owner, name), static_shapes=True)
            removed += full.numel() - part.numel()
        return removed

    def _rewrite(self, editor: GraphEditor, site: _Site, group: EPGroup, path: str) -> fx.Node:
        x, rows = site.dispatch.args
        buffer, _, _, offsets, *rest = site.mlp.args
        weights = site.combine.args[1]
        route = rows.args[0]
        cf = float(route.args[2])
        comm = (group.group, group.size, path)
        with editor.graph.inserting_before(site.dispatch):
            layout = editor.call(
                moec_ops.ep_layout.default,
                (rows, offsets, group.group, group.size, cf, path),
                like=site.dispatch,
            )
            slots, recv, local_offsets, counts, sent, dropped = (
                editor.getitem(layout, i) for i in range(6)
            )
            ep_buffer = editor.call(
                moec_ops.ep_dispatch.default,
                (x, slots, recv, sent, counts, *comm),
                like=site.dispatch,
            )
        with editor.graph.inserting_before(site.mlp):
            mlp = editor.call(
                moec_ops.expert_mlp.default,
                (ep_buffer, site.mlp.args[1], site.mlp.args[2], local_offsets, *rest),
                like=site.mlp,
            )
            y = editor.getitem(mlp, 0)
        with editor.graph.inserting_before(site.combine):
            combine = editor.call(
                moec_ops.ep_combine.default,
                (y, weights, slots, recv, sent, counts, *comm),
                like=site.combine,
            )
            out = editor.getitem(combine, 0)
        site.combine.replace_all_uses_with(out)
        editor.graph.erase_node(site.combine)
        for user in list(site.mlp.users):
            editor.graph.erase_node(user)
        editor.graph.erase_node(site.mlp)
        editor.graph.erase_node(site.dispatch)
        return dropped


def _is(node: fx.Node, op: str) -> bool:
    return node.op == "call_function" and node.target is getattr(moec_ops, op).default
