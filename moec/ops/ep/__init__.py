"""Expert-parallel ops: ``moec::ep_layout``, ``moec::ep_dispatch``, ``moec::ep_combine`` and the
split exchanges of pass ``overlap``. Importing this package registers them all.

Modules: :mod:`~moec.ops.ep.index` (sizes and addresses, pure), :mod:`~moec.ops.ep.exchange`
(process group, buffers, the a2a exchanges, the ``rowwise`` transport's contract),
:mod:`~moec.ops.ep.per_rank` (``rowwise``'s exchanges, a row per (token, rank)),
:mod:`~moec.ops.ep.fused` (the ops above and their backward ops), :mod:`~moec.ops.ep.split`
(each exchange as an issue op and a wait op).

An EP group of ``n`` ranks splits the ``N`` routed experts: rank ``r`` holds experts
``[r*L, (r+1)*L)`` with ``L = N/n``. Every rank routes its own ``T`` local tokens with
``moec::route`` (rows ``[T, K]`` into its local expert-major buffer, ``offsets[N]``); these ops
move the accepted routes to the ranks that own their experts and back::

    slots, recv_rows, local_offsets, counts, sent, dropped = ep_layout(rows, offsets, group, n,
                                                                      cf, path)
    exchange = (slots, recv_rows, sent, counts, group, n, path, poison)
    buffer = ep_dispatch(x, *exchange)                                        # [R, D]
    y, _ = expert_mlp(buffer, w_up[L], w_down[L], local_offsets, ...)          # local experts
    out, saved = ep_combine(y, weights, *exchange)                            # [*, D]

Every exchange op ends with these arguments (:class:`~moec.ops.ep.exchange.Exchange`);
``poison`` (default None) fills the buffer rows no route writes with a value (tests: NaN), bound
by pass ``bind`` from the target (``Target.ep_poison``).

``counts[n, L]``: accepted routes source ``s`` sends to each local expert (exchanged on the
device). ``buffer`` is expert-major: local expert ``l`` owns rows ``[local_offsets[l-1],
local_offsets[l])`` and inside them the routes of source 0, then source 1, ..., each source's in
its route-rank order; rows past ``local_offsets[-1]`` are garbage (never read for a result).
``saved`` is what the backward reads: on the a2a paths ``picked[T*K, D]``, each route's expert
output before weighting, home; on ``rowwise`` the route weights as the experts' side holds them
(``[R]``, in the accumulation dtype), the backward reading ``y`` there too.
``dropped[1]``: accepted routes this source lost in the exchange (``rowwise`` only, else 0).

Capacity and drops (the reference policy, exactly):

1. ``moec::route`` on the source's own T tokens: expert ``e`` accepts the first
   ``C = min(T, ceil(cf * T * K / N))`` routes in token-major order (dropless: ``C = T``;
   :func:`moec.ops.routing.capacity`, the one home of that rule). This is the
   EP = 1 policy on the same local batch, so ``a2a_capacity`` and ``sync_1d`` (which add no
   drops) compute exactly what EP = 1 computes on each rank's batch, capacity binding or not.
2. ``rowwise`` only: a rank receives at most ``Cr = ceil(cf * T * K)`` rows (dropless:
   ``n * T * min(K, L)``, the worst case). A route's row is its position in the expert-major
   order above; routes whose row is ``>= Cr`` are dropped and counted in ``dropped`` of their
   source. With ``cf >= N / K`` neither step drops anything, so EP = n equals EP = 1.

Paths (``path``, :data:`~moec.ops.ep.exchange.PATHS`):

- ``a2a_capacity`` (sync-free, any backend): a send buffer of ``N * C`` rows, slot ``e*C + j``
  for the j-th accepted route of expert e; one equal-split ``all_to_all_single``; the receiver
  compacts ``(source, expert, j)`` slots into the expert-major buffer (``R = N * C``).
- ``sync_1d`` (the synchronized baseline; it SYNCS): per-rank split sizes are copied to the host
  and a variable-split ``all_to_all_single`` sends exactly the accepted rows (dropless beyond
  step 1). The receive buffer is padded to ``R = N * C`` so the graph keeps static shapes.
- ``rowwise`` (sync-free, CUDA + symmetric memory): counts all-gathered on the device; each
  route's destination rank and row computed on the device
  (:func:`~moec.ops.ep.index.rowwise_route_map`); a Triton kernel writes rows straight into the
  peers' symmetric-memory buffers, the layout sends each row's origin along (``recv_rows[r] =
  source * T*K + route``, -1 for no route), and combine brings every expert-output row back to
  its origin. Toward the experts (dispatch, combine's backward) a token's row crosses to a rank
  once, however many of its routes go there (DeepEP's layout, up to K times fewer bytes at
  top-K), and the receiver expands it into the ``R = Cr`` rows of its buffer with one gather.
  Toward home (combine, dispatch's backward) each rank sums a token's rows first (combine's
  weighted: the route weights cross to the experts first, a float each) and sends one partial
  home per rank; the home sums the partials (:mod:`~moec.ops.ep.per_rank`). Combine's backward
  computes the weights' gradient ``<d_out, y>`` on the experts' side and sends it home, a float
  per route. A partial is rounded to the rows' dtype once before it travels. The transport is
  the runtime's (it owns the symmetric-memory workspaces): importing ``moec.runtime`` registers
  it with :func:`register_rowwise_transport`. Without CUDA/symmetric memory, or with no
  transport registered, it raises :class:`EPPathError` naming ``a2a_capacity``.

Backward: dispatch's is the reverse exchange plus an unweighted sum (a combine); combine's is a
weighted dispatch plus ``d_weights = <picked, d_out>`` (rowwise: ``<y, d_out>`` on the experts'
side). All three every rank of the group must call in the same order, like any collective. The
index math is plain functions tested on CPU.

The exchanges of the backwards are internal ops, so AOTAutograd traces each as one opaque call
and no collective ever runs on fake tensors::

    ep_dispatch_backward(d_buffer[R, D], *exchange) -> d_x[T, D]
    ep_combine_backward(d_out[*, D], weights, saved, y | None, *exchange)
        -> (d_y[R, D], d_weights)

Every op's outputs are contiguous, as their fake implementations promise.

Split exchanges: :mod:`moec.ops.ep.split`.
"""

from moec.ops.ep.exchange import (
    PATHS,
    EPPathError,
    Exchange,
    Push,
    RowwiseTransport,
    register_rowwise_transport,
    rowwise_transport,
)
from moec.ops.ep.fused import ep_combine, ep_dispatch, ep_layout
from moec.ops.ep.split import (
    ep_combine_issue,
    ep_combine_wait,
    ep_dispatch_issue,
    ep_dispatch_wait,
    pending_exchanges,
    pending_rows,
)

__all__ = [
    "PATHS",
    "EPPathError",
    "Exchange",
    "Push",
    "RowwiseTransport",
    "ep_combine",
    "ep_combine_issue",
    "ep_combine_wait",
    "ep_dispatch",
    "ep_dispatch_issue",
    "ep_dispatch_wait",
    "ep_layout",
    "pending_exchanges",
    "pending_rows",
    "register_rowwise_transport",
    "rowwise_transport",
]
