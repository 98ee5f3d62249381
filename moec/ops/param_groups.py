"""Where a block's parameters are needed: the points at which FSDP gathers and frees them.

The ``fsdp`` pass turns each residual block's container module (a plain ``nn.Module`` holding the
block's parameters under their names) into a :class:`ParamGroup` and calls it on the block's
incoming activations before the block's first parameter read; a :class:`ReleaseParams` child
is called on the block's output after its last read. Without FSDP both are identities. When the
runtime has made the group an FSDP2 unit (``fully_shard``, ``reshard_after_forward=False``):

- calling the group runs FSDP's pre-forward: all-gather the block's shards (the graph reads the
  parameters after this call), and a post-backward hook on its inputs, whose gradient is
  complete only when the block's backward is done: the reduce-scatter then runs;
- the release frees the gathered parameters in forward and gathers them again when backward
  reaches the block's output, before any of the block's backward runs (autograd keeps the same
  tensor objects; FSDP2 refills their storage).

So a block's unsharded parameters live only while the block runs forward and backward (the
report's full-reshard FSDP).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class ParamGroup(nn.Module):
    """A block's parameter container, called where the block starts: returns its inputs."""

    def forward(self, *activations: torch.Tensor) -> Any:
        return activations[0] if len(activations) == 1 else activations


class ReleaseParams(nn.Module):
    """Called on the block's output: frees its group's gathered parameters (see the module)."""

    def __init__(self, group: nn.Module):
        super().__init__()
        object.__setattr__(self, "group", group)  # not a child: the group owns this module

    def forward(self, output: torch.Tensor) -> torch.Tensor:
        if not callable(getattr(self.group, "reshard", None)):  # not an FSDP unit
            return output
        return _Release.apply(output, self.group)


class _Release(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        group.reshard()
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.group.unshard()
        return grad, None
