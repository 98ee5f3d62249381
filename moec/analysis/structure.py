"""Find linears, FFN regions and residual blocks in an ATen graph, from structure alone.

- A **linear site** is a matmul by a parameter: ``aten.linear(x, W[out, in], b?)`` (or the
  ``precision`` pass's ``moec.quantized_linear(x, W, b, recipe)``),
  ``aten.addmm(b, x, W[in, out])`` (transformers' Conv1D), ``aten.mm/matmul(x, W[in, out])`` or
  by ``aten.t(W)`` / ``W.T`` (Falcon); or a pointwise convolution
  ``aten.conv1d/conv2d(x, W[out, in, 1(, 1)], b?)`` (kernel 1, stride 1, one group), a linear
  over the channel dim 1 of ``x``. Views between the
  activation and the matmul, and dtype casts of the parameter (``shared_casts``' bf16 copies,
  ``working_weights``' persistent ones), are looked through.
- An **FFN region** is one or two "up" linear sites reading the same input X, joined by
  elementwise ops (the activation, the gate multiply) into one tensor that is the input of one
  "down" linear site, with no value of the region used outside it. The activation is identified
  by evaluating the joining subgraph on sample values against the activations of
  :mod:`moec.ops.activations` (built-in and registered), so any decomposition (``gelu_new`` as
  tanh/pow/mul, ``silu`` as ``x * sigmoid(x)``, QuickGELU, ``relu(x) ** 2``) is recognised. A
  region's sites are all linears or all pointwise convolutions (its ``channel_dim``).
  A ``moec.glu`` fed by one linear of concatenated [gate; up] weights (the ``fuse_glu`` pass's
  form, or one working copy of both) is the same region with the activation the op names. So
  is one linear whose output is split into its two halves along the features (``chunk``,
  ``split``, ``slice``; Phi-3's and GLM's ``gate_up_proj``): each half is an up site with an
  ``out_span`` of the shared weight.
  A down linear fed through a normalization (between the activation and the down projection,
  as BitNet's ``ffn_sub_norm``) from up linears of one input is a rejected candidate naming it.
  So is an FFN whose features are a symbolic size (one that follows the input's sizes): it
  runs over positions, as an MLP-Mixer's token-mixing MLP on a transposed tensor does, and
  routing its rows would route features, not tokens (:attr:`Structure.over_positions`).
- An FFN region whose input also feeds a **router** (a linear outside the region whose output
  reaches an ``aten.topk`` through elementwise ops, casts and softmaxes) is the shared expert
  of an MoE block the model routes already: the region records that top-k as its ``router``.
- A **block** ends at the residual add that consumes an FFN output; blocks are numbered in
  topological order, so "the first N blocks" is well defined.

Names come from ``nn_module_stack`` and are used only for naming and messages.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable

import torch
import torch.fx as fx

from moec.fx import module_path, node_order, sym
from moec.ops.activations import gated_from_unary, unary_candidates
from moec.ops.working_weights import working_copy

aten = torch.ops.aten

VIEW_OPS = {
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.flatten.using_ints,
    aten.unflatten.int,
    aten.contiguous.default,
    aten.alias.default,
}
TRANSPOSE_OPS = {aten.t.default, aten.permute.default, aten.transpose.int, aten.numpy_T.default}
"""On a 2-D parameter, each reads it transposed (``numpy_T``: ``W.T``, Falcon's linears)."""
MATMUL_OPS = frozenset(
    {
        aten.linear.default,
        aten.mm.default,
        aten.matmul.default,
        aten.bmm.default,
        aten.addmm.default,
        aten.baddbmm.default,
    }
)
POINTWISE_CONV_OPS = frozenset(
    {aten.conv1d.default, aten.conv2d.default, aten.conv1d.padding, aten.conv2d.padding}
)
IDENTITY_ELEMENTWISE = {aten.dropout.default, aten.clone.default, aten.contiguous.default}
CASTS = frozenset({aten._to_copy.default, aten.to.dtype})
"""Dtype casts: a parameter read through one (``shared_casts``' bf16 copies) is that parameter."""


@dataclasses.dataclass
class LinearSite:
    node: fx.Node
    """The matmul node (its output is the linear's output, maybe 2D for addmm)."""
    input: fx.Node
    """The activation the linear reads, with views looked through."""
    weight: str
    """``get_attr`` target of the weight."""
    bias: str | None
    weight_layout: str
    """``out_in`` (nn.Linear) or ``in_out`` (Conv1D / x @ W)."""
    in_features: int
    out_features: int
    channel_dim: int = -1
    """The dim of the input holding the features: -1 for a matmul, 1 for a pointwise conv."""
    out_span: tuple[int, int] | None = None
    """The outputs ``[start, stop)`` of the matmul this site is (one half of a projection split
    after it; ``out_features`` is their count); None: all of them."""

    def weight_in_out(self, gm: fx.GraphModule) -> torch.Tensor:
        """The weight as (in, out), detached (a conv's trailing kernel dims of size 1 dropped),
        cut to ``out_span``."""
        w = gm.get_parameter(self.weight).detach().flatten(1)
        w = w.t() if self.weight_layout == "out_in" else w
        return w if self.out_span is None else w[:, slice(*self.out_span)]


@dataclasses.dataclass
class FFNRegion:
    input: fx.Node
    ups: list[LinearSite]
    """The up linears; for gated activations ``[gate, up]`` (after ``fuse_glu``, or as the
    halves of a split projection, both name the one matmul that computes them)."""
    down: LinearSite
    interior: list[fx.Node]
    """Elementwise and view nodes strictly between the ups and the down linear (and the split
    of a projection cut in two halves)."""
    output: fx.Node
    """The region's result: the down linear, or a trailing view back to X's shape."""
    activation: str
    module_path: str
    """Common module path of the region's linears (``layers.3.ffn``)."""
    router: fx.Node | None = None
    """The ``aten.topk`` of a router that reads ``input`` too: the region is then the shared
    expert of an MoE block the model has already (see the module docstring)."""

    @property
    def hidden(self) -> int:
        return self.down.in_features

    @property
    def dim(self) -> int:
        return self.ups[0].in_features

    @property
    def channel_dim(self) -> int:
        """The dim of ``input`` (and ``output``) holding the features: -1, or 1 for convs."""
        return self.down.channel_dim

    def dropouts(self) -> list[fx.Node]:
        """The ``aten.dropout`` nodes between the up and down linears with a rate p > 0."""
        return [n for n in self.interior if _target(n) == aten.dropout.default and n.args[1] > 0]

    def nodes(self) -> list[fx.Node]:
        """Every node the region owns (ups, interior, down and trailing views)."""
        owned = [u.node for u in self.ups] + self.interior + [self.down.node]
        node = self.down.node
        while node is not self.output:
            (node,) = node.users
            owned.append(node)
        return list(dict.fromkeys(owned))  # a fused gate/up pair shares its matmul


@dataclasses.dataclass
class Block:
    index: int
    ffn: FFNRegion
    residual: fx.Node | None
    """The residual add that consumes the FFN output (None if the model has none)."""


@dataclasses.dataclass
class Structure:
    linears: list[LinearSite]
    blocks: list[Block]
    rejected: list[str]
    """Why candidate down linears were not taken as FFNs (for ``moec inspect`` and errors)."""
    over_positions: list[str] = dataclasses.field(default_factory=list)
    """The FFN-shaped candidates whose features are positions (token-mixing MLPs), by name;
    each is among ``rejected`` too."""


def _target(node: fx.Node) -> object:
    return node.target if node.op == "call_function" else None


def strip_views(node: fx.Node) -> fx.Node:
    while _target(node) in VIEW_OPS and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _joined(node: object) -> list[fx.Node] | None:
    """The parameter reads a node joins along dim 0: a ``cat``'s pieces, a working copy's
    masters."""
    target = _target(node) if isinstance(node, fx.Node) else None
    if target == aten.cat.default and (node.args[1:] or (0,))[0] == 0:
        return list(node.args[0])
    return list(node.args[1]) if target is working_copy else None


def _uncast(node: object) -> object:
    """The tensor a cast (or a working copy of one parameter) reads."""
    while isinstance(node, fx.Node):
        if _target(node) in CASTS and isinstance(node.args[0], fx.Node):
            node = node.args[0]
        elif _target(node) is working_copy and len(node.args[1]) == 1:
            node = node.args[1][0]
        else:
            break
    return node


def _param_target(node: object) -> tuple[str, bool] | None:
    """(get_attr target, transposed?) if ``node`` is a parameter, maybe through a transpose and
    dtype casts."""
    node = _uncast(node)
    if not isinstance(node, fx.Node):
        return None
    if node.op == "get_attr":
        return str(node.target), False
    if _target(node) in TRANSPOSE_OPS and isinstance(node.args[0], fx.Node):
        inner = _uncast(node.args[0])
        if inner.op == "get_attr" and inner.meta["val"].dim() == 2:
            return str(inner.target), True
    return None


LINEARS = (aten.linear.default, torch.ops.moec.quantized_linear.default)
"""Linears of a weight [out, in] whose first three arguments are (x, weight, bias)."""


def _fused_glu_ups(glu: fx.Node) -> list[LinearSite] | None:
    """[gate, up] of a ``moec.glu`` fed by ``linear(x, cat([W_gate, W_up]), cat([b_gate, b_up])?)``
    (the ``fuse_glu`` pass's form): two sites sharing the fused matmul node."""
    h = strip_views(glu.args[0])
    if _target(h) not in LINEARS:
        return None

    def halves(arg: object) -> list[str] | None:
        params = [_param_target(p) for p in _joined(arg) or []]
        if len(params) != 2 or any(p is None or p[1] for p in params):
            return None
        return [p[0] for p in params]

    weights = halves(h.args[1])
    biases = halves(h.args[2]) if len(h.args) > 2 and h.args[2] is not None else [None, None]
    if weights is None or biases is None:
        return None
    out_f, in_f = _joined(h.args[1])[0].meta["val"].shape
    x = strip_views(h.args[0])
    return [LinearSite(h, x, w, b, "out_in", in_f, out_f) for w, b in zip(weights, biases)]


SPLIT_OPS = frozenset({aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default})


def _bound_args(node: fx.Node) -> dict[str, object]:
    """An ATen call's arguments by schema name, defaults filled in."""
    schema = node.target._schema.arguments
    bound = {a.name: a.default_value for a in schema if a.has_default_value()}
    bound.update(zip((a.name for a in schema), node.args))
    bound.update(node.kwargs)
    return bound


def output_slice(node: fx.Node) -> tuple[fx.Node, fx.Node | None, int, int] | None:
    """(source, split node or None, start, stop) if ``node`` is the features ``[start, stop)``
    of ``source`` (its last dim): a piece of a ``chunk``/``split`` or a unit-step ``slice``."""
    split = node.args[0] if _target(node) == operator.getitem else None
    if isinstance(split, fx.Node) and _target(split) in SPLIT_OPS:
        bound, index = _bound_args(split), node.args[1]
    elif _target(node) == aten.slice.Tensor:
        bound = _bound_args(node)
    else:
        return None
    source = bound["self"]
    shape = source.meta["val"].shape
    width = shape[-1]
    if bound["dim"] not in (-1, len(shape) - 1) or not isinstance(width, int):
        return None
    if split is None:
        bounds = (bound["start"], bound["end"])
        if bound["step"] != 1 or not all(b is None or isinstance(b, int) for b in bounds):
            return None  # a symbolic bound: not a fixed cut of the features
        start, stop, _ = slice(*bounds).indices(width)
        return source, None, start, stop
    if _target(split) == aten.split_with_sizes.default:
        sizes = list(bound["split_sizes"])
    else:
        chunks = bound.get("chunks")
        piece = -(-width // chunks) if isinstance(chunks, int) else bound["split_size"]
        if not isinstance(piece, int) or piece <= 0:
            return None
        sizes = [min(piece, width - start) for start in range(0, width, piece)]
    if not all(isinstance(size, int) for size in sizes):
        return None
    return source, split, sum(sizes[:index]), sum(sizes[: index + 1])


def linear_site(node: fx.Node) -> LinearSite | None:
    target = _target(node)
    if target in POINTWISE_CONV_OPS:
        return _pointwise_conv_site(node)
    if target in LINEARS:
        weight = _param_target(node.args[1])
        bias = _param_target(node.args[2]) if len(node.args) > 2 else None
        if weight is None or weight[1]:
            return None
        out_f, in_f = node.args[1].meta["val"].shape
        bias_name = bias[0] if bias else None
        return LinearSite(
            node, strip_views(node.args[0]), weight[0], bias_name, "out_in", in_f, out_f
        )
    if target in (aten.addmm.default, aten.mm.default, aten.matmul.default):
        x, w = (node.args[1], node.args[2]) if target == aten.addmm.default else node.args[:2]
        weight = _param_target(w)
        if weight is None or w.meta["val"].dim() != 2:
            return None
        bias = _param_target(node.args[0]) if target == aten.addmm.default else None
        if target == aten.addmm.default and bias is None:
            return None
        in_f, out_f = w.meta["val"].shape
        layout = "out_in" if weight[1] else "in_out"
        return LinearSite(
            node, strip_views(x), weight[0], bias[0] if bias else None, layout, in_f, out_f
        )
    return None


def _pointwise_conv_site(node: fx.Node) -> LinearSite | None:
    """A batched convolution with kernel size 1, stride 1 and one group, as a linear site over
    the channel dim 1 (any padding mode of a size-1 kernel pads nothing)."""
    bound = _bound_args(node)
    weight, bias = _param_target(bound["weight"]), bound.get("bias")
    bias = _param_target(bias) if bias is not None else None
    if weight is None or weight[1] or (bound.get("bias") is not None and bias is None):
        return None
    w_shape, x = bound["weight"].meta["val"].shape, bound["input"]
    stride = bound["stride"] if isinstance(bound["stride"], (list, tuple)) else [bound["stride"]]
    pointwise = all(k == 1 for k in w_shape[2:]) and all(s == 1 for s in stride)
    if not pointwise or bound["groups"] != 1 or x.meta["val"].dim() != len(w_shape):
        return None
    if isinstance(bound["padding"], (list, tuple)) and any(bound["padding"]):
        return None
    out_f, in_f = w_shape[:2]
    return LinearSite(
        node, strip_views(x), weight[0], bias[0] if bias else None, "out_in", in_f, out_f, 1
    )


def is_elementwise(node: fx.Node) -> bool:
    target = _target(node)
    if target in IDENTITY_ELEMENTWISE or target in VIEW_OPS:
        return True
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags


def model_name(gm: fx.GraphModule) -> str:
    """The class name of the captured model (from the root entry of ``nn_module_stack``)."""
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            path, kind = next(iter(stack.values()))
            if path == "":
                return str(getattr(kind, "__name__", kind)).rpartition(".")[2]
    return "the model"


def _common_path(paths: Iterable[str]) -> str:
    split = [p.split(".") for p in paths if p]
    if not split:
        return ""
    common = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)


def find_structure(gm: fx.GraphModule) -> Structure:
    order = node_order(gm.graph)
    linears = [s for s in map(linear_site, gm.graph.nodes) if s is not None]
    by_node = {s.node: s for s in linears}
    rejected: list[str] = []
    regions: list[FFNRegion] = []
    claimed: set[fx.Node] = set()
    for down in linears:
        if down.node in claimed:
            continue
        region = _region_for(down, by_node, rejected)
        if region is None:
            continue
        regions.append(region)
        claimed.update(region.nodes())
    over_positions = [_name(r) for r in regions if not _features_are_static(r)]
    rejected += [
        f"{name}: its features are a size that follows the input's (it mixes positions, as a "
        "token-mixing MLP does; routed experts route each position's features)"
        for name in over_positions
    ]
    regions = [r for r in regions if _features_are_static(r)]
    regions.sort(key=lambda r: order[r.output])
    for region in regions:
        region.router = _router_reading(region, linears)
    blocks = [Block(i, r, _residual_add(r.output)) for i, r in enumerate(regions)]
    return Structure(linears, blocks, rejected, over_positions)


def _features_are_static(region: FFNRegion) -> bool:
    """Whether the region's input holds its features in a dim of static size."""
    return sym(region.input.meta["val"].shape[region.channel_dim]).is_number


def _name(region: FFNRegion) -> str:
    return region.module_path or module_path(region.down.node) or region.down.node.name


SOFTMAX_OPS = frozenset({aten._softmax.default, aten.softmax.int})
NORM_OPS = frozenset(
    {
        aten.mean.dim,
        aten.var.correction,
        aten.var_mean.correction,
        aten.layer_norm.default,
        aten.rms_norm.default,
    }
)
"""What a normalization of its first argument reduces with (decomposed or whole)."""


def _router_reading(region: FFNRegion, linears: list[LinearSite]) -> fx.Node | None:
    """The ``aten.topk`` that a linear outside ``region`` reading its input leads to through
    elementwise ops, casts and softmaxes (the gate of an MoE block's router), or None."""
    owned = set(region.nodes())
    stack = [s.node for s in linears if s.input is region.input and s.node not in owned]
    seen: set[fx.Node] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            if _target(user) == aten.topk.default:
                return user
            if is_elementwise(user) or _target(user) in SOFTMAX_OPS | CASTS:
                stack.append(user)
    return None


def _region_for(
    down: LinearSite, by_node: dict[fx.Node, LinearSite], rejected: list[str]
) -> FFNRegion | None:
    interior: list[fx.Node] = []
    ups: dict[fx.Node, LinearSite] = {}
    stack, seen = (
        [down.node.args[1] if _target(down.node) == aten.addmm.default else down.node.args[0]],
        set(),
    )
    fused: list[LinearSite] | None = None
    splits: list[fx.Node] = []  # the split ops and pieces between a halved projection and ups
    reads: list[str] = []  # parameters and buffers the ops between the linears read
    blockers: list[fx.Node] = []  # non-elementwise ops the walk met (a norm, attention)
    while stack:
        node = stack.pop()
        if not isinstance(node, fx.Node) or node in seen:
            continue
        seen.add(node)
        if node.op == "get_attr":
            reads.append(str(node.target))
            continue
        if node in by_node:
            ups[node] = by_node[node]
            continue
        if _target(node) == torch.ops.moec.glu.default:  # a fused gated FFN: one matmul up
            fused = _fused_glu_ups(node)
            if fused is None:
                return None
            interior.append(node)
            ups[fused[0].node] = fused[0]
            continue
        piece = output_slice(node)
        if piece is not None and piece[0] in by_node:  # a half of one projection's outputs
            source, split, start, stop = piece
            site = by_node[source]
            ups[node] = dataclasses.replace(site, out_span=(start, stop), out_features=stop - start)
            splits += [node] + ([split] if split is not None else [])
            continue
        if not is_elementwise(node):
            blockers.append(node)  # attention, a norm, an embedding: no region here
            if _target(node) in CASTS | NORM_OPS:  # go on, to tell a norm inside an FFN
                stack.append(node.args[0])
            continue
        interior.append(node)
        stack.extend(a for a in node.args if isinstance(a, fx.Node))
    if not interior or not 1 <= len(ups) <= 2 or (fused is not None and len(ups) != 1):
        return None
    inputs = {site.input for site in ups.values()}
    name = module_path(down.node) or down.node.name
    if blockers:  # an FFN with a norm inside, or no FFN at all (say, a linear after attention)
        x = next(iter(inputs))
        norms = [n for n in blockers if _target(n) in NORM_OPS]
        only_norms = all(_target(n) in CASTS | NORM_OPS for n in blockers)
        if norms and only_norms and len(inputs) == 1 and _output_like(down.node, x) is not None:
            op = norms[0]
            where = module_path(op)
            rejected.append(
                f"{name}: {op.target} ({where or op.name}) runs between its up and down "
                "linears (routed experts run elementwise activations only)"
            )
        return None
    halved = [site for site in ups.values() if site.out_span is not None]
    if halved and not _tile_the_output(halved, len(ups)):
        rejected.append(f"{name}: reads part of {halved[0].node.name}'s outputs")
        return None
    if len(inputs) != 1:
        rejected.append(f"{name}: up linears read different inputs")
        return None
    if len({site.channel_dim for site in [*ups.values(), down]}) != 1:
        rejected.append(f"{name}: mixes linears and pointwise convolutions")
        return None
    region_nodes = set(interior) | set(ups) | set(splits) | {site.node for site in halved}
    for node in region_nodes:
        outside = [u for u in node.users if u not in region_nodes and u is not down.node]
        if outside:
            rejected.append(f"{name}: {node.name} is also used by {outside[0].name}")
            return None
    if reads:
        rejected.append(
            f"{name}: the activation reads {', '.join(sorted(reads))} (a learned or parametrised "
            "activation: routed experts run parameter-free ones)"
        )
        return None
    if fused is not None:
        glu = next(n for n in interior if _target(n) == torch.ops.moec.glu.default)
        activation, ordered_ups = glu.args[1], fused
    else:
        identified = _identify_activation(interior, ups)
        if identified is None:
            rejected.append(f"{name}: activation not recognised")
            return None
        activation, ordered_ups = identified
    x = ordered_ups[0].input
    output = _output_like(down.node, x)
    if output is None:
        rejected.append(f"{name}: output shape never matches the input's")
        return None
    path = _common_path(module_path(s.node) for s in [*ordered_ups, down])
    return FFNRegion(x, ordered_ups, down, interior + splits, output, activation, path)


def _tile_the_output(halves: list[LinearSite], ups: int) -> bool:
    """Whether the pieces of a split projection are all the region's ups and together all of
    its outputs, each once."""
    spans = sorted(site.out_span for site in halves)
    whole = (0, halves[0].node.meta["val"].shape[-1])
    joined = all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    one_matmul = len({site.node for site in halves}) == 1
    return one_matmul and len(halves) == ups and joined and (spans[0][0], spans[-1][1]) == whole


def _output_like(node: fx.Node, x: fx.Node) -> fx.Node | None:
    """``node`` or the single-user view chain after it that restores X's shape."""
    want = x.meta["val"].shape
    while node.meta["val"].shape != want:
        if len(node.users) != 1:
            return None
        (user,) = node.users
        if _target(user) not in VIEW_OPS:
            return None
        node = user
    return node


def _residual_add(output: fx.Node) -> fx.Node | None:
    node = output
    while True:
        users = list(node.users)
        if len(users) != 1:
            return None
        node = users[0]
        if _target(node) in (aten.add.Tensor, operator.add):
            return node
        if _target(node) not in IDENTITY_ELEMENTWISE:
            return None


def _identify_activation(
    interior: list[fx.Node], up_outputs: dict[fx.Node, LinearSite]
) -> tuple[str, list[LinearSite]] | None:
    """Evaluate the joining subgraph on sample values and match it to a known activation;
    ``up_outputs``: the node holding each up site's output (the matmul, or a half of it)."""
    gen = torch.Generator().manual_seed(0)
    ups = list(up_outputs.values())
    samples = [torch.randn(512, generator=gen, dtype=torch.float64) * 3 for _ in ups]
    env: dict[fx.Node, torch.Tensor] = dict(zip(up_outputs, samples))
    interior_set = set(interior)
    for node in _topological(interior):
        env[node] = _eval_elementwise(node, env, interior_set)
        if env[node] is None:
            return None
    out = env[_last(interior)]
    for name, fn in unary_candidates().items():
        if len(ups) == 1 and _close(out, fn(samples[0])):
            return name, ups
        if len(ups) == 2:
            for gate, up in ((0, 1), (1, 0)):
                if _close(out, fn(samples[gate]) * samples[up]):
                    return gated_from_unary(name), [ups[gate], ups[up]]
    return None


def _eval_elementwise(
    node: fx.Node, env: dict[fx.Node, torch.Tensor], interior: set[fx.Node]
) -> torch.Tensor | None:
    target = _target(node)
    if target in VIEW_OPS or target in IDENTITY_ELEMENTWISE:
        return env[node.args[0]]
    args = [env[a] if isinstance(a, fx.Node) else a for a in node.args]
    if any(isinstance(a, fx.Node) for a in args):
        return None
    try:
        return target(*args, **node.kwargs)
    except Exception:
        return None


def _topological(nodes: list[fx.Node]) -> list[fx.Node]:
    order = node_order(nodes[0].graph)
    return sorted(nodes, key=order.__getitem__)


def _last(nodes: list[fx.Node]) -> fx.Node:
    return _topological(nodes)[-1]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=1e-4, atol=1e-5)
