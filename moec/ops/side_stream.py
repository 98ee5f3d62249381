"""A stretch of a program run on a second CUDA stream, beside what the program runs next.

The ``shared_stream`` pass (:mod:`moec.passes.shared_stream`) brackets a MoE layer's shared
expert with these three calls, so that its GEMMs run while the routed experts' routing,
dispatch, grouped GEMMs and combine run on the program's stream::

    side_stream_enter(x)               # the side stream waits for x; later ops launch on it
    ... the shared expert's nodes ...
    y_s, = side_stream_leave(y)        # later ops launch on the program's stream again
    ... the routed experts' nodes ...
    y_m, = side_stream_join(y_s)       # the program's stream waits for y
    out = aten.add(y_m, routed)

Each returns its tensors unchanged and autograd sees none of them. Leave and join carry the
shared output, so data edges order them; enter, whose result nothing reads, is marked
side-effectful so no dead-code elimination drops it, and the stretch follows it in graph order.
The backward follows by autograd's stream semantics: each op's backward runs on the stream its
forward ran on, and the engine makes a stream wait for the gradients another stream produced,
so the shared expert's backward overlaps the routed experts' as well.

Tensors made on one stream and read on the other are marked used there (``record_stream``), so
the caching allocator does not hand their memory out before that stream is done with it. On CPU
tensors, fake or meta ones (shape propagation) the calls only return their inputs; the stream
switch is the device's, one per CUDA device (:func:`side_stream`).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.fx.node import has_side_effect

_SIDE: dict[int, torch.cuda.Stream] = {}
_ENTERED: list[tuple[torch.cuda.Stream, torch.cuda.Stream]] = []
"""(program stream, side stream) of the enters not left yet, innermost last."""


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of a CUDA ``device`` (made once, at the priority of a default stream)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE:
        _SIDE[index] = torch.cuda.Stream(index)
    return _SIDE[index]


def _cuda_device(tensors: tuple[Tensor, ...]) -> torch.device | None:
    """The CUDA device of the first real CUDA tensor, or None (CPU, fake or meta inputs)."""
    for t in tensors:
        if isinstance(t, Tensor) and t.is_cuda and not is_fake(t):
            return t.device
    return None


@has_side_effect  # returns its inputs, but the stream switch is the point: never dead code
def side_stream_enter(*tensors: Tensor) -> tuple[Tensor, ...]:
    """From here, ops launch on the side stream, after the program's stream has made
    ``tensors`` (the stretch's inputs)."""
    device = _cuda_device(tensors)
    if device is None:
        return tensors
    main, side = torch.cuda.current_stream(device), side_stream(device)
    side.wait_stream(main)
    for t in tensors:
        if isinstance(t, Tensor) and t.is_cuda:
            t.record_stream(side)
    _ENTERED.append((main, side))
    torch.cuda.set_stream(side)
    return tensors


@has_side_effect
def side_stream_leave(*tensors: Tensor) -> tuple[Tensor, ...]:
    """From here, ops launch on the program's stream again; ``tensors`` (the stretch's
    outputs) stay the side stream's until :func:`side_stream_join`."""
    if _cuda_device(tensors) is None:
        return tensors
    if not _ENTERED:
        raise RuntimeError("moec: side_stream_leave without a side_stream_enter before it")
    main, _ = _ENTERED.pop()
    torch.cuda.set_stream(main)
    return tensors


@has_side_effect
def side_stream_join(*tensors: Tensor) -> tuple[Tensor, ...]:
    """The program's stream waits for the side stream's work so far (which made ``tensors``),
    and the tensors are marked used on it."""
    device = _cuda_device(tensors)
    if device is None:
        return tensors
    main = torch.cuda.current_stream(device)
    main.wait_stream(side_stream(device))
    for t in tensors:
        if isinstance(t, Tensor) and t.is_cuda:
            t.record_stream(main)
    return tensors
