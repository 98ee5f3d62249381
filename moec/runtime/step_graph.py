"""A whole training step captured as one CUDA graph and replayed (``plan.experimental.cuda_graph``).

moec's steady-state step never reads the device, so its forward, backward, gradient clipping
and optimizer update can be recorded once and replayed as a single launch: the host no longer
issues a few thousand kernels per step, which is what bounds small-shape steps.

:class:`StepGraph` wraps a step function ``step(*inputs) -> Tensor`` whose device work depends
only on (a) its input tensors, (b) device state it updates in place (parameters, optimizer
moments and counters, working weights, run counters) and (c) values written into device memory
before each replay (the learning rate: :meth:`moec.optim.AdamW.write_lr`, the ``before_replay``
hook). Python values the step reads are frozen at capture; a changed one must live in device
memory instead, or the step must not be graphed.

Per input shape: the first ``warmup`` calls run eagerly (Triton autotuning, lazy CUDA and
library initialisation and the allocator's first allocations happen there; they are ordinary
training steps), the next one is captured into a private memory pool and replayed, and every
later call copies its inputs into the captured ones, runs ``before_replay`` and replays. The
returned tensor is a copy of the captured output (the next replay overwrites the original). A
call at another shape (batch-size warmup) drops the graph and starts over at that shape.

:func:`graph_blocker` says why a plan's step cannot be captured (no CUDA device, a
multi-process job, ...); the trainer then runs eagerly and prints the reason.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from moec.errors import MoecError


class StepGraphError(MoecError, RuntimeError):
    """The step could not be captured as a CUDA graph."""


WARMUP_CALLS = 2
"""Eager calls at a shape before it is captured."""


def graph_blocker(device: torch.device, distributed: bool) -> str | None:
    """Why a step on ``device`` (in a multi-process job when ``distributed``) is not captured,
    or None when it can be."""
    if device.type != "cuda":
        return f"the step runs on {device.type}, and CUDA graphs need a CUDA device"
    if distributed:
        return (
            "the step is part of a multi-process job: its collectives (gradient reduction, "
            "expert-parallel exchanges) are not captured yet, so each step is launched eagerly"
        )
    return None


class StepGraph:
    """``step`` eagerly for the first calls at a shape, then as a captured CUDA graph (see
    the module docstring)."""

    def __init__(
        self,
        step: Callable[..., Tensor],
        before_replay: Callable[[], None],
        warmup: int = WARMUP_CALLS,
    ):
        self.step, self.before_replay, self.warmup = step, before_replay, warmup
        self._key: tuple | None = None
        self._eager_calls = 0
        self._graph: torch.cuda.CUDAGraph | None = None
        self._inputs: tuple[Tensor, ...] = ()
        self._output: Tensor | None = None
        self.captures = 0
        """Graphs captured so far (one per shape the step ran at past its warmup)."""

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def __call__(self, *inputs: Tensor) -> Tensor:
        key = tuple((tuple(t.shape), t.dtype, t.device) for t in inputs)
        if key != self._key:
            self.release()
            self._key = key
        if self._graph is None:
            if self._eager_calls < self.warmup:
                self._eager_calls += 1
                return self.step(*inputs)
            self._capture(inputs)
        for held, new in zip(self._inputs, inputs, strict=True):
            held.copy_(new)
        self.before_replay()
        self._graph.replay()
        return self._output.clone()

    def release(self) -> None:
        """Drop the graph and its memory pool; the next call starts the warmup again."""
        self._graph, self._inputs, self._output = None, (), None
        self._key, self._eager_calls = None, 0

    def _capture(self, inputs: tuple[Tensor, ...]) -> None:
        self._inputs = tuple(t.clone() for t in inputs)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread-local: the data loader's thread may copy the next batches meanwhile
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                output = self.step(*self._inputs)
        except RuntimeError as exc:
            self.release()
            cause = _first_error(exc)
            raise StepGraphError(
                "experimental.cuda_graph: capturing the training step failed "
                f"({type(cause).__name__}: {str(cause).splitlines()[0]}). A step that reads the "
                "device (a host sync: .item(), a data-dependent shape) or "
                "calls a CUDA API that graphs do not allow cannot be captured, nor can one whose "
                "parameters carry gradient hooks registered before it (they keep the gradient "
                "accumulators of the eager stream alive); run one step "
                'under torch.cuda.set_sync_debug_mode("error") to find the op, or set '
                "experimental.cuda_graph: false"
            ) from exc
        if not isinstance(output, Tensor):
            self.release()
            raise StepGraphError(
                f"experimental.cuda_graph: the step returned {type(output).__name__}, not a tensor"
            )
        self._graph, self._output = graph, output
        self.captures += 1


def _first_error(exc: BaseException) -> BaseException:
    """The error that broke the capture: ending an invalidated capture raises again, with the
    first one as its context."""
    while exc.__context__ is not None and exc.__cause__ is None:
        exc = exc.__context__
    return exc
