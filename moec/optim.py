"""``moec.optim.AdamW``: torch's AdamW that also writes the compiled program's working weights.

Same constructor arguments (bar ``amsgrad`` / ``maximize`` / ``fused`` / ``capturable`` /
``differentiable``), parameter
groups, state (``step`` on the host, ``exp_avg``, ``exp_avg_sq``) and ``state_dict`` as
``torch.optim.AdamW``, so checkpoints and LR schedulers work unchanged. Where every parameter
with a gradient is a contiguous float32 tensor on a CUDA device (or the Triton interpreter
runs), the step is one pass per parameter (:mod:`moec.kernels.adamw`) that reads the gradient
in its own dtype (the bf16 gradients of working weights are not cast first), divides it by
the clip factor ``grad_scale`` (:func:`moec.runtime.distributed.clip_gradients_` sets it; no
pass over the gradients for clipping) and writes the parameter's bf16 working copy
(:class:`moec.runtime.working_weights.WorkingWeights`) from the updated value. Otherwise
torch's implementation runs and the program refreshes the copies itself on its next forward.

The results equal torch's single-tensor AdamW to float32 rounding (tests compare them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from moec.runtime.working_weights import WorkingWeights


class AdamW(torch.optim.AdamW):
    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        working_weights: WorkingWeights | None = None,
        foreach: bool | None = None,
    ):
        super().__init__(params, lr, betas, eps, weight_decay, foreach=foreach)
        self.working_weights = working_weights
        # clip_gradients_ hands the clip factor over as grad_scale instead of scaling gradients
        self._step_supports_amp_scaling = True
        self.grad_scale: Tensor | None = None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale, self.grad_scale = self.grad_scale, None  # for this step only
        if self._kernel_applies():
            self._kernel_step(grad_scale)
        else:
            if grad_scale is not None:
                grads = [
                    p.grad for g in self.param_groups for p in g["params"] if p.grad is not None
                ]
                torch._foreach_div_(grads, grad_scale)
            super().step()
        return loss

    def _kernel_applies(self) -> bool:
        from moec.kernels.adamw import kernel_applies

        if getattr(self, "found_inf", None) is not None:
            return False
        return all(
            not (group["amsgrad"] or group["maximize"]) and isinstance(group["lr"], float | int)
            and all(kernel_applies(p, p.grad) for p in group["params"] if p.grad is not None)
            for group in self.param_groups
        )  # fmt: skip

    def _kernel_step(self, grad_scale: Tensor | None) -> None:
        from moec.kernels.adamw import adamw_step_

        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:  # torch's layout: a host step counter, moments like the param
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(
                        param, memory_format=torch.preserve_format
                    )
                state["step"] += 1
                copy = self.working_weights.copy_of(param) if self.working_weights else None
                adamw_step_(
                    param,
                    param.grad,
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    copy,
                    grad_scale,
                    lr=float(group["lr"]),
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    step=float(state["step"]),
                )
                torch.autograd.graph.increment_version(param)  # written through a raw pointer
                if copy is not None:
                    self.working_weights.mark_fresh(param)
