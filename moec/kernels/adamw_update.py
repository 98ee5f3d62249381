"""One AdamW update's hyper-parameters and the host-side factors both AdamW implementations use.

:class:`AdamWStep` is the argument of the Triton kernel (:func:`moec.kernels.adamw.adamw_step_`)
and of the torch reference (:func:`moec.optim.adamw_reference_`); it lives here, below both,
so the kernel knows nothing of the optimizer. Plain Python: importable without Triton.
"""

from __future__ import annotations

import dataclasses

from torch import Tensor


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
