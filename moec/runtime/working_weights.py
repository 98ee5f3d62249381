"""``WorkingWeights``: the bf16 copies a compiled program reads in place of its parameters.

The ``working_weights`` pass leaves, per float32 parameter the graph read only through a bf16
cast, a buffer holding that cast (several parameters may share one buffer, row-concatenated).
This object keeps every copy equal to its parameter:

- ``refresh()`` (called by ``CompiledModel.forward`` before each run, and by the pipeline
  runtime before each step over its local stages) rewrites the copy of
  every parameter changed since its copy was last written. A parameter's ``_version`` moves
  with every in-place write torch makes (an optimizer step, ``load_state_dict``, a manual
  edit), so any optimizer works; after torch's AdamW it costs what the cast cost.
- ``moec.optim.AdamW`` writes the copy in its update pass (``copy_of``) and then calls
  ``mark_fresh``: no separate pass over the weights at all.
- torch's fused optimizers (``fused=True``) write parameters without moving ``_version``: a
  step hook every torch optimizer runs (registered with the first ``WorkingWeights``) marks
  the copies of the parameters it stepped stale, whatever its implementation.
- Other writes torch does not count (through ``param.data``, or a raw kernel) are not seen:
  call ``invalidate()`` after them and every copy is rewritten on the next forward.

Gradients: they arrive in bf16 (the dtype the GEMMs made them in). By default the engine casts
them to the parameters' float32, as every optimizer expects (torch's AdamW, Adam and SGD, in
each implementation, require a float32 parameter's gradient to be float32). An optimizer that
reads a bf16 gradient as it is (``moec.optim.AdamW``, which the trainer and the pipeline
runtime use) calls :meth:`WorkingWeights.keep_gradients` for its parameters: their gradients
then stay bf16 when a step has one microbatch (no cast pass, half the memory); with several,
the engine accumulates them in float32 (a bf16 running sum would lose low bits microbatch by
microbatch).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook

_LIVE: weakref.WeakSet[WorkingWeights] = weakref.WeakSet()
"""Every ``WorkingWeights`` alive, for the optimizer step hook."""
_HOOK: list[Any] = []  # the hook's handle, once registered


def _after_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Mark stale the copies of the parameters ``optimizer`` stepped: a fused torch optimizer
    writes them without moving their ``_version``. moec's AdamW writes the copies itself."""
    if getattr(optimizer, "writes_working_weights", False) or not _LIVE:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for working in list(_LIVE):
        working.forget(params)


def gradient_dtype(microbatches: int) -> torch.dtype:
    """The gradient dtype of a working weight whose optimizer keeps the program's gradients
    (:meth:`WorkingWeights.keep_gradients`): bf16 when a step has one microbatch, float32
    accumulation with several."""
    return torch.bfloat16 if microbatches == 1 else torch.float32


class WorkingWeights:
    def __init__(self, module: nn.Module, copies: dict[str, list[str]], grad_dtype: torch.dtype):
        """``copies``: buffer name -> the parameter names whose rows it holds, in order (the
        program's ``working_weights``), both relative to ``module``; ``grad_dtype``: the
        gradient dtype :meth:`keep_gradients` gives (:func:`gradient_dtype`)."""
        self.module = module
        self.grad_dtype = grad_dtype
        self._slots: dict[nn.Parameter, tuple[str, int, int]] = {}  # buffer, first, last row
        self._versions: dict[nn.Parameter, int] = {}  # parameter version the copy was made at
        for buffer, names in copies.items():
            start = 0
            for name in names:
                param = module.get_parameter(name)
                self._slots[param] = (buffer, start, start + param.shape[0])
                start += param.shape[0]
        _LIVE.add(self)
        if not _HOOK:
            _HOOK.append(register_optimizer_step_post_hook(_after_optimizer_step))

    def __len__(self) -> int:
        return len(self._slots)

    def copy_of(self, param: Tensor) -> Tensor | None:
        """The working copy of ``param`` (a view of its buffer), or None if it has none."""
        slot = self._slots.get(param)
        if slot is None:
            return None
        buffer, start, stop = slot
        return self.module.get_buffer(buffer)[start:stop]

    def keep_gradients(self, params: Iterable[Tensor]) -> None:
        """Hand the working weights among ``params`` their gradients in :attr:`grad_dtype`, as
        the program makes them, instead of cast to float32: for an optimizer that reads any
        gradient dtype. Call it before the first backward (a gradient already accumulated keeps
        its dtype)."""
        for param in params:
            if param in self._slots:
                param.grad_dtype = self.grad_dtype

    def mark_fresh(self, param: nn.Parameter) -> None:
        """``param``'s copy was just written from it."""
        self._versions[param] = param._version

    def forget(self, params: Iterable[Tensor]) -> None:
        """Treat the copies of ``params`` (those that have one) as stale."""
        for param in params:
            self._versions.pop(param, None)

    def invalidate(self) -> None:
        """Treat every copy as stale (after writes to the parameters torch does not count)."""
        self._versions.clear()

    @torch.no_grad()
    def refresh(self) -> int:
        """Rewrite the copies of parameters changed since their copy was made; how many."""
        stale = [p for p in self._slots if self._versions.get(p) != p._version]
        for param in stale:
            self.copy_of(param).copy_(param)
            self.mark_fresh(param)
        return len(stale)
