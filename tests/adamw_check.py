"""``moec.optim.AdamW``'s Triton kernel against torch's single-tensor AdamW (shared by the
interpreter test on the CPU and the GPU test)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from moec.kernels.adamw import kernel_applies
from moec.optim import AdamW
from moec.runtime.working_weights import WorkingWeights


def step_both_and_compare(
    params: list[torch.nn.Parameter],
    copies: WorkingWeights,
    scale: torch.Tensor,
    run: Callable[[Callable[[], object]], object] = lambda step: step(),
) -> None:
    """Three steps of both optimizers on the same random gradients (in each parameter's
    ``grad_dtype``; torch's get them in float32, divided by the clip factor ``scale`` that
    ours takes as ``grad_scale``), through the kernel; then parameters and moments agree to
    float32 rounding and every working copy is fresh. ``run`` calls our step."""
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    kwargs = {"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.1, "eps": 1e-6}
    ours = AdamW(params, working_weights=copies, **kwargs)
    theirs = torch.optim.AdamW(twins, foreach=False, **kwargs)
    for _ in range(3):
        for p, t in zip(params, twins, strict=True):
            g = torch.randn_like(p).to(p.grad_dtype)
            p.grad, t.grad = g, g.float() / scale
        assert all(kernel_applies(p, p.grad) for p in params)
        ours.grad_scale = scale
        run(ours.step)
        theirs.step()
    for p, t in zip(params, twins, strict=True):
        torch.testing.assert_close(p, t, rtol=2e-6, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq"):
            mine, torch_s = ours.state[p][key], theirs.state[t][key]
            torch.testing.assert_close(mine, torch_s, rtol=2e-6, atol=1e-7)
    assert copies.refresh() == 0  # the steps left every copy fresh
