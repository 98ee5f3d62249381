"""Pass ``bind``: each ``moec::`` node bound to the implementation it runs on the program's target.

Runs last, always. Reads the program's :class:`~moec.kernels.target.Target` (the device
architecture and the installed backends: the compiler detects it from the example inputs'
device, or takes ``moec.compile(..., target=...)``); a program without one is bound for the
target detected for the CPU. Visits the graph, every sub-GraphModule it calls (recompute
regions) and every pipeline stage's graph.

Matches and emits:

- each ``aten.scaled_dot_product_attention`` call FlashAttention 4 takes (no mask, no dropout,
  half-precision compute or inputs, head dims FA4 runs on the target's chip), where
  ``plan.lowering.attention`` is ``fa4``, or ``auto`` on a CUDA target of :data:`AUTO_ARCHS`
  with FA4 installed::

      out = aten.scaled_dot_product_attention(q, k, v, is_causal=c, scale=s)
    becomes
      out = moec.flash_attention(q, k, v, c, s, impl="fa4")[0]

  (``impl="reference"`` on a CPU target: tests). A plan asking for ``fa4`` on a CUDA target
  without FA4 is refused (:class:`~moec.plan.PlanError` naming ``lowering.attention``); one
  whose attention all stays on SDPA gets a warning.
- each call of a ``moec::`` op that names its implementations (an ``impl`` argument; the table
  ``IMPLEMENTATIONS`` beside the op): its ``impl`` set to the one the target binds
  (:meth:`Target.expert_impl` for ``moec::expert_mlp`` and ``moec::quantized_linear`` by their
  recipe, :meth:`Target.implementation` for the others). ``auto`` is resolved here; nothing
  at run time chooses again but the implementations' own fallback to the reference for
  operands their kernels do not take.
- each argument of a ``moec::`` op that the target supplies (:meth:`Target.op_arguments`: the
  EP exchanges' ``poison``, ``asynchronous`` and ``copy_programs``, the fused loss's
  ``chunk_elements``), set
  from it. The EP ops' implementation is their ``path`` (:data:`moec.ops.ep.PATHS`), which
  pass ``expert_parallel`` resolved for the same target (:meth:`Target.ep_path`); it is
  recorded with them.

Invariants: values as before up to the implementations' summation order (every implementation
computes its op's reference); parameters, their gradients and the signature unchanged.
Records ``program.bindings`` (node -> ``op: impl`` and what that is); statistics: ``target``
(its description), ``bound`` (nodes), ``attention_swapped`` (SDPA calls now FA4's),
``attention_kept`` (SDPA calls left).
"""

from __future__ import annotations

import operator
import warnings
from typing import Any

import torch
import torch.fx as fx

import moec.ops  # noqa: F401  (registers torch.ops.moec)
from moec.fx import argument
from moec.kernels import flash_attention as fa4
from moec.kernels.target import Target, count_text
from moec.ops.ep import PATHS as EP_PATHS
from moec.passes.base import Pass, PassContext, PassResult, register_pass
from moec.passes.combine_experts import CombineExpertsPass
from moec.passes.rewrite import GraphEditor
from moec.plan import Plan, PlanError

moec_ops = torch.ops.moec
SDPA = torch.ops.aten.scaled_dot_product_attention.default

AUTO_ARCHS = ("sm90",)
"""Archs where attention ``auto`` runs FA4: Hopper, where it measured faster than cuDNN's
attention in the training step (benchmarks/RESULTS.md). Blackwell is FA4's own target, but
unmeasured here: there ``fa4`` asks for it."""
MAJORS = {"sm90": 9, "sm100": 10}
LAST_REWRITES = ("combine_experts", "pipeline")
"""The passes that run after ``combine_experts`` (bind runs after them and everything before)."""


def _moec_schema(node: fx.Node) -> torch._C.FunctionSchema | None:
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.name.startswith("moec::"):
        return None
    return schema


def implementation(node: fx.Node, target: Target) -> str | None:
    """The implementation ``target`` binds ``node`` to (None: not a ``moec::`` op with one)."""
    schema = _moec_schema(node)
    if schema is None or not any(a.name == "impl" for a in schema.arguments):
        return None
    op = schema.name.removeprefix("moec::")
    if op in ("expert_mlp", "quantized_linear"):
        return target.expert_impl(argument(node, "recipe", "bf16"))
    return target.implementation(op)


def bind_node(node: fx.Node, target: Target) -> str | None:
    """Set ``node``'s target-bound arguments (its ``impl`` and :meth:`Target.op_arguments`);
    returns what it runs, ``op: implementation (in words)``, or None: nothing bound."""
    schema = _moec_schema(node)
    if schema is None:
        return None
    names = {a.name for a in schema.arguments}
    bound = {k: v for k, v in target.op_arguments().items() if k in names}
    impl = implementation(node, target)
    if impl is not None:
        bound["impl"] = impl
    elif "path" in names:
        impl = argument(node, "path")
    if impl is None:
        return None
    node.kwargs = {**node.kwargs, **bound}
    op = schema.name.removeprefix("moec::")
    return f"{op}: {impl} ({describe(op, impl, node, target)})"


def describe(op: str, impl: str, node: fx.Node, target: Target) -> str:
    """What ``impl`` of ``op`` is on ``target``, in a few words (``moec debug`` prints it)."""
    if op.startswith("ep_"):
        poison = node.kwargs.get("poison")
        extras = [] if poison is None else [f"empty rows poisoned with {poison}"]
        if node.kwargs.get("asynchronous"):
            extras.append("left running from issue to wait")
        if node.kwargs.get("copy_programs") is not None:
            extras.append(f"copy kernel of {node.kwargs['copy_programs']} programs a tile")
        return "; ".join([EP_PATHS[impl], *extras])
    if op in ("expert_mlp", "quantized_linear"):
        recipe = argument(node, "recipe", "bf16")
        if recipe != "bf16":
            native = impl == "native" or (recipe == "mxfp8" and target.arch == "sm100")
            where = "native" if native and target.device == "cuda" else "emulated"
            return f"{recipe} {where}"
        if impl.startswith("kernels:"):
            return f"grouped GEMMs: {impl.partition(':')[2]} on {target.arch}"
    if op == "flash_attention":
        return (
            "FlashAttention 4 (SDPA swapped)" if impl == "fa4" else "the reference (SDPA swapped)"
        )
    words = {"triton": "moec's Triton kernels", "reference": "pure PyTorch"}.get(impl, impl)
    if op == "linear_cross_entropy":
        if impl == "cute":
            words = "quack's fused pipeline where it takes the head, else the Triton rows"
        return f"{words}; chunks of at most {count_text(node.kwargs['chunk_elements'])} logits"
    return words


def wants_fa4(plan: Plan, target: Target) -> bool:
    """Whether the program's attention goes to FA4 (see the module); raises where the plan asks
    for FA4 on a CUDA target without it."""
    chosen = plan.lowering.attention
    if chosen == "auto":
        return target.device == "cuda" and target.fa4 and target.arch in AUTO_ARCHS
    if chosen != "fa4":
        return False
    if target.device == "cuda" and not target.fa4:
        why = "flash-attn-4 is not installed" if not fa4.installed() else target.arch
        raise PlanError("lowering.attention", "fa4", f"a device where FA4 runs ({why})")
    return True


def sdpa_arguments(node: fx.Node, compute_half: bool, major: int | None) -> dict[str, Any] | None:
    """The SDPA call's arguments when FA4 takes it on a chip of compute capability ``major``.x
    (None: on either chip), else None."""
    root = node.graph.owning_module
    arguments = node.normalized_arguments(root, normalize_to_only_use_kwargs=True)
    if arguments is None:
        return None
    kwargs = arguments.kwargs
    q, k, v = (kwargs[name].meta.get("val") for name in ("query", "key", "value"))
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return None
    if kwargs.get("attn_mask") is not None or kwargs.get("dropout_p", 0.0) != 0.0:
        return None
    if not (compute_half or q.dtype in fa4.HALF_DTYPES):
        return None
    if q.dim() == k.dim() == 4 and q.shape[1] != k.shape[1] and not kwargs.get("enable_gqa"):
        return None  # SDPA itself refuses unequal heads without enable_gqa
    causal = bool(kwargs.get("is_causal", False))
    if fa4.shapes_why_not(q.shape, k.shape, v.shape, causal, major) is not None:
        return None
    scale = kwargs.get("scale")
    return {**kwargs, "is_causal": causal, "scale": q.shape[-1] ** -0.5 if scale is None else scale}


def swap_attention(gm: fx.GraphModule, compute_half: bool, major: int | None, impl: str):
    """Each SDPA call of ``gm`` FA4 takes swapped, in place, for ``moec::flash_attention`` with
    ``impl``: (swapped, kept)."""
    sdpa = gm.graph.find_nodes(op="call_function", target=SDPA)
    swapped = 0
    for node in sdpa:
        kwargs = sdpa_arguments(node, compute_half, major)
        if kwargs is None:
            continue
        q, k, v = (kwargs[name] for name in ("query", "key", "value"))
        edit = GraphEditor(gm, "bind")
        with gm.graph.inserting_before(node):
            attention = edit.call(
                moec_ops.flash_attention.default,
                (q, k, v, kwargs["is_causal"], float(kwargs["scale"])),
                node,
                {"impl": impl},
            )
            out = gm.graph.call_function(operator.getitem, (attention, 0))
        out.meta = dict(node.meta)
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        swapped += 1
    return swapped, len(sdpa) - swapped


def _graphs(gm: fx.GraphModule, ctx: PassContext) -> list[tuple[str, fx.GraphModule]]:
    """(prefix, graph) of the program's graph, its sub-graphs and its pipeline stages'."""
    roots = [("", gm)]
    pipeline = ctx.program.pipeline if ctx.program is not None else None
    if pipeline is not None:
        roots += [(f"stage{i}.", stage.graph) for i, stage in enumerate(pipeline.stages)]
    found = []
    for prefix, root in roots:
        for name, module in root.named_modules():
            if isinstance(module, fx.GraphModule):
                found.append((f"{prefix}{name}." if name else prefix, module))
    return found


@register_pass
class BindPass(Pass):
    name = "bind"
    after: tuple[str, ...] = (*CombineExpertsPass.after, *LAST_REWRITES)  # every other pass

    @staticmethod
    def applies(plan: Plan) -> bool:
        """always: the last pass"""
        return True

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        target = ctx.target
        fa4_here = wants_fa4(ctx.plan, target)
        half = ctx.plan.precision.compute_dtype == "bf16"
        attention_impl = target.implementation("flash_attention")
        bindings: dict[str, str] = {}
        swapped = kept = 0
        for prefix, graph in _graphs(gm, ctx):
            if fa4_here:
                done, left = swap_attention(graph, half, MAJORS.get(target.arch), attention_impl)
                swapped, kept = swapped + done, kept + left
            else:
                kept += len(graph.graph.find_nodes(op="call_function", target=SDPA))
            for node in graph.graph.nodes:
                bound = bind_node(node, target)
                if bound is not None:
                    bindings[f"{prefix}{node.name}"] = bound
            graph.recompile()
        if ctx.plan.lowering.attention == "fa4" and kept and not swapped:
            warnings.warn(
                f"moec: plan.lowering.attention = fa4, but none of the program's {kept} attention "
                "calls fits FlashAttention 4 (it takes no mask or dropout, bf16 compute "
                "(precision.compute_dtype) or half inputs, and the head dims of "
                "moec.kernels.flash_attention.shapes_why_not); they run on torch's SDPA",
                stacklevel=2,
            )
        if ctx.program is not None:
            ctx.program.target = target
            ctx.program.bindings = bindings
            for stage in ctx.program.pipeline.stages if ctx.program.pipeline else ():
                stage.target = target
                stage.bindings = {
                    k.partition(".")[2]: v
                    for k, v in bindings.items()
                    if k.startswith(f"stage{stage.stage_index}.")
                }
        stats = {
            "target": target.describe(),
            "bound": len(bindings),
            "attention_swapped": swapped,
            "attention_kept": kept,
        }
        return PassResult(gm, bool(bindings) or swapped > 0, stats)
