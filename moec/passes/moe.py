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
``w_down`` [N, H, D], ``b_up``, ``b_down``); the dense FFN's parameters are removed unless it
becomes the shared expert. Init (``plan.moe.init``), all keeping the dense function where stated:

- ``upcycle``: every expert a copy of the dense FFN; with normalized weights the MoE equals the
  dense FFN at init. Router: normal(0, router_init_std).
- ``split``: the dense hidden units partitioned among the experts; the router starts at zero,
  so every chosen expert gets the same weight w0 and the down projections are scaled by 1/w0:
  with top_k = N the MoE equals the dense FFN at init.
- ``random``: fresh normal init at ``expert_width`` with the std of the dense matrices.
With a shared expert under ``upcycle``/``split`` both branches' output projections are halved,
so the sum still equals the dense FFN at init.

An FFN of pointwise convolutions (channels-first, features in dim 1) is routed channels-last:
``X`` is permuted to put its features last before the router and dispatch, and the combined
output permuted back. The activations named in ``plan.moe.activations`` are registered (see
:func:`moec.ops.activations.register_activation`) before the FFNs are looked for.

Refuses (:class:`MoEPassError`, naming the model or module): a model with no FFN region (the
message lists the rejected candidates and the supported activations), and an FFN to convert
with a dropout of rate p > 0 on its hidden activation, which the fused expert op cannot apply,
unless ``plan.moe.ffn_dropout`` is ``drop``. FFNs kept dense keep their dropout.

Options: everything in ``plan.moe``. Statistics: ``ffns_replaced``, ``ffns_kept_dense``,
``params_added``, ``params_removed``, ``ffn_dropouts_dropped``. Invariants: those of
:mod:`moec.passes.rewrite`; the graph's user outputs are unchanged; per MoE block three aux
outputs are appended (``router_losses``, ``expert_counts``, ``expert_offsets``); the program
records each block as a :class:`~moec.program.MoELayer` and its parameters' roles (``router``,
``expert``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from moec.analysis.structure import (
    FFNRegion,
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
from moec.program import MoELayer

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
            f"dense_first={m.dense_first}"
        )

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        program = ctx.require_program(self.name)
        plan = ctx.plan.moe
        _register_plan_activations(plan)
        structure = find_structure(gm)
        blocks = structure.blocks
        if not blocks:
            raise MoEPassError(_no_ffn_message(gm, structure))
        if plan.dense_first >= len(blocks):
            raise PlanError(
                "moe.dense_first",
                plan.dense_first,
                f"fewer than the {len(blocks)} FFN blocks found in the model",
            )
        editor = GraphEditor(gm, self.name)
        compute_dtype = torch.bfloat16 if ctx.plan.precision.compute_dtype == "bf16" else None
        generator = torch.Generator().manual_seed(plan.seed)
        sig, roles, layers = program.signature, program.param_roles, program.moe_layers
        added = removed = 0
        aux: list[fx.Node] = []
        dropouts = [_check_dropout(b.ffn, plan) for b in blocks[plan.dense_first :]]
        for block in blocks[plan.dense_first :]:
            region = block.ffn
            weights = build_expert_weights(gm, region, plan, generator)
            prefix = f"{region.module_path or 'ffn_' + str(block.index)}.moe"
            nodes = self._rewrite(editor, region, weights, plan, prefix, compute_dtype)
            added += sum(t.numel() for t in dataclasses.astuple(weights) if t is not None)
            for name in ("router_weight", "w_up", "w_down", "b_up", "b_down"):
                roles[f"{prefix}.{name}"] = "router" if name == "router_weight" else "expert"
            if plan.shared_expert:
                _scale_shared(gm, region, 0.5 if plan.init in ("upcycle", "split") else 1.0)
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
            "params_added": added,
            "params_removed": removed,
            "ffn_dropouts_dropped": sum(dropouts),
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


def _no_ffn_message(gm: fx.GraphModule, structure: Structure) -> str:
    rejected = "; ".join(structure.rejected) or "none"
    return (
        f"no FFN region found in {model_name(gm)}: looked for linear (or pointwise conv) -> "
        f"activation -> linear chains among its {len(structure.linears)} linears; candidates "
        f"rejected: {rejected}; activations {supported_text()}; `moec inspect MODEL` lists "
        "the FFN regions found and the candidates rejected"
    )


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


def build_expert_weights(
    gm: fx.GraphModule, region: FFNRegion, plan: MoEPlan, generator: torch.Generator
) -> ExpertWeights:
    """The initial router and expert tensors for ``region`` under ``plan.init``."""
    n, dim, hidden = plan.num_experts, region.dim, region.hidden
    gated = is_gated(region.activation)
    ups = [site.weight_in_out(gm) for site in region.ups]  # each [D, H]
    up_biases = [site.bias_tensor(gm) for site in region.ups]
    w_down = region.down.weight_in_out(gm)  # [H, D]
    b_down = region.down.bias_tensor(gm)
    has_up_bias = any(b is not None for b in up_biases)
    zeros = torch.zeros(hidden, dtype=w_down.dtype, device=w_down.device)
    up_biases = [zeros if b is None else b for b in up_biases]
    shared_scale = 0.5 if plan.shared_expert and plan.init in ("upcycle", "split") else 1.0
    where = f"FFN {ffn_name(region)}"

    if plan.init == "upcycle":
        _check_width(plan, hidden, where, "the dense width for init='upcycle'")
        w_up = torch.cat(ups, dim=1).expand(n, -1, -1).clone()
        b_up = torch.cat(up_biases).expand(n, -1).clone() if has_up_bias else None
        w_dn = (w_down * shared_scale).expand(n, -1, -1).clone()
        b_dn = None if b_down is None else (b_down * shared_scale).expand(n, -1).clone()
        router = torch.randn(n, dim, generator=generator) * plan.router_init_std
    elif plan.init == "split":
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
        parts = [slice(e * width, (e + 1) * width) for e in range(n)]
        w_up = torch.stack([torch.cat([u[:, s] for u in ups], dim=1) for s in parts])
        b_up = (
            torch.stack([torch.cat([b[s] for b in up_biases]) for s in parts])
            if has_up_bias
            else None
        )
        w_dn = torch.stack([w_down[s] * scale for s in parts])
        b_dn = None if b_down is None else (b_down * scale / n).expand(n, -1).clone()
        router = torch.zeros(n, dim)
    else:
        width = plan.expert_width or hidden
        up_width = 2 * width if gated else width
        up_std, down_std = float(torch.cat(ups, 1).float().std()), float(w_down.float().std())
        w_up = torch.randn(n, dim, up_width, generator=generator) * up_std
        w_dn = torch.randn(n, width, dim, generator=generator) * down_std
        b_up = torch.zeros(n, up_width) if has_up_bias else None
        b_dn = None if b_down is None else torch.zeros(n, dim)
        router = torch.randn(n, dim, generator=generator) * plan.router_init_std
    like = {"dtype": w_down.dtype, "device": w_down.device}
    cast = lambda t: None if t is None else t.to(**like).contiguous()  # noqa: E731
    return ExpertWeights(cast(router), cast(w_up), cast(w_dn), cast(b_up), cast(b_dn))


def _check_width(plan: MoEPlan, width: int, where: str, allowed: str) -> None:
    if plan.expert_width is not None and plan.expert_width != width:
        raise PlanError("moe.expert_width", plan.expert_width, f"None or {allowed} ({where})")


def _scale_shared(gm: fx.GraphModule, region: FFNRegion, scale: float) -> None:
    """Give the shared expert its own (scaled) down projection, leaving the user's model alone."""
    if scale == 1.0:
        return
    for target in filter(None, (region.down.weight, region.down.bias)):
        owner_path, _, name = target.rpartition(".")
        owner = gm.get_submodule(owner_path)
        old = getattr(owner, name)
        setattr(owner, name, torch.nn.Parameter(old.detach() * scale, old.requires_grad))
