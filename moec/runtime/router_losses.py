"""The routers' share of the training objective and their balance over a step, in one place
for every runtime (:class:`~moec.runtime.compiled.CompiledModel`; the pipeline's stages take
:func:`router_loss_objective` alone: ``global_batch`` and ``aux_free`` are refused at
``parallel.pp > 1``, see :class:`moec.plan.MoEPlan`).

Per MoE block the graph returns (pass ``moe``) ``router_losses`` = [LBL, z] (the LBL in the
microbatch or sequence form of ``plan.moe.balance``), ``expert_counts`` (the offered routes per
expert of this forward on this rank) and, under ``global_batch``, ``router_scores`` (P: the mean
normalized score per expert). :class:`RouterBalance` follows the training forwards of one
optimizer step (``plan.parallel.microbatches`` of them, in train mode with gradients on):

- the step's load: each forward adds its blocks' counts to a [blocks, N] device tensor;
- ``global_batch``: each forward first sums its counts over the data-parallel group (one
  all-reduce, on the device), so after microbatch m the load is that of microbatches 1..m of
  every rank; the forward's LBL is ``N * sum_e f_e * P_e`` with ``f`` = that load over its
  total and ``P`` this microbatch's on this rank. The gradient reduction averages over ranks,
  and the mean of the ranks' ``P`` is the global one, so with one microbatch the step's gradient
  is exactly that of the global batch's LBL; with M > 1 the last microbatch's f is the whole
  step's and microbatch m < M uses the loads seen so far (Megatron's ``global_aux_loss`` running
  sum): the loads of later microbatches do not exist when its forward and backward run;
- :meth:`RouterBalance.finish_step`, once per step after its backwards: the step's load summed
  over the data-parallel group (one all-reduce of [blocks, N], unless ``global_batch`` summed it
  already), its MaxVio per block (:func:`max_violation`), and under ``aux_free`` each block's
  selection bias moved by ``bias_update_rate * sign(mean load - load_e)``: every rank computes
  the same update from the same global load, so the biases stay replicated. The bias changes
  after the backwards, so a recompute in backward chooses the experts its forward chose.

Nothing here reads the device: the loads, shares, MaxVio and biases stay there until a log point
reads them (:meth:`RouterBalance.lbl_values`, :meth:`RouterBalance.finished`). A step left
without ``finish_step`` (a user loop that never calls it) is refused at the next step's first
forward under ``global_batch`` and ``aux_free``, whose loss or bias needs the step's end; the
other methods start the next step's load afresh (and have no MaxVio for the step missed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from moec.errors import MoecError
from moec.plan import MoEPlan
from moec.program import MoELayer

Aux = Mapping[tuple[str, str], torch.Tensor]
NEEDS_STEP_END = ("global_batch", "aux_free")
"""Balancing methods whose loss or bias needs :meth:`RouterBalance.finish_step` every step."""


class BalanceStepError(MoecError):
    """A training forward of a new step before the last step was finished."""


def max_violation(load: torch.Tensor) -> torch.Tensor:
    """MaxVio of each row of ``load`` [..., N] (routes per expert): the busiest expert's load
    over the mean load, minus 1; 0 when balanced (and for a row without routes), at most
    ``N / top_k - 1`` (every token on the same ``top_k`` experts)."""
    load = load.double()
    mean = load.mean(-1)
    return torch.where(mean > 0, load.amax(-1) / mean.clamp_min(1e-30) - 1, 0.0)


def bias_step(load: torch.Tensor, rate: float) -> torch.Tensor:
    """The ``aux_free`` bias update for ``load`` [..., N]: ``rate * sign(mean - load_e)``, up
    for the experts below the mean load, down for those above, 0 for those at it."""
    load = load.float()
    return rate * torch.sign(load.mean(-1, keepdim=True) - load)


def global_lbl(share: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``N * sum_e share_e * scores_e`` over the last dim: the global-batch LBL from the global
    load share ``f`` (constant) and this rank's mean normalized scores ``P`` (differentiable)."""
    return share.shape[-1] * (share.to(scores.dtype) * scores).sum(-1)


def router_loss_objective(
    aux: Aux, moe: MoEPlan, lbl: Mapping[str, torch.Tensor] | None = None
) -> torch.Tensor | None:
    """``lbl_coef * LBL + z_loss_coef * z`` summed over the ``router_losses`` aux outputs (one
    ``[LBL, z]`` pair per MoE block; ``lbl``: each block's LBL by path instead of the graph's,
    e.g. the global-batch one), without the LBL under ``aux_free``; None without MoE blocks.
    The coefficients stay host floats: a coefficient tensor would be copied to the device
    each call (a sync)."""
    total = None
    for (path, kind), value in aux.items():
        if kind != "router_losses":
            continue
        if moe.balance == "aux_free":
            term = moe.z_loss_coef * value[1]
        else:
            loss = value[0] if lbl is None else lbl[path]
            term = moe.lbl_coef * loss + moe.z_loss_coef * value[1]
        total = term if total is None else total + term
    return total


class RouterBalance:
    """The balancing state of a program's MoE blocks over an optimizer step (see module)."""

    def __init__(
        self,
        moe: MoEPlan,
        layers: Sequence[MoELayer],
        microbatches: int,
        group: dist.ProcessGroup | None,
        holder: nn.Module,
    ):
        """``layers``: the blocks whose aux outputs the forwards return; ``group``: the
        data-parallel ranks the loads are summed over (None: this process alone); ``holder``:
        the module holding the ``aux_free`` bias buffers (looked up by name each step, so a
        ``.to()`` or a materialization that replaces them is followed)."""
        self.moe, self.microbatches, self.group, self.holder = moe, microbatches, group, holder
        self.paths = [layer.path for layer in layers]
        self.biases = [layer.expert_bias for layer in layers]
        self.forwards = 0
        """Training forwards of the step so far (a host count)."""
        self.load: torch.Tensor | None = None
        """[blocks, N] int64: the step's routes per expert so far (this rank's, or every
        rank's under ``global_batch``)."""
        self.share: torch.Tensor | None = None
        """[blocks, N]: ``global_batch``'s load share ``f`` for the last forward, None when the
        last forward was not a training one."""
        self.step_load: torch.Tensor | None = None
        """[blocks, N] int64: the last finished step's load, summed over the data-parallel
        ranks (written in place)."""
        self.max_vio: torch.Tensor | None = None
        """[blocks] float64: the last finished step's MaxVio (written in place)."""

    @torch.compiler.disable  # host state; a user's torch.compile breaks the graph here
    def after_forward(self, aux: Aux, training: bool) -> None:
        """Take a forward's aux outputs: a training forward (train mode, gradients on) adds to
        the step's load; any other leaves it alone."""
        self.share = None
        if not training or not self.paths:
            return
        if self.forwards == self.microbatches:
            if self.moe.balance in NEEDS_STEP_END:
                raise BalanceStepError(
                    f"moe.balance = {self.moe.balance!r}: a training forward after the "
                    f"parallel.microbatches = {self.microbatches} of a step without "
                    "finish_step(): call CompiledModel.finish_step() once per optimizer step, "
                    "after the step's backwards (moec.train does)"
                )
            self._reset()
        counts = torch.stack([aux[(path, "expert_counts")] for path in self.paths])
        if self.load is None:
            self.load = torch.zeros_like(counts)
        if self.moe.balance == "global_batch":
            self._sum_over_ranks(counts)
        self.load += counts
        self.forwards += 1
        if self.moe.balance == "global_batch":
            self.share = self.load / self.load.sum(-1, keepdim=True)

    def objective(self, aux: Aux) -> torch.Tensor | None:
        """:func:`router_loss_objective` of the last forward's ``aux``, with the global-batch
        LBL under ``global_batch``."""
        if self.moe.balance != "global_batch":
            return router_loss_objective(aux, self.moe)
        lbl = self._global_lbl(aux)
        return router_loss_objective(aux, self.moe, dict(zip(self.paths, lbl, strict=True)))

    def _global_lbl(self, aux: Aux) -> torch.Tensor:
        if self.share is None:
            raise BalanceStepError(
                "moe.balance = 'global_batch': the router loss of a forward that was not a "
                "training one (train mode, gradients on) has no global load to form it from"
            )
        scores = torch.stack([aux[(path, "router_scores")] for path in self.paths])
        return global_lbl(self.share, scores)

    def lbl_values(self, aux: Aux) -> torch.Tensor:
        """[blocks]: each block's LBL for the last forward, as ``plan.moe.balance`` forms it
        (``global_batch``: from the global load; after a forward that was not a training one,
        the local microbatch LBL; ``aux_free``: the microbatch LBL, which nothing trains)."""
        if self.moe.balance == "global_batch" and self.share is not None:
            return self._global_lbl(aux).detach()
        return torch.stack([aux[(path, "router_losses")][0] for path in self.paths]).detach()

    def finish_step(self) -> None:
        """End the optimizer step (after its backwards): the step's global load and MaxVio,
        the ``aux_free`` bias update, a fresh load for the next step (see module)."""
        if self.load is None or self.forwards == 0:
            return
        if self.moe.balance != "global_batch":
            self._sum_over_ranks(self.load)
        if self.step_load is None:
            self.step_load = torch.empty_like(self.load)
            self.max_vio = torch.empty(
                len(self.paths), dtype=torch.float64, device=self.load.device
            )
        self.step_load.copy_(self.load)
        self.max_vio.copy_(max_violation(self.load))
        if self.moe.balance == "aux_free":
            update = bias_step(self.load, self.moe.bias_update_rate)
            for name, row in zip(self.biases, update, strict=True):
                self.holder.get_buffer(name).add_(row)
        self._reset()

    def finished(self) -> tuple[list[float], list[list[int]]] | None:
        """The last finished step's MaxVio and load per block, read from the device (a log
        point's read); None before the first."""
        if self.max_vio is None or self.step_load is None:
            return None
        return self.max_vio.tolist(), self.step_load.tolist()

    def _sum_over_ranks(self, load: torch.Tensor) -> None:
        if self.group is not None:
            dist.all_reduce(load, group=self.group)

    def _reset(self) -> None:
        self.forwards = 0
        if self.load is not None:
            self.load.zero_()
