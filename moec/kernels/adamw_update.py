"""One AdamW update's tensors, hyper-parameters and the host-side factors both AdamW
implementations use.

:class:`AdamWTensors` and :class:`AdamWStep` are the arguments of the Triton kernel
(:func:`moec.kernels.adamw.adamw_step_`) and of the torch reference
(:func:`moec.optim.adamw_reference_`); they live here, below both, so the kernel knows nothing
of the optimizer. Plain Python: importable without Triton.
"""

from __future__ import annotations

import dataclasses

from torch import Tensor


@dataclasses.dataclass(frozen=True)
class AdamWTensors:
    """One parameter's tensors of an update: ``param``, ``exp_avg``, ``exp_avg_sq`` (and
    ``copy``) are updated in place."""

    param: Tensor
    """float32."""
    grad: Tensor
    """float32 or bf16."""
    exp_avg: Tensor
    exp_avg_sq: Tensor
    copy: Tensor | None = None
    """The parameter's working copy (bf16), written from the updated value; None: none."""
    grad_scale: Tensor | None = None
    """The clip factor the gradient is divided by, a device scalar (no host read); None: 1."""
    found_inf: Tensor | None = None
    """A float32 device scalar, nonzero to skip the update (everything keeps its value)."""


@dataclasses.dataclass(frozen=True)
class AdamWStep:
    """One parameter's update: its group's hyper-parameters and ``step``, the count of this
    update (1 for the first); the host-side factors both implementations use, as torch's
    single-tensor AdamW computes them."""

    lr: float | Tensor
    """A host float, or a float32 device scalar (``lr_on_device``; needs a device ``step``)."""
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: float | Tensor
    """A host float, or a device tensor (``device_step``): the factors below are then tensors."""

    @property
    def decay(self) -> float:
        return 1 - self.lr * self.weight_decay

    @property
    def step_size(self) -> float:
        return self.lr / (1 - self.beta1**self.step)

    @property
    def bias_correction2_sqrt(self) -> float:
        return (1 - self.beta2**self.step) ** 0.5
