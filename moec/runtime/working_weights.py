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
- Writes torch does not count (through ``param.data``, or a raw kernel) are not seen: call
  ``invalidate()`` after them and every copy is rewritten on the next forward.

It also sets each parameter's ``grad_dtype``: gradients arrive in bf16 (the dtype the GEMMs
made them in) and stay bf16 when a step has one microbatch; with several, the engine
accumulates them in float32 (a bf16 running sum would lose low bits microbatch by microbatch).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def gradient_dtype(microbatches: int) -> torch.dtype:
    """bf16 gradients when a step has one microbatch, float32 accumulation with several."""
    return torch.bfloat16 if microbatches == 1 else torch.float32


class WorkingWeights:
    def __init__(self, module: nn.Module, copies: dict[str, list[str]], grad_dtype: torch.dtype):
        """``copies``: buffer name -> the parameter names whose rows it holds, in order (the
        program's ``working_weights``), both relative to ``module``."""
        self.module = module
        self._slots: dict[nn.Parameter, tuple[str, int, int]] = {}  # buffer, first, last row
        self._versions: dict[nn.Parameter, int] = {}  # parameter version the copy was made at
        for buffer, names in copies.items():
            start = 0
            for name in names:
                param = module.get_parameter(name)
                self._slots[param] = (buffer, start, start + param.shape[0])
                start += param.shape[0]
                param.grad_dtype = grad_dtype

    def __len__(self) -> int:
        return len(self._slots)

    def copy_of(self, param: Tensor) -> Tensor | None:
        """The working copy of ``param`` (a view of its buffer), or None if it has none."""
        slot = self._slots.get(param)
        if slot is None:
            return None
        buffer, start, stop = slot
        return self.module.get_buffer(buffer)[start:stop]

    def mark_fresh(self, param: nn.Parameter) -> None:
        """``param``'s copy was just written from it."""
        self._versions[param] = param._version

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
