"""Pass ``moe``: dense FFN regions -> router + routed experts (+ the dense FFN as shared expert).

Matches (per FFN region found by :mod:`moec.analysis.structure`, after the first
``plan.moe.dense_first`` blocks), e.g. a SwiGLU FFN on X: f32[B, S, D]::

    gate = linear(X, Wg)  up = linear(X, Wu)  act = mul(silu(gate), up)  out = linear(act, Wd)

Emits::

    logits = linear(X, router_weight)                                    # [B, S, N]
    ids, weights, rows, offsets, counts = moec.route(logits, K, cf, gating, normalize, "learned",
                                                     expert_bias)        # bias: aux_free only
    buffer = moec.dispatch(X, rows)              # [B*S*K, D]; X cast to bf16 first under bf16
    y, _ = moec.expert_mlp(buffer, w_up, w_down, offsets, b_up, b_down, "swiglu")
    moe_out = moec.combine(y, weights, rows)                             # [B, S, D]
    result = add(out, moe_out) if shared_expert else moe_out             # replaces `out`
    losses, scores = moec.router_losses(logits, ids, K, gating, per_sequence)  # graph outputs

Parameters live under ``<ffn module path>.moe`` (``router_weight``, ``w_up`` [N, D, U],
``w_down`` [N, H, D], ``b_up``, ``b_down``; ``w_up`` and ``w_down`` k-major, the contraction
dim unit-stride, when :meth:`~moec.plan.Plan.expert_weights_k_major`); the dense FFN's
parameters are removed unless it becomes the shared expert. Under ``plan.moe.balance:
aux_free`` the block also gets the persistent float32 buffer ``expert_bias`` [N] (zeros, in the
global expert layout: every rank holds all N; built on the CPU when the graph is on the meta
device, so a checkpoint without it materializes it), the selection bias the runtime updates
(:mod:`moec.runtime.router_losses`). ``per_sequence`` is ``plan.moe.balance == "sequence"``.
Init (``plan.moe.init``; the
papers are cited in :class:`~moec.plan.MoEPlan`), all keeping the dense function where stated:

- ``upcycle``: the dense hidden units cut into G = ``plan.moe.upcycle_granularity`` slices,
  expert e holding slice e mod G, its down projection scaled by G; the router has one
  normal(0, router_init_std) row per virtual group of G consecutive experts (which hold the
  whole FFN), so top-k takes groups whole. G = 1 (every expert a copy of the dense FFN,
  unscaled): with normalized weights the MoE equals the dense FFN at init; G > 1 (granular):
  it does when G also divides top_k.
- ``drop_upcycle``: ``upcycle``, then in each expert ``plan.moe.drop_upcycle_ratio`` of its
  hidden units, a seeded subset per expert, redrawn from normal(mean, std) of that dense matrix.
- ``split``: granular upcycling at G = N as one virtual group: the router starts at zero, so
  every chosen expert gets the same weight w0 and the down projections are scaled by 1/w0:
  with top_k = N the MoE equals the dense FFN at init.
- ``random``: fresh normal init at ``expert_width`` with the std of the dense matrices.
With a shared expert under every init but ``random`` both branches' output projections are
halved, so the sum still equals the dense FFN at init. Every random draw (router, redrawn
units and their values, ``random`` experts) comes from a generator seeded by
(``plan.moe.seed``, parameter name, expert index) alone, so any expert range can be drawn by
itself and the values do not depend on the layout.

Each new tensor is first described as a :data:`~moec.program.ParamSource` over the dense FFN's
parameter names (:func:`expert_sources`: plain upcycling ``Repeated``, granular and split
``Stacked`` cuts with their ``Scaled`` down projections, drop-upcycled ``Redrawn`` units over
the dense statistics ``MeanOf`` / ``StdOf``, ``Fresh`` draws) and then built from the graph's
parameters; the descriptions go to ``program.provenance`` (with the shared expert's ``Scaled``
down projection), so a model captured on the meta device can be materialized from a dense
checkpoint (:mod:`moec.runtime.materialize`) to the same values.

An FFN of pointwise convolutions (channels-first, features in dim 1) is routed channels-last:
``X`` is permuted to put its features last before the router and dispatch, and the combined
output permuted back. The activations named in ``plan.moe.activations`` are registered (see
:func:`moec.ops.activations.register_activation`) before the FFNs are looked for.

A model that routes tokens already keeps its MoE blocks: an FFN region beside a router
(:attr:`~moec.analysis.structure.FFNRegion.router`, the block's shared expert) is left as it
is, with a warning naming it and its router; only the dense FFNs become routed experts (an
MoE inside an MoE block is nobody's intent).

An FFN that runs over positions (its features are a size that follows the input's, as an
MLP-Mixer's token-mixing MLP on a transposed tensor) is not an FFN region
(:attr:`~moec.analysis.structure.Structure.over_positions`): it stays dense, with a warning
naming it and the ``ffns_over_positions`` statistic.

Refuses (:class:`MoEPassError`, naming the model or module): a model with no FFN region (the
message lists the rejected candidates and the supported activations, and names the router of a
model that routes tokens already) or with shared experts only, and an FFN to convert
with a dropout of rate p > 0 on its hidden activation, which the fused expert op cannot apply,
unless ``plan.moe.ffn_dropout`` is ``drop``. FFNs kept dense keep their dropout.

Options: everything in ``plan.moe``, and ``plan.lowering.expert_weights``. Statistics:
``ffns_replaced``, ``ffns_kept_dense``, ``ffns_beside_routers`` (shared experts left as they
are), ``ffns_over_positions``, ``params_added``, ``params_removed``,
``ffn_dropouts_dropped``, ``expert_weights`` (the layout). Invariants: those of
:mod:`moec.passes.rewrite`; the graph's user outputs are unchanged; per MoE block three aux
outputs are appended (``router_losses``, ``expert_counts``, ``expert_offsets``), and a fourth,
``router_scores`` (P [N]), under ``balance: global_batch``; the program records each block as a
:class:`~moec.program.MoELayer`, its parameters' roles (``router``, ``expert``) and their
provenance.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch
import torch.fx as fx

from moec.analysis.structure import (
    FFNRegion,
    LinearSite,
    Structure,
    find_structure,
    model_name,
    module_path,
)
from moec.errors import MoecError
from moec.fx import parameter_count
from moec.ops.activations import (
    ActivationError,
    is_gated,
    register_activation,
    supported_text,
)
from moec.passes.base import Pass, PassContext, PassResult, register_pass
from moec.passes.rewrite import GraphEditor, erase_unused, refresh_meta
from moec.plan import MoEPlan, Plan, PlanError, activation_function
from moec.program import (
    Concat,
    DrawnUnits,
    Fresh,
    FromSource,
    MeanOf,
    MoELayer,
    ParamSource,
    Redrawn,
    Repeated,
    RepeatedRows,
    Scaled,
    SourceReader,
    Span,
    Stacked,
    StdOf,
    TensorBuilder,
    cut,
    fresh_seed,
)

aten = torch.ops.aten
moec_ops = torch.ops.moec


class MoEPassError(MoecError, RuntimeError):
    """The model has nothing the pass can convert, or an FFN it cannot convert faithfully."""


@dataclasses.dataclass
class ExpertWeights:
    router: torch.Tensor  # [N, D]
    w_up: torch.Tensor  # [N, D, U]
    w_down: torch.Tensor  # [N, H, D]
    b_up: torch.Tensor | None  # [N, U]
    b_down: torch.Tensor | None  # [N, D]


@register_pass
class MoEPass(Pass):
    name = "moe"

    @staticmethod
    def options(plan: Plan) -> str:
        m = plan.moe
        return (
            f"experts={m.num_experts},top_k={m.top_k},init={_init_option(m)},gating={m.gating},"
            f"capacity={m.capacity_factor},shared={int(m.shared_expert)},"
            f"dense_first={m.dense_first},balance={m.balance},"
            f"expert_weights={'k_major' if plan.expert_weights_k_major() else 'n_major'}"
        )

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        program = ctx.require_program(self.name)
        plan = ctx.plan.moe
        _register_plan_activations(plan)
        structure = find_structure(gm)
        blocks = [b for b in structure.blocks if b.ffn.router is None]
        if not blocks:
            raise MoEPassError(_no_ffn_message(gm, structure))
        shared = [b.ffn for b in structure.blocks if b.ffn.router is not None]
        if shared:
            warnings.warn(
                f"moec: {_routed_already(shared)}; only the dense FFNs become routed experts",
                stacklevel=2,
            )
        if structure.over_positions:
            warnings.warn(
                f"moec: FFNs kept dense: {', '.join(structure.over_positions)} (their features "
                "are a size that follows the input's: they mix positions, as token-mixing MLPs "
                "do, and routed experts route each position's features)",
                stacklevel=2,
            )
        if plan.dense_first >= len(blocks):
            raise PlanError("moe.dense_first", plan.dense_first, _no_block_left(plan, blocks))
        wider = _wider_than_dense(plan, [b.ffn for b in blocks[plan.dense_first :]])
        if wider:
            warnings.warn(f"moec: {wider}", stacklevel=2)
        editor = GraphEditor(gm, self.name)
        compute_dtype = torch.bfloat16 if ctx.plan.precision.compute_dtype == "bf16" else None
        k_major = ctx.plan.expert_weights_k_major()
        sig, roles, layers = program.signature, program.param_roles, program.moe_layers
        added = removed = 0
        aux: list[fx.Node] = []
        dropouts = [_check_dropout(b.ffn, plan) for b in blocks[plan.dense_first :]]
        for block in blocks[plan.dense_first :]:
            region = block.ffn
            prefix = f"{region.module_path or 'ffn_' + str(block.index)}.moe"
            weights, sources = build_expert_weights(gm, region, plan, prefix)
            if k_major:
                weights = dataclasses.replace(
                    weights, w_up=_k_major(weights.w_up), w_down=_k_major(weights.w_down)
                )
            program.provenance.update(sources)
            nodes = self._rewrite(editor, region, weights, plan, prefix, compute_dtype)
            added += sum(t.numel() for t in dataclasses.astuple(weights) if t is not None)
            for name, tensor in zip(EXPERT_TENSORS, dataclasses.astuple(weights), strict=True):
                if tensor is not None:  # no bias parameters for a bias-free FFN
                    roles[f"{prefix}.{name}"] = "router" if name == "router_weight" else "expert"
            if plan.shared_expert:
                program.provenance.update(_scale_shared(gm, region, _shared_scale(plan)))
            else:
                params_before = parameter_count(gm)
                erase_unused(gm, region.nodes())
                removed += params_before - parameter_count(gm)
            aux += nodes
            sig.aux_outputs += [
                (prefix, "router_losses"),
                (prefix, "expert_counts"),
                (prefix, "expert_offsets"),
            ] + ([(prefix, "router_scores")] if plan.balance == "global_batch" else [])
            layers.append(
                MoELayer(
                    prefix,
                    block.index,
                    region.dim,
                    weights.w_down.shape[1],
                    plan.num_experts,
                    plan.top_k,
                    plan.capacity_factor,
                    region.activation,
                    plan.shared_expert,
                    f"{prefix}.{EXPERT_BIAS}" if plan.balance == "aux_free" else None,
                )
            )
        output = gm.graph.output_node()
        output.args = (tuple(output.args[0]) + tuple(aux),)
        gm.graph.eliminate_dead_code()
        if compute_dtype is not None:  # bf16 expert outputs re-type the nodes reading them
            refresh_meta(gm)
        gm.recompile()
        stats = {
            "ffns_replaced": len(blocks) - plan.dense_first,
            "ffns_kept_dense": plan.dense_first,
            "ffns_beside_routers": len(shared),
            "ffns_over_positions": len(structure.over_positions),
            "params_added": added,
            "params_removed": removed,
            "ffn_dropouts_dropped": sum(dropouts),
            "expert_weights": "k_major" if k_major else "n_major",
        }
        return PassResult(gm, True, stats)

    def _rewrite(
        self,
        editor: GraphEditor,
        region: FFNRegion,
        weights: ExpertWeights,
        plan: MoEPlan,
        prefix: str,
        compute_dtype: torch.dtype | None,
    ) -> list[fx.Node]:
        out, x = region.output, region.input
        to_last = _features_last(x, region.channel_dim)
        with editor.graph.inserting_before(out.next):
            if to_last is not None:  # pointwise convs: tokens as rows, features last
                x = editor.call(aten.permute.default, (x, to_last), like=out)
            param = {
                name: None
                if value is None
                else editor.parameter(f"{prefix}.{name}", value, like=out)
                for name, value in (
                    ("router_weight", weights.router),
                    ("w_up", weights.w_up),
                    ("w_down", weights.w_down),
                    ("b_up", weights.b_up),
                    ("b_down", weights.b_down),
                )
            }
            logits = editor.call(aten.linear.default, (x, param["router_weight"]), like=out)
            capacity = plan.capacity_factor if plan.capacity_factor is not None else 0.0
            route_args = (
                logits,
                plan.top_k,
                capacity,
                plan.gating,
                plan.normalize_weights,
                "learned",  # the op's random/uniform routings are benchmark baselines
            )
            if plan.balance == "aux_free":
                bias = torch.zeros(plan.num_experts, device=_real(weights.router.device))
                route_args += (editor.buffer(f"{prefix}.{EXPERT_BIAS}", bias, out, True),)
            route = editor.call(moec_ops.route.default, route_args, like=out)
            ids, route_weights, rows, offsets, counts = (editor.getitem(route, i) for i in range(5))
            if to_last is not None:
                x = editor.call(aten.clone.default, (x,), like=out, kwargs=_CONTIGUOUS)
            if compute_dtype is not None and x.meta["val"].dtype != compute_dtype:
                # autocast leaves norm outputs in fp32; expert GEMMs run in the compute dtype
                x = editor.call(
                    aten._to_copy.default, (x,), like=out, kwargs={"dtype": compute_dtype}
                )
            buffer = editor.call(moec_ops.dispatch.default, (x, rows), like=out)
            mlp = editor.call(
                moec_ops.expert_mlp.default,
                (
                    buffer,
                    param["w_up"],
                    param["w_down"],
                    offsets,
                    param["b_up"],
                    param["b_down"],
                    region.activation,
                ),
                like=out,
            )
            expert_out = editor.getitem(mlp, 0)
            moe_out = editor.call(
                moec_ops.combine.default, (expert_out, route_weights, rows), like=out
            )
            if to_last is not None:
                back = [to_last.index(d) for d in range(len(to_last))]
                moe_out = editor.call(aten.permute.default, (moe_out, back), like=out)
            result = moe_out
            if plan.shared_expert:
                result = editor.call(aten.add.Tensor, (out, moe_out), like=out)
            per_sequence = plan.balance == "sequence"
            terms = editor.call(
                moec_ops.router_losses.default,
                (logits, ids, plan.top_k, plan.gating, per_sequence),
                like=out,
            )
            losses, scores = editor.getitem(terms, 0), editor.getitem(terms, 1)
        out.replace_all_uses_with(result, delete_user_cb=lambda user: user is not result)
        return [losses, counts, offsets] + ([scores] if plan.balance == "global_batch" else [])


def _init_option(plan: MoEPlan) -> str:
    """``plan.init`` as the pass's options show it, with the fields it reads."""
    g = plan.upcycle_granularity
    if plan.init == "upcycle" and g > 1:
        return f"upcycle(granularity={g})"
    if plan.init == "drop_upcycle":
        return f"drop_upcycle(ratio={plan.drop_upcycle_ratio},granularity={g})"
    return plan.init


_CONTIGUOUS = {"memory_format": torch.contiguous_format}

EXPERT_BIAS = "expert_bias"
"""The buffer of an ``aux_free`` block's selection bias, under the block's prefix."""


def _real(device: torch.device) -> torch.device:
    """``device``, or the CPU for the meta device: a zero bias needs no checkpoint, so it is
    built real even in a graph captured on meta (materializing moves it to the device)."""
    return torch.device("cpu") if device.type == "meta" else device


def _features_last(x: fx.Node, channel_dim: int) -> list[int] | None:
    """The permutation moving ``channel_dim`` of ``x`` last, or None if it is last already."""
    rank = x.meta["val"].dim()
    if channel_dim in (-1, rank - 1):
        return None
    return [d for d in range(rank) if d != channel_dim] + [channel_dim]


def _register_plan_activations(plan: MoEPlan) -> None:
    for name, ref in plan.activations.items():
        try:
            register_activation(name, activation_function(name, ref))
        except ActivationError as exc:
            raise PlanError(f"moe.activations.{name}", ref, str(exc)) from exc


def _routed_already(shared: list[FFNRegion]) -> str:
    """What the pass leaves of MoE blocks the model has: their shared experts, by router."""
    pairs = ", ".join(
        f"{ffn_name(ffn)} (beside aten.topk in {module_path(ffn.router) or ffn.router.name})"
        for ffn in shared
    )
    return (
        f"kept as they are: the MoE blocks the model routes already, and their shared "
        f"experts {pairs}"
    )


def _no_ffn_message(gm: fx.GraphModule, structure: Structure) -> str:
    shared = [b.ffn for b in structure.blocks if b.ffn.router is not None]
    if shared:
        return (
            f"no dense FFN to convert in {model_name(gm)}: {_routed_already(shared)}. The moe "
            "pass turns a dense model's FFNs into routed experts, so hand it the dense model "
            "(the same architecture with plain FFNs)"
        )
    rejected = "; ".join(structure.rejected) or "none"
    message = (
        f"no FFN region found in {model_name(gm)}: looked for linear (or pointwise conv) -> "
        f"activation -> linear chains among its {len(structure.linears)} linears; candidates "
        f"rejected: {rejected}; activations {supported_text()}; `moec inspect MODEL` lists "
        "the FFN regions found and the candidates rejected"
    )
    routing = next((n for n in gm.graph.nodes if n.target == aten.topk.default), None)
    if routing is not None:
        path = module_path(routing)
        where = f"in {path}" if path else f"at node {routing.name}"
        message += (
            f". The model already routes tokens (aten.topk {where}): the moe pass turns a "
            "dense model's FFNs into routed experts, so hand it the dense model (the same "
            "architecture with plain FFNs)"
        )
    return message


def ffn_name(region: FFNRegion) -> str:
    """The FFN's module path, or its linears' paths for an FFN of the model's root module."""
    sites = [*region.ups, region.down]
    paths = dict.fromkeys(module_path(s.node) or s.node.name for s in sites)
    return region.module_path or " -> ".join(paths)


def _check_dropout(region: FFNRegion, plan: MoEPlan) -> int:
    """The number of dropouts (p > 0) on the hidden activation of ``region`` the routed experts
    go without; refused unless ``plan.ffn_dropout`` is ``drop``."""
    dropouts = region.dropouts()
    if dropouts and plan.ffn_dropout == "error":
        node = dropouts[0]
        raise MoEPassError(
            f"FFN {ffn_name(region)} applies dropout p={node.args[1]} "
            f"({module_path(node) or node.name}) to its hidden activation, which the routed "
            "experts cannot apply: set that dropout to 0 in the model, or set "
            "moe.ffn_dropout: drop in the plan to train the experts without it"
        )
    return len(dropouts)


EXPERT_TENSORS = ("router_weight", "w_up", "w_down", "b_up", "b_down")
"""The parameters of an MoE block under ``<ffn module>.moe``, in ``ExpertWeights`` order."""


def build_expert_weights(
    gm: fx.GraphModule, region: FFNRegion, plan: MoEPlan, prefix: str
) -> tuple[ExpertWeights, dict[str, ParamSource]]:
    """The initial router and expert tensors for ``region`` under ``plan.init`` (parameters
    ``<prefix>.<name>``), built from their sources (:func:`expert_sources`) over the dense
    FFN's parameters in ``gm``, and those sources by parameter name."""
    sources = expert_sources(region, plan, prefix)
    w_down = gm.get_parameter(region.down.weight)
    builder = TensorBuilder(_reader(gm), w_down.device)
    weights = ExpertWeights(
        *(
            None if source is None else builder.tensor(source, w_down.dtype)
            for source in sources.values()
        )
    )
    named = {f"{prefix}.{name}": s for name, s in sources.items() if s is not None}
    return weights, named


def _k_major(w: torch.Tensor) -> torch.Tensor:
    """``w`` [N, K, M] with the same values, laid out with K unit-stride (stacked ``nn.Linear``
    weights: ``lowering.expert_weights``)."""
    return w.transpose(1, 2).contiguous().transpose(1, 2)


def _reader(gm: fx.GraphModule) -> SourceReader:
    """Reads the source tensors from ``gm``'s (dense) parameters."""
    return lambda name, rows, cols: cut(gm.get_parameter(name).detach(), rows, cols)


def expert_sources(region: FFNRegion, plan: MoEPlan, prefix: str) -> dict[str, ParamSource | None]:
    """Where each of ``EXPERT_TENSORS`` comes from under ``plan.init`` (None: no such tensor),
    over the dense FFN's parameter names; every ``Fresh`` draw and every expert's
    ``DrawnUnits`` is seeded from (``plan.seed``, parameter name, expert index) only."""
    if plan.init == "random":
        return _random_sources(region, plan, prefix)
    return _upcycled_sources(region, plan, prefix)


def _granularity(plan: MoEPlan) -> int:
    """G, the slices the dense FFN's hidden units are cut into: ``num_experts`` for ``split``,
    ``plan.upcycle_granularity`` for ``upcycle`` and ``drop_upcycle``."""
    return plan.num_experts if plan.init == "split" else plan.upcycle_granularity


def _upcycled_sources(
    region: FFNRegion, plan: MoEPlan, prefix: str
) -> dict[str, ParamSource | None]:
    """``upcycle``, ``drop_upcycle`` and ``split``: the dense hidden units cut into G slices
    (:func:`_granularity`), expert e holding slice e mod G, so that each virtual group of G
    consecutive experts holds the whole FFN; the down projections scaled by
    :func:`_down_scale`; under ``drop_upcycle`` each expert's :func:`_dropped_units` redrawn
    from the dense matrices' statistics (biases are kept)."""
    n, dim, hidden, g = plan.num_experts, region.dim, region.hidden, _granularity(plan)
    where = f"FFN {ffn_name(region)}"
    field = "moe.num_experts" if plan.init == "split" else "moe.upcycle_granularity"
    if hidden % g:
        raise PlanError(
            field, g, f"a divisor of the dense FFN width {hidden} of {where} for init={plan.init!r}"
        )
    width = hidden // g
    cut = "copies it whole into" if g == 1 else f"cuts it into {field} = {g} slices, one per"
    _check_width(
        plan,
        width,
        where,
        f"init={plan.init!r} reads the dense FFN ({hidden} wide) and {cut} expert",
    )
    parts = [None] if g == 1 else [(i * width, (i + 1) * width) for i in range(g)]
    scale = _down_scale(plan, g)
    w_up, w_down, b_up = [], [], []
    for e in range(n):
        part, units = parts[e % g], _dropped_units(plan, prefix, width, e)
        ups = tuple(  # hidden units: the up projections' outputs
            _redrawn(site, 1, part, units, dim, fresh_seed(plan.seed, f"{prefix}.w_up.{i}", e))
            for i, site in enumerate(region.ups)
        )
        w_up.append(Concat(ups, dim=1))
        down_seed = fresh_seed(plan.seed, f"{prefix}.w_down", e)  # hidden units: the down's inputs
        w_down.append(_scaled(_redrawn(region.down, 0, part, units, dim, down_seed), scale))
        b_up.append(Concat(tuple(_bias(site, part, width) for site in region.ups), dim=0))
    has_up_bias = any(site.bias is not None for site in region.ups)
    b_down = region.down.bias
    return {
        "router_weight": _router(plan, prefix, dim, g),
        "w_up": _per_expert(w_up),
        "w_down": _per_expert(w_down),
        "b_up": _per_expert(b_up) if has_up_bias else None,
        "b_down": None if b_down is None else Repeated(_scaled(FromSource(b_down), scale / g), n),
    }


def _random_sources(region: FFNRegion, plan: MoEPlan, prefix: str) -> dict[str, ParamSource | None]:
    """``random``: fresh normal experts at ``expert_width`` with the std of the dense matrices."""
    n, dim = plan.num_experts, region.dim
    width = plan.expert_width or region.hidden
    up_width = 2 * width if is_gated(region.activation) else width
    ups = Concat(tuple(_in_out(site) for site in region.ups), dim=1)
    stds = {"w_up": StdOf((ups,)), "w_down": StdOf((_in_out(region.down),))}
    shapes = {"w_up": (dim, up_width), "w_down": (width, dim)}
    fresh = {
        name: Stacked(
            tuple(
                Fresh(
                    "normal", shapes[name], stds[name], fresh_seed(plan.seed, f"{prefix}.{name}", e)
                )
                for e in range(n)
            )
        )
        for name in shapes
    }
    has_up_bias = any(site.bias is not None for site in region.ups)
    return {
        "router_weight": _router(plan, prefix, dim, 1),
        **fresh,
        "b_up": Fresh("zeros", (n, up_width)) if has_up_bias else None,
        "b_down": Fresh("zeros", (n, dim)) if region.down.bias is not None else None,
    }


def _router(plan: MoEPlan, prefix: str, dim: int, granularity: int) -> ParamSource:
    """The router weight [N, D]: one normal(0, ``router_init_std``) row per virtual group of
    ``granularity`` consecutive experts (one per expert at 1), so the experts of a group tie
    and top-k takes groups whole (He et al. 2024's virtual-group init); zero for a single
    group of several experts (``split``), whose logits tie whatever its row: zero gives every
    gating the known tie weight (:func:`_tie_weight`)."""
    n = plan.num_experts
    if _single_group(n, granularity):
        return Fresh("zeros", (n, dim))
    seed = fresh_seed(plan.seed, f"{prefix}.router_weight")
    rows = Fresh("normal", (n // granularity, dim), plan.router_init_std, seed)
    return rows if granularity == 1 else RepeatedRows(rows, granularity)


def _single_group(num_experts: int, granularity: int) -> bool:
    """Whether the experts form one virtual group of several (``split``)."""
    return granularity == num_experts > 1


def _tie_weight(plan: MoEPlan) -> float:
    """The routing weight of each chosen expert when all router logits tie (a zero router)."""
    if plan.normalize_weights:
        return 1.0 / plan.top_k
    return 1.0 / plan.num_experts if plan.gating == "softmax" else 0.5


def _down_scale(plan: MoEPlan, granularity: int) -> float:
    """The factor on every expert's down projection (on its bias: over ``granularity``) so that
    the routing weight reaching each of the G dense slices, times it, is one (halved beside a
    shared expert: :func:`_shared_scale`).

    A single group (``split``, zero router): each chosen expert has the tie weight w0 and holds
    its own slice, so the factor is 1 / w0; the MoE equals the dense FFN when top_k =
    num_experts. Several groups: the experts of a group tie, so with normalized weights
    (summing to one over the chosen) top_k / G whole groups give each slice 1 / G, and the
    factor is G; the MoE equals the dense FFN when G divides top_k. Unnormalized weights are
    the router's scores, which no constant undoes: they keep the same factor (at G = 1 none,
    as plain upcycling)."""
    shared = _shared_scale(plan)
    if _single_group(plan.num_experts, granularity):
        return shared / _tie_weight(plan)
    return shared * granularity


def _shared_scale(plan: MoEPlan) -> float:
    """The factor on both the shared expert's and the routed experts' output projections: a half
    when both start as the dense FFN (every init but ``random``), so their sum still is it."""
    return 0.5 if plan.shared_expert and plan.init != "random" else 1.0


def _dropped_units(plan: MoEPlan, prefix: str, width: int, expert: int) -> DrawnUnits | None:
    """The hidden units of ``expert`` that ``drop_upcycle`` redraws: ``drop_upcycle_ratio`` of
    its ``width`` (rounded to the nearest unit, halves up), a subset seeded by the expert alone;
    None when there are none (every init but ``drop_upcycle``, or a ratio that rounds to 0)."""
    if plan.init != "drop_upcycle":
        return None
    count = math.floor(plan.drop_upcycle_ratio * width + 0.5)
    if count == 0:
        return None
    return DrawnUnits(width, count, fresh_seed(plan.seed, f"{prefix}.dropped_units", expert))


def _redrawn(
    site: LinearSite,
    hidden_dim: int,
    part: Span | None,
    units: DrawnUnits | None,
    other: int,
    seed: int,
) -> ParamSource:
    """``site``'s weight as (in, out), its hidden units (dim ``hidden_dim``: 1 for an up
    projection's outputs, 0 for the down's inputs; ``other`` wide along the other dim) cut to
    ``part``, with ``units`` of them redrawn from normal(mean, std) of the site's whole matrix
    (Drop-Upcycling) by a generator seeded with ``seed``; the plain cut when ``units`` is None."""
    source = _in_out(site, *((part, None) if hidden_dim == 0 else (None, part)))
    if units is None:
        return source
    whole = (_in_out(site),)
    shape = (units.count, other) if hidden_dim == 0 else (other, units.count)
    fill = Fresh("normal", shape, StdOf(whole), seed, MeanOf(whole))
    return Redrawn(source, hidden_dim, units, fill)


def _per_expert(sources: list[ParamSource]) -> ParamSource:
    """One expert tensor from one source per expert: ``Repeated`` when they are all the same."""
    if all(s == sources[0] for s in sources):
        return Repeated(sources[0], len(sources))
    return Stacked(tuple(sources))


def _in_out(site: LinearSite, rows: Span | None = None, cols: Span | None = None) -> FromSource:
    """``site``'s weight as (in, out) (``LinearSite.weight_in_out``), cut to ``[rows, cols]``
    (``cols`` counted within the site's outputs)."""
    outputs = _site_outputs(site, cols)
    return FromSource(site.weight, rows, outputs, transpose=site.weight_layout == "out_in")


def _bias(site: LinearSite, part: Span | None, width: int) -> ParamSource:
    """``site``'s bias cut to ``part`` of its outputs (zeros of ``width`` for a linear without
    one)."""
    if site.bias is None:
        return Fresh("zeros", (width,))
    return FromSource(site.bias, rows=_site_outputs(site, part))


def _site_outputs(site: LinearSite, part: Span | None) -> Span | None:
    """The matmul outputs that ``part`` of ``site``'s outputs are (a split projection's half
    starts at its ``out_span``)."""
    if site.out_span is None:
        return part
    start, stop = site.out_span
    return (start, stop) if part is None else (start + part[0], start + part[1])


def _scaled(source: ParamSource, scale: float) -> ParamSource:
    return source if scale == 1.0 else Scaled(source, scale)


def _no_block_left(plan: MoEPlan, blocks: list) -> str:
    """What ``moe.dense_first`` asks of the model, what the model has, and what to change,
    where it keeps every FFN block dense."""
    count = len(blocks)
    names = ", ".join(ffn_name(b.ffn) for b in blocks)
    change = (
        f"set moe.dense_first to at most {count - 1}, or use a model with more than "
        f"{plan.dense_first} FFN blocks"
    )
    return (
        f"the plan keeps the first {plan.dense_first} FFN blocks dense and needs at least one "
        f"more to turn into experts, but the model has {count} ({names}): {change}"
    )


def _wider_than_dense(plan: MoEPlan, regions: list[FFNRegion]) -> str | None:
    """What to say where ``moe.expert_width`` makes the experts wider than the dense FFNs they
    replace (a fixed width written for another model, most often); None where it does not."""
    width = plan.expert_width
    narrower = [r for r in regions if width is not None and width > r.hidden]
    if not narrower:
        return None
    first = narrower[0]
    return (
        f"moe.expert_width = {width} makes each routed expert wider than the dense FFN it "
        f"replaces ({first.hidden} wide in {ffn_name(first)}, {width / first.hidden:.3g}x): "
        "leave moe.expert_width unset for experts as wide as the model's FFN"
    )


def _check_width(plan: MoEPlan, width: int, where: str, why: str) -> None:
    """Refuse an ``expert_width`` other than ``width``, the only width ``why`` allows."""
    if plan.expert_width is not None and plan.expert_width != width:
        raise PlanError(
            "moe.expert_width",
            plan.expert_width,
            f"{why}, so each expert of {where} is {width} wide: leave moe.expert_width unset "
            f"(it then follows the model's FFN) or set it to {width}",
        )


def _scale_shared(gm: fx.GraphModule, region: FFNRegion, scale: float) -> dict[str, Scaled]:
    """Give the shared expert its own (scaled) down projection, leaving the user's model alone;
    return the new parameters' sources."""
    if scale == 1.0:
        return {}
    sources = {}
    for target in filter(None, (region.down.weight, region.down.bias)):
        owner_path, _, name = target.rpartition(".")
        owner = gm.get_submodule(owner_path)
        old = getattr(owner, name)
        setattr(owner, name, torch.nn.Parameter(old.detach() * scale, old.requires_grad))
        sources[target] = Scaled(FromSource(target), scale)
    return sources
