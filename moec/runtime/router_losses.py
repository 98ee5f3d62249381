"""The router losses' share of the training objective, in one place for every runtime."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from moec.plan import MoEPlan


def router_loss_objective(
    aux_outputs: Mapping[tuple[str, str], torch.Tensor], moe: MoEPlan
) -> torch.Tensor | None:
    """``lbl_coef * LBL + z_loss_coef * z`` summed over the ``router_losses`` aux outputs (one
    ``[LBL, z]`` pair per MoE block); None when there are none. The coefficients stay host
    floats: a coefficient tensor would be copied to the device each call (a sync)."""
    total = None
    for (_, kind), value in aux_outputs.items():
        if kind == "router_losses":
            term = moe.lbl_coef * value[0] + moe.z_loss_coef * value[1]
            total = term if total is None else total + term
    return total
