"""Pass ``overlap``: each MoE block's dispatch/experts/combine -> two batch halves, interleaved.

Runs when ``plan.parallel.overlap`` is ``two_batch``, after ``expert_parallel`` and ``precision``
(before ``recompute``, which would hide the chain inside a region). Matches, per MoE block
(x: [B, S, D], rows/weights: [B, S, K], T = B*S tokens, N experts)::

    ids, weights, rows, offsets, counts = moec.route(logits, K, cf, ...)   # stays whole
    buffer = moec.dispatch(x, rows)                     # or, at EP = n, ep_layout + ep_dispatch
    y, _ = moec.expert_mlp(buffer, w_up, w_down, offsets, ...)    # any recipe
    out = moec.combine(y, weights, rows)                # or ep_combine

Emits, for halves A = batch rows [0, B/2) and B = [B/2, B), at EP = 1::

    rows_A, offsets_A, rows_B, offsets_B = <relayout of rows/offsets: aten index math below>
    buf_A = dispatch(x[:B/2], rows_A);      y_A = expert_mlp(buf_A, ..., offsets_A, ...)
    buf_B = dispatch(x[B/2:], rows_B)
    out_A = combine(y_A, weights[:B/2], rows_A)
    y_B = expert_mlp(buf_B, ..., offsets_B, ...);  out_B = combine(y_B, weights[B/2:], rows_B)
    out = cat([out_A, out_B], 0)

and at EP = n, each half with its own ``ep_layout`` and every exchange split into an issue and
a wait (:mod:`moec.ops.ep`; order :data:`EP_SCHEDULE`)::

    layout_A = ep_layout(rows_A, ...);  layout_B = ep_layout(rows_B, ...)
    p_A = ep_dispatch_issue(x[:B/2], ...);  p_B = ep_dispatch_issue(x[B/2:], ...)
    y_A = expert_mlp(ep_dispatch_wait(p_A, ...), ...)     # B's dispatch runs under A's experts
    q_A, _ = ep_combine_issue(y_A, ...)
    y_B = expert_mlp(ep_dispatch_wait(p_B, ...), ...)     # A's combine runs under B's experts
    q_B, _ = ep_combine_issue(y_B, ...)
    out = cat([ep_combine_wait(q_A, weights[:B/2], ...)[0], ep_combine_wait(q_B, ...)[0]], 0)

Routing semantics are exactly those without overlap: ``moec.route`` runs once on the whole
microbatch (capacity is per microbatch, so routing each half would change C and the drops), and
only the movement and the expert GEMMs are split by rows. The halves' layouts are derived from
the whole one: routes are ranked token-major, so the accepted routes of expert e from half A
are e's first ``a_e`` accepted ranks and half B's the rest; with ``start_e`` the first row of e
in the whole buffer and ``start^h_e`` in half h's, a route's row in its half's buffer is
``row - start_e - (a_e if h is B else 0) + start^h_e`` (dropped routes stay -1). This is plain
static-shaped aten math (slice, scatter_add, cumsum, index, where): no host sync. At EP = n each
half's ``ep_layout`` gets capacity factor ``2 * cf`` (``cf`` when dropless), so its per-expert
capacity ``min(T/2, ceil(cf*T*K/N))`` holds any half's share of the whole's accepted routes and
adds no drops; the a2a_capacity buffers are then ``N * min(T/2, C)`` rows per half.

Legality (a declined block keeps its chain, and the reason is in the statistics):

- the batch dimension (dim 0 of the dispatched x and of rows) is a static even integer >= 2.
  The split is on the batch, never on the sequence: the chain itself is per token, but the
  halves are meant to be batch halves so that attention (which mixes within a sequence) of one
  half can later run under the other half's exchange;
- ``ep_path`` ``rowwise`` only when its rank capacity cannot bind (dropless, or cf >= N/K): its
  drops depend on the order of every source's rows in the whole receive buffer, which halves
  change.

The schedule is the static program order, the order the runtime issues the ops; the exchanges
run on their own stream from their issue to their wait (NCCL's for ``a2a_capacity``, the
transport's for ``rowwise``), and autograd runs the backward in the mirrored order (each wait's
backward issues the reverse exchange, each issue's backward waits for it). Invariants: those of
:mod:`moec.passes.rewrite`; user and aux outputs unchanged (a block's ``ep_dropped`` becomes
the sum over its halves); no parameter added or removed (both halves read the same expert
parameters); ``route``, ``router_losses`` and the aux ``expert_counts``/``expert_offsets``
untouched. Options: ``plan.parallel.overlap``.
Statistics: ``applied``, ``declined`` (why no block was split, or None), ``blocks`` (block ->
``"two_batch"`` or the reason it was left alone), ``path``, ``halves`` (batch rows per half),
``schedule`` (the issue order of one block: :data:`SCHEDULE` or :data:`EP_SCHEDULE`),
``overlap`` (what the schedule hides, :func:`schedule_overlap`: each exchange -> the compute
issued between its issue and its wait, empty where it runs exposed; None at EP = 1),
``buffer_rows`` (block -> rows of the expert buffer, whole and per half).
"""

from __future__ import annotations

import dataclasses
import operator
import warnings
from typing import Any

import torch
import torch.fx as fx

import moec.ops.ep  # noqa: F401  (registers the moec::ep_* ops)
from moec.fx import node_order
from moec.kernels.target import Target
from moec.passes.base import Pass, PassContext, PassResult, register_pass
from moec.passes.rewrite import GraphEditor
from moec.plan import Plan

aten = torch.ops.aten
moec_ops = torch.ops.moec

EXPERT_OPS = (moec_ops.expert_mlp.default,)
"""Expert ops of a chain: argument 0 is the buffer, argument 3 the offsets."""

SCHEDULE = (
    "A.dispatch",
    "A.experts",
    "B.dispatch",
    "A.combine",
    "B.experts",
    "B.combine",
)
"""Issue order of one block at EP = 1 (local dispatch/combine: nothing to overlap with)."""

EP_SCHEDULE = (
    "A.layout",
    "B.layout",
    "A.dispatch.issue",
    "B.dispatch.issue",
    "A.dispatch.wait",
    "A.experts",
    "A.combine.issue",
    "B.dispatch.wait",
    "B.experts",
    "B.combine.issue",
    "A.combine.wait",
    "B.combine.wait",
)
"""Issue order of one block at EP = n: every exchange split into its issue and its wait
(:mod:`moec.ops.ep`), each wait right before the op that reads the exchanged rows. A stream
runs its work in issue order, so an exchange overlaps what the compute stream was given before
its wait and after its issue: B's dispatch runs under A's experts, A's combine under B's experts
(and under B's combine issue), the send-side work of B.dispatch and A.combine is queued ahead of
the expert GEMMs it must not wait behind. Exposed: A's dispatch and B's combine. Autograd
mirrors it: B's combine backward and A's dispatch backward exposed, the other two under the
expert GEMMs' backward (each wait's backward issues, each issue's backward waits)."""


def schedule_overlap(schedule: tuple[str, ...]) -> dict[str, list[str]]:
    """Each split exchange of ``schedule`` (``"<half>.<dispatch|combine>"``) -> the compute
    steps issued between its issue and its wait: what it can run under on its own stream
    (nothing: exposed). The backward mirrors it (:data:`EP_SCHEDULE`)."""
    position = {step: i for i, step in enumerate(schedule)}
    return {
        step.removesuffix(".issue"): [
            s
            for s in schedule[i + 1 : position[step.replace(".issue", ".wait")]]
            if s.endswith(".experts")
        ]
        for i, step in enumerate(schedule)
        if step.endswith(".issue")
    }


@dataclasses.dataclass
class _Chain:
    """One block's movement/expert chain as the earlier passes left it."""

    prefix: str
    route: fx.Node
    x: fx.Node
    rows: fx.Node
    weights: fx.Node
    offsets: fx.Node
    dispatch: fx.Node
    mlp: fx.Node
    combine: fx.Node
    out: fx.Node
    """The node holding the combined [B, S, D] result (``combine``, or its getitem 0 at EP)."""
    layout: fx.Node | None = None
    """``ep_layout`` at EP = n."""

    @property
    def ep(self) -> bool:
        return self.layout is not None


@register_pass
class OverlapPass(Pass):
    name = "overlap"
    requires = ("moe",)
    after = ("expert_parallel", "precision")

    @staticmethod
    def applies(plan: Plan) -> bool:
        """parallel.overlap is two_batch"""
        return plan.parallel.overlap == "two_batch"

    @staticmethod
    def options(plan: Plan) -> str:
        return f"overlap={plan.parallel.overlap}"

    @staticmethod
    def declines(plan: Plan) -> str | None:
        """the EP path cannot be halved (``ep_path: auto`` at EP > 1 counts as every path it
        resolves to, :meth:`Target.ep_paths`), or ``parallel.microbatch_size`` is not an even
        batch"""
        p = plan.parallel
        paths = Target.ep_paths(p.ep_path) if p.ep > 1 else ()
        reasons = [_path_reason(path, plan) for path in paths]
        if p.microbatch_size is not None:
            reasons.append(_halves_reason(p.microbatch_size, "parallel.microbatch_size"))
        return next((r for r in reasons if r is not None), None)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        chains = [_match(node) for node in gm.graph.nodes if node.target in EXPERT_OPS]
        chains = [c for c in chains if c is not None]
        stats: dict[str, Any] = {
            "applied": False,
            "declined": None,
            "blocks": {},
            "path": "local",
            "halves": None,
            "schedule": None,
            "overlap": None,
            "buffer_rows": {},
        }
        if not chains:
            return self._decline(
                gm, stats, "no moec.dispatch -> experts -> combine chain: run pass moe first"
            )
        layouts = [c.layout for c in chains if c.layout is not None]
        if layouts:
            stats["path"] = path = str(layouts[0].args[5])
            reason = _path_reason(path, ctx.plan)
            if reason is not None:
                stats["blocks"] = {c.prefix: reason for c in chains}
                return self._decline(gm, stats, reason)
        editor = GraphEditor(gm, self.name)
        for chain in chains:
            reason = _batch_reason(chain)
            if reason is not None:
                stats["blocks"][chain.prefix] = reason
                continue
            batch = example_size(chain.x.meta["val"].shape[0])
            stats["halves"] = [batch // 2, batch // 2]
            stats["buffer_rows"][chain.prefix] = _split(editor, chain)
            stats["blocks"][chain.prefix] = "two_batch"
            stats["schedule"] = list(EP_SCHEDULE if chain.ep else SCHEDULE)
            stats["overlap"] = schedule_overlap(EP_SCHEDULE) if chain.ep else None
        split = [p for p, v in stats["blocks"].items() if v == "two_batch"]
        if not split:
            return self._decline(gm, stats, "; ".join(sorted(set(stats["blocks"].values()))))
        gm.graph.eliminate_dead_code()
        gm.recompile()
        stats["applied"] = True
        return PassResult(gm, True, stats)

    def _decline(self, gm: fx.GraphModule, stats: dict[str, Any], reason: str) -> PassResult:
        stats["declined"] = reason
        warnings.warn(f"moec: pass overlap left the program unchanged: {reason}", stacklevel=2)
        return PassResult(gm, False, stats)


# --- matching and legality -------------------------------------------------------------------


def _is(node: Any, op: str) -> bool:
    return isinstance(node, fx.Node) and node.target is getattr(moec_ops, op).default


def _item(node: fx.Node, index: int) -> fx.Node | None:
    """The ``getitem(node, index)`` user of ``node``, if any."""
    for user in node.users:
        if user.target is operator.getitem and user.args[1] == index:
            return user
    return None


def _match(mlp: fx.Node) -> _Chain | None:
    """The chain around expert op ``mlp``, or None when it is not one pass moe emitted."""
    dispatch, offsets = mlp.args[0], mlp.args[3]
    y = _item(mlp, 0)
    if y is None or not isinstance(dispatch, fx.Node):
        return None
    combines = [u for u in y.users if _is(u, "combine") or _is(u, "ep_combine")]
    if len(combines) != 1:
        return None
    combine = combines[0]
    layout = None
    if _is(dispatch, "dispatch"):
        x, rows = dispatch.args
        out = combine
    elif _is(dispatch, "ep_dispatch"):
        x = dispatch.args[0]
        slots = dispatch.args[1]
        layout = slots.args[0] if slots.target is operator.getitem else None
        if not _is(layout, "ep_layout"):
            return None
        rows, offsets = layout.args[0], layout.args[1]
        out = _item(combine, 0)
        if out is None:
            return None
    else:
        return None
    route = rows.args[0] if rows.target is operator.getitem else None
    if not _is(route, "route"):
        return None
    param = mlp.args[1]
    prefix = str(param.target).rpartition(".")[0] if param.op == "get_attr" else mlp.name
    return _Chain(
        prefix, route, x, rows, combine.args[1], offsets, dispatch, mlp, combine, out, layout
    )


def _path_reason(path: str, plan: Plan) -> str | None:
    """Why EP path ``path`` cannot be split into halves with the same routing, or None."""
    moe = plan.moe
    cf = moe.capacity_factor
    if path == "rowwise" and cf is not None and cf > 0 and cf < moe.num_experts / moe.top_k:
        return (
            f"parallel.ep_path=rowwise with moe.capacity_factor={cf} < num_experts/top_k = "
            f"{moe.num_experts / moe.top_k:g}: its rank capacity drops routes by their place in "
            "the whole batch's receive buffer, which two halves change; use capacity_factor "
            f"None (dropless) or >= {moe.num_experts / moe.top_k:g}, or ep_path a2a_capacity"
        )
    return None


def _batch_reason(chain: _Chain) -> str | None:
    """Why the chain's batch cannot be halved, or None."""
    x, rows = chain.x.meta["val"], chain.rows.meta["val"]
    batch = example_size(x.shape[0])
    if rows.dim() < 2 or rows.shape[0] != x.shape[0]:
        return (
            f"the rows of {chain.rows.name} {tuple(rows.shape)} do not share the batch dimension "
            f"of {chain.x.name} {tuple(x.shape)}"
        )
    return _halves_reason(batch, f"the batch dimension of {chain.x.name} {tuple(x.shape)}")


def _halves_reason(batch: int, what: str) -> str | None:
    """Why a batch of ``batch`` sequences (``what`` names it) has no two equal halves, or None."""
    if batch < 2 or batch % 2:
        return (
            f"{what} is {batch}: two batch halves need an even batch >= 2 (the split is on the "
            "batch, never on the sequence)"
        )
    return None


# --- rewrite ------------------------------------------------------------------------------------


def example_size(size: int | torch.SymInt) -> int:
    """``size`` at the example inputs the program was captured with (its hint when symbolic)."""
    return size if isinstance(size, int) else int(size.node.hint)


def _halve(editor: GraphEditor, chain: _Chain, like: fx.Node) -> tuple[Any, Any]:
    """The split point B/2 and the end B of the batch: ints for a static batch; for a symbolic
    one, nodes reading the size, with a check (on the host: a shape, no device sync) that
    refuses an odd batch at run time, whose halves would not be equal."""
    batch = chain.x.meta["val"].shape[0]
    if isinstance(batch, int):
        return batch // 2, batch
    size = editor.call(aten.sym_size.int, (chain.x, 0), like=like)
    even = editor.call(operator.eq, (editor.call(operator.mod, (size, 2), like=like), 0), like=like)
    editor.call(
        aten._assert_scalar.default,
        (
            even,
            f"moec pass overlap (two_batch) halves the batch of {chain.prefix}: it must be "
            "even; compile with parallel.overlap none for odd batches",
        ),
        like=like,
    )
    return editor.call(operator.floordiv, (size, 2), like=like), size


def _split(editor: GraphEditor, chain: _Chain) -> dict[str, int]:
    """Replace ``chain`` by two interleaved half chains; return its buffer rows, whole and half."""
    anchor = chain.layout if chain.ep else chain.dispatch
    order = node_order(editor.graph)
    ids = _item(chain.route, 0)
    if ids is None:
        with editor.graph.inserting_after(chain.route):
            ids = editor.getitem(chain.route, 0)
    static = [a for a in (*chain.mlp.args[1:3], *chain.mlp.args[4:]) if isinstance(a, fx.Node)]
    inputs = [chain.x, chain.rows, chain.weights, chain.offsets, ids, *static]
    if any(order.get(n, len(order)) >= order[anchor] for n in inputs):
        anchor = chain.combine  # an input made late (e.g. a cast): issue the chain there
    like = chain.dispatch
    whole_rows = example_size(chain.mlp.args[0].meta["val"].shape[0])
    with editor.graph.inserting_before(anchor):
        halves = _relayout(editor, chain, ids, *_halve(editor, chain, like), like)
        if chain.ep:
            steps = [_split_exchanges(editor, chain, h) for h in halves]
            mlps = [step["experts"][0] for step in steps]
            outs = [step["out"] for step in steps]
        else:
            starts = [editor.call(*h.start(chain), like=like) for h in halves]
            mlps = [_issue(editor, chain, h, s) for h, s in zip(halves, starts, strict=True)]
            outs = [_finish(editor, chain, h, m) for h, m in zip(halves, mlps, strict=True)]
        # the nodes above were made half by half; the schedule is fixed by moving them
        combined = editor.call(aten.cat.default, (outs, 0), like=chain.out)
    if chain.ep:
        _reorder_ep(combined, steps)
    else:
        _reorder(editor.graph, halves, starts, mlps, outs)
    chain.out.replace_all_uses_with(combined)
    if chain.ep:
        _sum_dropped(editor, chain, [h.layout for h in halves])
    _erase_chain(editor.graph, chain)
    half_rows = example_size(mlps[0].args[0].meta["val"].shape[0])
    return {"whole": whole_rows, "half": half_rows}


@dataclasses.dataclass
class _Half:
    """One half's inputs: its slice of x and weights, its rows and offsets in its own buffer."""

    x: fx.Node
    weights: fx.Node
    rows: fx.Node
    offsets: fx.Node
    cf: float = 0.0
    layout: fx.Node | None = None
    items: tuple[fx.Node, ...] = ()

    def start(self, chain: _Chain) -> tuple[Any, tuple]:
        """The local dispatch of this half (EP = 1)."""
        return moec_ops.dispatch.default, (self.x, self.rows)


def _relayout(
    editor: GraphEditor, chain: _Chain, ids: fx.Node, half: Any, batch: Any, like: fx.Node
) -> list[_Half]:
    """The two halves' slices and their rows/offsets in half-sized buffers (module docstring)."""

    def call(target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        return editor.call(target, args, like=like, kwargs=kwargs)

    num_experts = chain.offsets.meta["val"].shape[0]
    i64 = torch.int64
    offsets = call(aten._to_copy.default, chain.offsets, dtype=i64)
    start = call(
        aten.constant_pad_nd.default,
        call(aten.slice.Tensor, offsets, 0, 0, num_experts - 1),
        [1, 0],
        0.0,
    )
    accepted = call(aten.sub.Tensor, offsets, start)
    parts = [(0, half), (half, batch)]
    rows = [call(aten.slice.Tensor, chain.rows, 0, lo, hi) for lo, hi in parts]
    expert = [call(aten.slice.Tensor, ids, 0, lo, hi) for lo, hi in parts]
    valid = [call(aten.ge.Scalar, r, 0) for r in rows]
    count_a = call(
        aten.scatter_add.default,
        call(aten.zeros_like.default, offsets),
        0,
        call(aten.view.default, expert[0], [-1]),
        call(aten.view.default, call(aten._to_copy.default, valid[0], dtype=i64), [-1]),
    )
    counts = [count_a, call(aten.sub.Tensor, accepted, count_a)]
    before = [start, call(aten.add.Tensor, start, count_a)]  # whole-buffer row of rank 0 in h
    cf = float(chain.layout.args[4]) if chain.ep else 0.0
    halves = []
    for h, (lo, hi) in enumerate(parts):
        ends = call(aten.cumsum.default, counts[h], 0)
        shift = call(aten.sub.Tensor, before[h], call(aten.sub.Tensor, ends, counts[h]))
        moved = call(aten.sub.Tensor, rows[h], call(aten.index.Tensor, shift, [expert[h]]))
        halves.append(
            _Half(
                x=call(aten.slice.Tensor, chain.x, 0, lo, hi),
                weights=call(aten.slice.Tensor, chain.weights, 0, lo, hi),
                rows=call(aten.where.ScalarOther, valid[h], moved, -1),
                offsets=call(aten._to_copy.default, ends, dtype=torch.int32),
                cf=2 * cf if cf > 0 else cf,
            )
        )
    if chain.ep:
        group, size, _, path = chain.layout.args[2:6]
        for h in halves:
            h.layout = editor.call(
                moec_ops.ep_layout.default,
                (h.rows, h.offsets, group, size, h.cf, path),
                like=chain.layout,
            )
            h.items = tuple(editor.getitem(h.layout, i) for i in range(6))
    return halves


def _issue(editor: GraphEditor, chain: _Chain, half: _Half, buffer: fx.Node) -> fx.Node:
    """This half's expert op on ``buffer`` with its offsets (the other arguments unchanged)."""
    offsets = half.items[2] if chain.ep else half.offsets
    args = (buffer, *chain.mlp.args[1:3], offsets, *chain.mlp.args[4:])
    return editor.call(chain.mlp.target, args, like=chain.mlp)


def _finish(editor: GraphEditor, chain: _Chain, half: _Half, mlp: fx.Node) -> fx.Node:
    """This half's local combine of its expert output (EP = 1): its [B/2, S, D] result."""
    y = editor.getitem(mlp, 0)
    return editor.call(moec_ops.combine.default, (y, half.weights, half.rows), like=chain.combine)


def _split_exchanges(editor: GraphEditor, chain: _Chain, half: _Half) -> dict[str, Any]:
    """This half's chain at EP = n with each exchange split into issue and wait; returns its
    nodes by :data:`EP_SCHEDULE` step (without the half letter) and its [B/2, S, D] result
    under ``out``."""
    slots, recv, _, counts, sent, _ = half.items
    comm = (slots, recv, sent, counts, *chain.dispatch.args[5:8])
    d_issue = editor.call(
        moec_ops.ep_dispatch_issue.default, (half.x, None, *comm), like=chain.dispatch
    )
    d_wait = editor.call(moec_ops.ep_dispatch_wait.default, (d_issue, *comm), like=chain.dispatch)
    mlp = _issue(editor, chain, half, d_wait)
    y = editor.getitem(mlp, 0)
    c_issue = editor.call(
        moec_ops.ep_combine_issue.default, (y, half.weights, *comm), like=chain.combine
    )
    c_pending = editor.getitem(c_issue, 0)
    c_wait = editor.call(
        moec_ops.ep_combine_wait.default, (c_pending, half.weights, *comm), like=chain.combine
    )
    out = editor.getitem(c_wait, 0)
    return {
        "layout": [half.layout, *half.items],
        "dispatch.issue": [d_issue],
        "dispatch.wait": [d_wait],
        "experts": [mlp, y],
        "combine.issue": [c_issue, c_pending],
        "combine.wait": [c_wait, out],
        "out": out,
    }


def _reorder(
    graph: fx.Graph,
    halves: list[_Half],
    starts: list[fx.Node],
    mlps: list[fx.Node],
    outs: list[fx.Node],
) -> None:
    """Put the issue order to :data:`SCHEDULE`: A.dispatch, A.experts, B.dispatch, A.combine,
    B.experts, B.combine. Every step's inputs come from earlier steps or from before the chain,
    so the order stays topological."""
    a, b = 0, 1
    finish = [[o.args[0], o] for o in outs]  # getitem(mlp, 0), combine
    steps = [[starts[a]], [mlps[a]], [starts[b]], finish[a], [mlps[b]], finish[b]]
    cat = next(iter(outs[b].users))
    for step in steps:
        for node in step:
            cat.prepend(node)


def _reorder_ep(cat: fx.Node, steps: list[dict[str, Any]]) -> None:
    """Put the issue order to :data:`EP_SCHEDULE` (topological: each step reads earlier steps
    or what precedes the chain)."""
    for name in EP_SCHEDULE:
        half, _, step = name.partition(".")
        for node in steps["AB".index(half)][step]:
            cat.prepend(node)


def _sum_dropped(editor: GraphEditor, chain: _Chain, layouts: list[fx.Node | None]) -> None:
    """The block's ``ep_dropped`` output: the sum of its halves' drops."""
    old = _item(chain.layout, 5)
    if old is None:
        return
    drops = [_item(layout, 5) for layout in layouts if layout is not None]
    with editor.graph.inserting_after(next(iter(drops[-1].users), drops[-1])):
        total = editor.call(aten.add.Tensor, tuple(drops), like=old)
    old.replace_all_uses_with(total)


def _erase_chain(graph: fx.Graph, chain: _Chain) -> None:
    """Erase the old chain, users first."""
    nodes = [chain.combine, chain.mlp, chain.dispatch]
    if chain.layout is not None:
        nodes.append(chain.layout)
    for node in nodes:
        for user in list(node.users):
            if not user.users:
                graph.erase_node(user)
        graph.erase_node(node)
