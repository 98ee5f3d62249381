"""Per-rank training memory of a compiled program, predicted from its shapes (no data needed).

For one rank of the program (``Program`` after the passes, so expert parameters are this EP
rank's slice and, under pipeline parallelism, the stages are known):

- ``parameters``: every parameter this rank holds, in its dtype;
- ``gradients``: one per trainable parameter, in the dtype the runtime accumulates it in (bf16
  for a parameter read through a bf16 working copy when a step has one microbatch, else the
  parameter's dtype; ``moec.runtime.working_weights.gradient_dtype``);
- ``optimizer``: AdamW's two float32 moments per trainable element (``moec.optim.AdamW``);
- ``working_copies``: the bf16 copies of the working-weights pass;
- ``activations``: bytes saved for backward, from the cost model at the given batch (per
  microbatch) and sequence length: for a pipelined program the peak over this rank's stages of
  ``in_flight x saved + transient`` (the pipeline pass's stage table, scaled from the example
  sizes it was computed at); otherwise the graph's saved bytes (recompute regions count their
  inputs, :mod:`moec.analysis.cost.memory`).

Parameters, gradients, optimizer state and copies are exact for the program (tests compare
them with a training step's tensors); activations are the cost model's prediction (its error
against measurement is in ``benchmarks/RESULTS.md``, recompute section). Allocator overhead,
temporaries inside one op and communication buffers are not counted.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moec.analysis.cost import graph_cost
from moec.program import Program

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class RankMemory:
    """Predicted bytes held by one rank during a training step."""

    parameters: int
    gradients: int
    optimizer: int
    working_copies: int
    activations: int

    @property
    def total(self) -> int:
        return (
            self.parameters
            + self.gradients
            + self.optimizer
            + self.working_copies
            + self.activations
        )

    def rows(self) -> list[tuple[str, int]]:
        """(what, bytes) for a table, total last."""
        fields = [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]
        return [*fields, ("total", self.total)]


def rank_memory(
    program: Program, microbatches: int, batch: int, seq: int, pp_rank: int = 0
) -> RankMemory:
    """The memory of pipeline rank ``pp_rank`` of ``program`` (the program's own rank when it
    is not pipelined) training on ``batch`` sequences of ``seq`` tokens per microbatch."""
    graphs = _held_graphs(program, pp_rank)
    masters = {name for names in program.working_weights.values() for name in names}
    grad_bf16 = microbatches == 1
    params = grads = optimizer = copies = 0
    for gm in graphs:
        for name, param in gm.named_parameters():
            params += _bytes(param)
            if param.requires_grad:
                dtype = torch.bfloat16 if name in masters and grad_bf16 else param.dtype
                grads += param.numel() * dtype.itemsize
                optimizer += 2 * param.numel() * torch.float32.itemsize
        copies += sum(_bytes(gm.get_buffer(b)) for b in program.working_weights if _has(gm, b))
    return RankMemory(params, grads, optimizer, copies, _activations(program, pp_rank, batch, seq))


def _held_graphs(program: Program, pp_rank: int) -> list[nn.Module]:
    if program.pipeline is None:
        return [program.graph]
    return [program.pipeline.stages[s].graph for s in program.pipeline.local_stages(pp_rank)]


def _activations(program: Program, pp_rank: int, batch: int, seq: int) -> int:
    if program.pipeline is None:
        return graph_cost(program).evaluate(batch=batch, seq=seq).saved_bytes
    # the stage table is at the captured example's sizes: scale by the tokens per microbatch
    example = graph_cost(program).evaluate()
    scale = batch * seq / max(example.tokens, 1)
    split = program.pipeline
    return max(
        round(split.info[s].peak_activation_bytes * scale) for s in split.local_stages(pp_rank)
    )


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _has(gm: nn.Module, buffer: str) -> bool:
    try:
        gm.get_buffer(buffer)
    except AttributeError:
        return False
    return True


def format_rank_memory(memory: RankMemory, device_bytes: int | None = None) -> str:
    """A small table (GiB), with the device's memory and whether it fits when given."""
    lines = [f"{what:<15} {size / GIB:>9.3f} GiB" for what, size in memory.rows()]
    if device_bytes is not None:
        verdict = "fits" if memory.total <= device_bytes else "does NOT fit"
        lines.append(f"{'device':<15} {device_bytes / GIB:>9.3f} GiB ({verdict})")
    return "\n".join(lines)
