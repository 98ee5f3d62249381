"""Pass ``moe``: dense FFN regions -> router + routed experts (+ the dense FFN as shared expert).

Matches (per FFN region found by :mod:`moec.analysis.structure`, after the first
``plan.moe.dense_first`` blocks), e.g. a SwiGLU FFN on X: f32[B, S, D]::

    gate = linear(X, Wg)  up = linear(X, Wu)  act = mul(silu(gate), up)  out = linear(act, Wd)

Emits::

    logits = linear(X, router_weight)                                    # [B, S, N]
    _, weights, rows, offsets, counts = moec.route(logits, K, cf, gating, normalize, routing)
    buffer = moec.dispatch(X, rows)              # [B*S*K, D]; X cast to bf16 first under bf16
    y, _ = moec.expert_mlp(buffer, w_up, w_down, offsets, b_up, b_down, "swiglu")
    moe_out = moec.combine(y, weights, rows)                             # [B, S, D]
    result = add(out, moe_out) if shared_expert else moe_out             # replaces `out`
    losses = moec.router_losses(logits, counts, K, gating)               # extra graph output

Parameters live under ``<ffn module path>.moe`` (``router_weight``, ``w_up`` [N, D, U],
``w_down`` [N, H, D], ``b_up``, ``b_down``; ``w_up`` and ``w_down`` k-major, the contraction
dim unit-stride, when :meth:`~moec.plan.Plan.expert_weights_k_major`); the dense FFN's
parameters are removed unless it becomes the shared expert. Init (``plan.moe.init``), all
keeping the dense function where stated:

- ``upcycle``: every expert a copy of the dense FFN; with normalized weights the MoE equals the
  dense FFN at init. Router: normal(0, router_init_std).
- ``split``: the dense hidden units partitioned among the experts; the router starts at zero,
  so every chosen expert gets the same weight w0 and the down projections are scaled by 1/w0:
  with top_k = N the MoE equals the dense FFN at init.
- ``random``: fresh normal init at ``expert_width`` with the std of the dense matrices.
With a shared expert under ``upcycle``/``split`` both branches' output projections are halved,
so the sum still equals the dense FFN at init. Every random draw (router, ``random`` experts)
comes from a generator seeded by (``plan.moe.seed``, parameter name, expert index) alone, so
any expert range can be drawn by itself and the values do not depend on the layout.

Each new tensor is first described as a :data:`~moec.program.ParamSource` over the dense FFN's
parameter names (:func:`expert_sources`: upcycle ``Repeated``, split ``Stacked`` cuts with their
``Scaled`` down projections, ``Fresh`` draws) and then built from the graph's parameters; the
descriptions go to ``program.provenance`` (with the shared expert's ``Scaled`` down
projection), so a model captured on the meta device can be materialized from a dense
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
outputs are appended (``router_losses``, ``expert_counts``, ``expert_offsets``); the program
records each block as a :class:`~moec.program.MoELayer`, its parameters' roles (``router``,
``expert``) and their provenance.
"""

from __future__ import annotations

import dataclasses
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
    Fresh,
    FromSource,
    MoELayer,
    ParamSource,
    Repeated,
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
            f"experts={m.num_experts},top_k={m.top_k},init={m.init},gating={m.gating},"
            f"capacity={m.capacity_factor},shared={int(m.shared_expert)},"
            f"dense_first={m.dense_first},"
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
            raise PlanError(
                "moe.dense_first",
                plan.dense_first,
                f"fewer than the {len(blocks)} FFN blocks found in the model",
            )
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
                scale = 0.5 if plan.init in ("upcycle", "split") else 1.0
                program.provenance.update(_scale_shared(gm, region, scale))
            else:
                params_before = parameter_count(gm)
                erase_unused(gm, region.nodes())
                removed += params_before - parameter_count(gm)
            aux += nodes
            sig.aux_outputs += [
                (prefix, "router_losses"),
                (prefix, "expert_counts"),
                (prefix, "expert_offsets"),
            ]
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
            route = editor.call(
                moec_ops.route.default,
                (logits, plan.top_k, capacity, plan.gating, plan.normalize_weights, plan.routing),
                like=out,
            )
            route_weights, rows, offsets, counts = (editor.getitem(route, i) for i in range(1, 5))
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
            losses = editor.call(
                moec_ops.router_losses.default, (logits, counts, plan.top_k, plan.gating), like=out
            )
        out.replace_all_uses_with(result, delete_user_cb=lambda user: user is not result)
        return [losses, counts, offsets]


_CONTIGUOUS = {"memory_format": torch.contiguous_format}


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
    over the dense FFN's parameter names; every expert of a ``Fresh`` draw is seeded from
    (``plan.seed``, parameter name, expert index) only."""
    n, dim, hidden = plan.num_experts, region.dim, region.hidden
    has_up_bias = any(site.bias is not None for site in region.ups)
    has_down_bias = region.down.bias is not None
    shared_scale = 0.5 if plan.shared_expert and plan.init in ("upcycle", "split") else 1.0
    where = f"FFN {ffn_name(region)}"
    router = Fresh(
        "normal", (n, dim), plan.router_init_std, fresh_seed(plan.seed, f"{prefix}.router_weight")
    )

    def ups(part: Span | None = None) -> Concat:  # hidden units: the up projections' outputs
        return Concat(tuple(_in_out(site, cols=part) for site in region.ups), dim=1)

    def up_biases(part: Span | None, width: int) -> Concat:
        return Concat(tuple(_bias(site, part, width) for site in region.ups), dim=0)

    def down(part: Span | None = None) -> FromSource:  # hidden units: the down's inputs
        return _in_out(region.down, rows=part)

    if plan.init == "upcycle":
        _check_width(plan, hidden, where, "the dense width for init='upcycle'")
        b_down = FromSource(region.down.bias) if has_down_bias else None
        return {
            "router_weight": router,
            "w_up": Repeated(ups(), n),
            "w_down": Repeated(_scaled(down(), shared_scale), n),
            "b_up": Repeated(up_biases(None, hidden), n) if has_up_bias else None,
            "b_down": None if b_down is None else Repeated(_scaled(b_down, shared_scale), n),
        }
    if plan.init == "split":
        if hidden % n:
            raise PlanError(
                "moe.num_experts",
                n,
                f"a divisor of the dense FFN width {hidden} of {where} for init='split'",
            )
        width = hidden // n
        _check_width(plan, width, where, f"dense width / num_experts = {width} for init='split'")
        w0 = (
            1.0 / plan.top_k
            if plan.normalize_weights
            else (1.0 / n if plan.gating == "softmax" else 0.5)
        )
        scale = shared_scale / w0
        parts = [(e * width, (e + 1) * width) for e in range(n)]
        b_down = FromSource(region.down.bias) if has_down_bias else None
        return {
            "router_weight": Fresh("zeros", (n, dim)),
            "w_up": Stacked(tuple(ups(p) for p in parts)),
            "w_down": Stacked(tuple(Scaled(down(p), scale) for p in parts)),
            "b_up": Stacked(tuple(up_biases(p, width) for p in parts)) if has_up_bias else None,
            "b_down": None if b_down is None else Repeated(Scaled(b_down, scale / n), n),
        }
    width = plan.expert_width or hidden
    up_width = 2 * width if is_gated(region.activation) else width
    stds = {"w_up": StdOf((ups(),)), "w_down": StdOf((down(),))}
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
    return {
        "router_weight": router,
        **fresh,
        "b_up": Fresh("zeros", (n, up_width)) if has_up_bias else None,
        "b_down": Fresh("zeros", (n, dim)) if has_down_bias else None,
    }


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


def _check_width(plan: MoEPlan, width: int, where: str, allowed: str) -> None:
    if plan.expert_width is not None and plan.expert_width != width:
        raise PlanError("moe.expert_width", plan.expert_width, f"None or {allowed} ({where})")


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
