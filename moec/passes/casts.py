"""Pass ``shared_casts``: autocast's bf16 casts made explicit, one per float32 source.

Under bf16 autocast every matmul casts its float32 inputs itself. A norm output read by the q, k
and v projections is cast three times in the forward, and in the backward each cast's gradient
is cast back to float32 and the copies are added in float32: a full pass over the activation per
cast or add, a few per block and direction.

Matches  ops autocast runs in bf16 (linear, mm, matmul, bmm, addmm, baddbmm,
         scaled_dot_product_attention, moec.linear_cross_entropy, moec.quantized_linear, and
         any other op on autocast's lower-precision list for the program's device: convolutions,
         prelu, ...) and explicit casts to bf16,
         reading a source whose *runtime* dtype is float32 (found by propagating fake tensors
         through the graph under bf16 autocast, at the example's sizes in a fake mode of its
         own; the captured ``meta["val"]`` is autocast-free); and the weights of moec ops
         that cast their weights to their bf16 activation's dtype themselves
         (``expert_mlp``, whatever its recipe: in the forward and again in the backward,
         and they cast the weight gradients back, every step).
Emits    one ``aten._to_copy(source, dtype=bfloat16)`` per such source, right after it; every
         such reader reads it (explicit casts of the same source are merged into it). The
         matmuls are then all-bf16, so the graph means the same with and without autocast;
         ``meta["val"]`` is re-propagated (autocast-free semantics, as before).
Keeps    forward values bit for bit (the same round-to-nearest casts autocast and the ops do,
         and both leave bf16 inputs alone); gradients up to the order of their summation: the
         readers' bf16 gradients are summed in bf16 before the one cast back, as frameworks
         with bf16 activations do. A parameter's cast is left for ``working_weights`` to turn
         into a persistent copy.
Also    rewrites every outer product written as a matmul (``matmul`` / ``mm`` / ``bmm`` whose
         contraction has size 1, e.g. transformers' rotary table ``inv_freq @ positions``)
         as the broadcast ``mul`` it is: the same float32 values, which autocast does not
         cast. Eager code computes such tables with autocast disabled; capture, run without
         autocast, does not record that, and in bf16 positions above 256 would round.
Runs only when ``precision.compute_dtype`` is bf16.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

import moec.ops  # noqa: F401  (registers torch.ops.moec)
from moec.analysis.structure import CASTS, MATMUL_OPS
from moec.fx import evaluate, example_sizes, sym
from moec.passes.base import Pass, PassContext, PassResult, register_pass
from moec.passes.rewrite import GraphEditor, refresh_meta
from moec.plan import Plan

aten = torch.ops.aten
AUTOCAST_BF16 = MATMUL_OPS | {
    aten.scaled_dot_product_attention.default,
    torch.ops.moec.linear_cross_entropy.default,  # registered with autocast by moec.ops.loss
    torch.ops.moec.quantized_linear.default,  # and by moec.ops.quantized
}
"""Ops on autocast's lower-precision list for both CUDA and CPU: they cast float inputs."""
SELF_CASTING = {
    torch.ops.moec.expert_mlp.default: (1, 2),
}
"""moec ops that cast the float inputs at these positions to their first input's dtype."""


def lowered_by_autocast(
    node: fx.Node, dtypes: dict[fx.Node, torch.dtype], device_type: str
) -> bool:
    """Whether bf16 autocast on ``device_type`` runs ``node`` in bf16, casting every float32
    input: one of :data:`AUTOCAST_BF16`, or an op with an autocast kernel for the device whose
    output is float32 without autocast (``meta["val"]``) and bf16 under it (``dtypes``): the
    lower-precision list (autocast's float32 and promote lists never lower a dtype)."""
    if node.target in AUTOCAST_BF16:
        return True
    if not isinstance(node.target, torch._ops.OpOverload) or dtypes.get(node) != torch.bfloat16:
        return False
    plain = node.meta.get("val")
    if not isinstance(plain, torch.Tensor) or plain.dtype != torch.float32:
        return False
    key = f"Autocast{device_type.upper()}"  # AutocastCPU, AutocastCUDA
    return torch._C._dispatch_has_kernel_for_dispatch_key(node.target.name(), key)


class _RuntimeDtypes(fx.Interpreter):
    """Fake propagation from the placeholders' and parameters' ``meta["val"]`` at the example's
    sizes, in a fake mode of its own: dtypes do not depend on sizes, and the device's dispatch
    (CUDA attention choosing its backend by shape) must not add guards to the program's
    symbolic sizes. Values of a graph captured on the meta device become fake tensors of
    ``device_type`` (autocast only acts on tensors of its own device: on meta ones it would
    leave every matmul in float32, and bf16 values would look float32 and be cast again)."""

    def __init__(self, gm: fx.GraphModule, device_type: str):
        super().__init__(gm, garbage_collect_values=False)
        self.device_type = device_type
        self.sizes = example_sizes(gm)

    def _example(self, sizes: Any) -> list[int]:
        """Sizes (ints or SymInts) at the capture's example values."""
        return [evaluate(sym(size), self.sizes) for size in sizes]

    def run_node(self, n: fx.Node) -> Any:
        if n.op in ("placeholder", "get_attr"):
            val = n.meta["val"]
            if isinstance(val, torch.Tensor):
                device = self.device_type if val.device.type == "meta" else val.device
                return torch.empty_strided(
                    self._example(val.shape),
                    self._example(val.stride()),
                    dtype=val.dtype,
                    device=device,
                )
            return self._example([val])[0] if isinstance(val, torch.SymInt) else val
        return super().run_node(n)

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        args, kwargs = fx.node.map_aggregate((args, kwargs), self._concrete)
        return super().call_function(target, args, kwargs)

    def _concrete(self, arg: Any) -> Any:
        # factories captured on meta (arange(device=meta) for a rotary table) move along; a
        # size a pass wrote into the graph as a SymInt is read at its example value, so no
        # guard reaches the program's shape environment
        if isinstance(arg, torch.device) and arg.type == "meta":
            return torch.device(self.device_type)
        if isinstance(arg, torch.SymInt):
            return self._example([arg])[0]
        return arg


def runtime_dtypes(gm: fx.GraphModule, device_type: str) -> dict[fx.Node, torch.dtype]:
    """The dtype of every tensor-valued node when the graph runs under bf16 autocast."""
    interp = _RuntimeDtypes(gm, device_type)
    with FakeTensorMode(), torch.autocast(device_type, dtype=torch.bfloat16):
        interp.run(*[None] * len(gm.graph.find_nodes(op="placeholder")))
    return {n: v.dtype for n, v in interp.env.items() if isinstance(v, torch.Tensor)}


def is_bf16_cast(node: fx.Node) -> bool:
    """A dtype-only cast to bf16 (``_to_copy`` / ``to.dtype``)."""
    if node.target not in CASTS or len(node.args) > 2:
        return False
    return node.kwargs.get("dtype", node.args[1] if len(node.args) > 1 else None) == torch.bfloat16


def _bf16(edit: GraphEditor, node: fx.Node) -> fx.Node:
    return edit.call(aten._to_copy.default, (node,), node, {"dtype": torch.bfloat16})


def _device_type(gm: fx.GraphModule, target: str | None) -> str:
    """The device type whose autocast rules the program runs under: its inputs' device; a graph
    captured on the meta device runs where it is materialized: the device of its ``target``
    (the machine the compiler bound it for), else (none, or ``meta``) on CUDA when this machine
    has it (autocast's op lists differ per device), else on the CPU."""
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            if val.device.type != "meta":
                return val.device.type
            if target in ("cuda", "cpu"):
                return target
            return "cuda" if torch.cuda.is_available() else "cpu"
    return "cpu"


def _cast_inputs(
    node: fx.Node, dtypes: dict[fx.Node, torch.dtype], device_type: str
) -> list[fx.Node]:
    """The float32 inputs ``node`` reads in bf16 at runtime."""
    if lowered_by_autocast(node, dtypes, device_type):
        inputs = node.all_input_nodes
    elif node.target in SELF_CASTING and dtypes.get(node.args[0]) == torch.bfloat16:
        inputs = [node.args[i] for i in SELF_CASTING[node.target]]
    else:
        return []
    return [s for s in dict.fromkeys(inputs) if dtypes.get(s) == torch.float32]


OUTER_PRODUCT_OPS = {aten.matmul.default, aten.mm.default, aten.bmm.default}


def _outer_products_as_mul(gm: fx.GraphModule, edit: GraphEditor) -> int:
    """Replace ``a @ b`` with ``a * b`` where a is [..., M, 1] and b is [..., 1, N]."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.target not in OUTER_PRODUCT_OPS or len(node.args) != 2 or node.kwargs:
            continue
        a, b = (arg.meta["val"] for arg in node.args)
        if (
            a.dim() < 2
            or b.dim() < 2
            or not (_static_one(a.shape[-1]) and _static_one(b.shape[-2]))
        ):
            continue
        with gm.graph.inserting_before(node):
            product = edit.call(aten.mul.Tensor, node.args, node)
        node.replace_all_uses_with(product)
        gm.graph.erase_node(node)
        count += 1
    return count


def _static_one(size: int | torch.SymInt) -> bool:
    return isinstance(size, int) and size == 1


@register_pass
class SharedCastsPass(Pass):
    name = "shared_casts"
    after: tuple[str, ...] = ("moe", "expert_parallel", "precision", "fused_loss")

    @staticmethod
    def applies(plan: Plan) -> bool:
        """precision.compute_dtype is bf16"""
        return plan.precision.compute_dtype == "bf16"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        if ctx.plan.precision.compute_dtype != "bf16":
            return PassResult(gm, False, {"sources_cast": 0})
        edit = GraphEditor(gm, self.name)
        outer = _outer_products_as_mul(gm, edit)
        target = ctx.program.target if ctx.program is not None else None
        device_type = _device_type(gm, target and target.device)
        dtypes = runtime_dtypes(gm, device_type)
        casts: dict[fx.Node, fx.Node] = {}  # float32 source -> its one bf16 cast
        readers = merged = 0

        def cast_of(source: fx.Node) -> fx.Node:
            if source not in casts:
                with gm.graph.inserting_after(source):
                    casts[source] = _bf16(edit, source)
            return casts[source]

        for node in list(gm.graph.nodes):
            if is_bf16_cast(node) and dtypes.get(node.args[0]) == torch.float32:
                source = node.args[0]
                if source in casts:
                    node.replace_all_uses_with(casts[source])
                    gm.graph.erase_node(node)
                    merged += 1
                else:
                    casts[source] = node
            else:
                for source in _cast_inputs(node, dtypes, device_type):
                    node.replace_input_with(source, cast_of(source))
                    readers += 1
        refresh_meta(gm)
        gm.recompile()
        stats = {
            "sources_cast": len(casts),
            "readers": readers,
            "casts_merged": merged,
            "outer_products": outer,
        }
        return PassResult(gm, readers + merged + outer > 0, stats)
