"""``moec.optim.AdamW``: torch's AdamW that also writes the compiled program's working weights.

The constructor takes torch's AdamW arguments but ``amsgrad``, ``maximize``, ``fused``,
``capturable`` and ``differentiable``; parameter groups, the state (``step`` on the host,
``exp_avg``, ``exp_avg_sq``) and ``state_dict`` are torch's, so checkpoints and LR schedulers
work unchanged. Each parameter is updated in one pass that reads its gradient in the dtype it
has (a working weight's bf16 gradient is not cast first), divides it by the clip factor
``grad_scale`` (:func:`moec.runtime.distributed.clip_gradients_` sets it, so clipping makes no
pass over the gradients) and writes the parameter's bf16 working copy
(:class:`moec.runtime.working_weights.WorkingWeights`) from the updated value: the Triton
kernel of :mod:`moec.kernels.adamw` for contiguous float32 parameters on CUDA (or under the
Triton interpreter), else :func:`adamw_reference_` in torch ops. Results equal torch's
single-tensor AdamW: bit for bit for the reference on float32 gradients, to float32 rounding
for the kernel (tests compare both). Options set on a parameter group that only torch's
implementation has (amsgrad, maximize, a tensor lr) run torch's step; the program then
refreshes its copies on the next forward.

Skipping a step on the device: with ``device_step=True`` every parameter's ``step`` counter is
a float32 tensor on its device (torch's capturable layout) and the bias corrections are computed
from it there. ``found_inf`` (set before a step, like ``grad_scale``; a float32 device scalar,
nonzero when the gradients are not finite) then makes that step a no-op without a host read:
parameters, moments, working copies and step counters keep their values, and the next step is
the one the skipped step would have been. Without a skipped step the results equal the
host-counter path to float32 rounding (the bias corrections are float32 there).

A learning rate on the device (``lr_on_device=True``, with ``device_step``): each group's
learning rate is also a float32 device scalar that the update reads, written from the group's
``lr`` (which schedulers set as usual) by :meth:`AdamW.write_lr` at every step outside a CUDA
graph capture. A captured step (:mod:`moec.runtime.step_graph`) thus follows the schedule: the
replaying code calls ``write_lr`` before each replay.

Skip-step AdamW (the report's B.7): :class:`SpikeDetector` keeps the last ``window`` finite
losses and gradient norms on the device and flags a step whose loss or norm exceeds their mean
by more than ``sigma`` standard deviations, once ``min_steps`` steps are recorded; the trainer
folds that flag into ``found_inf``, so a spike is skipped exactly as a non-finite step is. Every
finite step is recorded, spikes included (as OLMo-core's SkipStepOptimizer does): a lasting
change of level widens the statistics and stops being skipped instead of stalling the run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from moec.kernels.adamw_update import AdamWStep, AdamWTensors
from moec.runtime.working_weights import WorkingWeights


def adamw_reference_(tensors: AdamWTensors, update: AdamWStep) -> None:
    """:func:`moec.kernels.adamw.adamw_step_` in torch ops, in the order of torch's
    single-tensor AdamW (bit for bit equal to it on float32 gradients and a host step)."""
    param, exp_avg, exp_avg_sq = tensors.param, tensors.exp_avg, tensors.exp_avg_sq
    grad, found_inf = tensors.grad.to(param.dtype), tensors.found_inf
    if tensors.grad_scale is not None:
        grad = grad / tensors.grad_scale
    state = (param, exp_avg, exp_avg_sq)
    if found_inf is not None:  # update copies; keep the old values where found_inf is set
        param, exp_avg, exp_avg_sq = (t.clone() for t in state)
    param.mul_(update.decay)
    exp_avg.lerp_(grad, 1 - update.beta1)
    exp_avg_sq.mul_(update.beta2).addcmul_(grad, grad, value=1 - update.beta2)
    denom = (exp_avg_sq.sqrt() / update.bias_correction2_sqrt).add_(update.eps)
    if isinstance(update.step_size, Tensor):
        param.sub_(exp_avg / denom * update.step_size)
    else:
        param.addcdiv_(exp_avg, denom, value=-update.step_size)
    if found_inf is not None:
        for old, new in zip(state, (param, exp_avg, exp_avg_sq), strict=True):
            old.copy_(torch.where(found_inf != 0, old, new))
        param = state[0]
    if tensors.copy is not None:
        tensors.copy.copy_(param)


class AdamW(torch.optim.AdamW):
    writes_working_weights = True
    """Its update writes the working copies (``WorkingWeights`` need not refresh them)."""

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
        device_step: bool = False,
        lr_on_device: bool = False,
    ):
        if lr_on_device and not device_step:
            raise ValueError(
                "moec.optim.AdamW: lr_on_device derives the bias corrections on the device, "
                "from the step counters there: set device_step=True too"
            )
        super().__init__(params, lr, betas, eps, weight_decay, foreach=foreach)
        self.working_weights = working_weights
        if working_weights is not None:  # its update reads a working weight's bf16 gradient
            working_weights.keep_gradients(p for g in self.param_groups for p in g["params"])
        self.device_step = device_step
        self.lr_on_device = lr_on_device
        self._device_lrs: dict[int, Tensor] = {}
        """Group index -> its learning rate as a float32 device scalar (``lr_on_device``)."""
        # clip_gradients_ hands the clip factor over as grad_scale instead of scaling gradients
        self._step_supports_amp_scaling = True
        self.grad_scale: Tensor | None = None
        self.found_inf: Tensor | None = None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale, self.grad_scale = self.grad_scale, None  # for this step only
        found_inf, self.found_inf = self.found_inf, None
        if found_inf is not None and not self.device_step:
            raise ValueError(
                "moec.optim.AdamW: found_inf skips a step on the device, which needs the step "
                "counters there: build the optimizer with device_step=True"
            )
        if self.lr_on_device and not _capturing():
            self.write_lr()
        if self._torch_only():
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            if grad_scale is not None:
                torch._foreach_div_(grads, grad_scale)
            super().step()
        else:
            self._step(grad_scale, found_inf)
        return loss

    def write_lr(self) -> None:
        """Copy every group's ``lr`` into its device scalar (``lr_on_device``): a host-to-device
        write, no read. Outside a capture ``step`` does it; a CUDA graph's replayer before each
        replay."""
        for index, group in enumerate(self.param_groups):
            params = group["params"]
            if not params:
                continue
            held = self._device_lrs.get(index)
            if held is None:
                held = torch.empty((), dtype=torch.float32, device=params[0].device)
                self._device_lrs[index] = held
            held.fill_(group["lr"])

    def ensure_state(self) -> None:
        """Create every parameter's state now (zero moments, step 0), as its first step would.
        ``torch.distributed.checkpoint`` builds missing state with a zero-lr step on float32
        zero gradients, which a working weight (bf16 gradients) does not accept."""
        for group in self.param_groups:
            for param in group["params"]:
                self._state_of(param)

    def _state_of(self, param: Tensor) -> dict[str, Tensor]:
        state = self.state[param]
        if not state:  # torch's layout: a step counter, moments like the parameter
            state["step"] = torch.tensor(0.0)
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)
        step_device = param.device if self.device_step else torch.device("cpu")
        if state["step"].device != step_device:  # a loaded state of the other layout
            state["step"] = state["step"].to(step_device, torch.float32)
        return state

    def _torch_only(self) -> bool:
        """Options only torch's implementation has (it needs gradients in the params' dtype)."""
        options = [
            group["amsgrad"] or group["maximize"] or isinstance(group["lr"], Tensor)
            for group in self.param_groups
        ]
        if not any(options):
            return False
        if self.device_step:
            raise ValueError(
                "moec.optim.AdamW: amsgrad, maximize and a tensor lr run torch's AdamW, which "
                "has no device_step: drop the option or device_step"
            )
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.dtype != p.dtype:
                    raise ValueError(
                        "moec.optim.AdamW: amsgrad, maximize and a tensor lr run torch's AdamW, "
                        "which needs gradients in the parameters' dtype; a "
                        f"{tuple(p.shape)} parameter has a {p.grad.dtype} gradient (a working "
                        "weight's): drop the option"
                    )
        return True

    def _step(self, grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
        stepped = [
            (group, param)
            for group in self.param_groups
            for param in group["params"]
            if param.grad is not None
        ]
        counters = [self._state_of(param)["step"] for _, param in stepped]
        if counters:  # as torch's fused AdamW: count first, un-count the skipped step after
            torch._foreach_add_(counters, 1)
        lrs = {
            id(group): self._device_lrs.get(index) for index, group in enumerate(self.param_groups)
        }
        for group, param in stepped:
            state = self.state[param]
            beta1, beta2 = group["betas"]
            step = state["step"] if self.device_step else float(state["step"])
            lr = lrs[id(group)] if self.lr_on_device else group["lr"]
            hyper = (lr, beta1, beta2, group["eps"], group["weight_decay"])
            update = AdamWStep(*hyper, step=step)
            copy = self.working_weights.copy_of(param) if self.working_weights else None
            # an FSDP shard (DTensor) steps its local part, in place
            local, grad = _local(param), _local(param.grad)
            moments = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
            kernel = _kernel_step(local, grad, *moments, copy)
            tensors = AdamWTensors(local, grad, *moments, copy, grad_scale, found_inf)
            (kernel or adamw_reference_)(tensors, update)
            if kernel:  # written through a raw pointer: tell autograd, as in-place ops do
                torch.autograd.graph.increment_version(param)
            if copy is not None:
                self.working_weights.mark_fresh(param)
        if counters and found_inf is not None:
            torch._foreach_add_(counters, found_inf, alpha=-1)


class SpikeDetector:
    """Loss and gradient-norm spikes from running statistics, on the device (see module)."""

    def __init__(self, sigma: float, window: int, min_steps: int, device: torch.device):
        self.sigma, self.window, self.min_steps = sigma, window, min_steps
        self.values = torch.zeros(2, window, dtype=torch.float32, device=device)
        """Row 0 the losses, row 1 the gradient norms; a ring written at ``recorded % window``."""
        self.recorded = torch.zeros((), dtype=torch.int64, device=device)
        self._slots = torch.arange(window, device=device)

    def __call__(self, loss: Tensor, norm: Tensor) -> Tensor:
        """Whether this step's (loss, norm) is a spike (a bool device scalar; False for a
        non-finite step, which ``found_inf`` skips anyway), and record it when finite."""
        x = torch.stack([loss.detach().float(), norm.detach().float()])
        count = self.recorded.clamp(max=self.window)
        valid = self._slots < count
        n = count.clamp(min=1).float()
        mean = torch.where(valid, self.values, 0.0).sum(1) / n
        var = torch.where(valid, (self.values - mean[:, None]).square(), 0.0).sum(1) / n
        finite = torch.isfinite(x).all()
        above = (x > mean + self.sigma * var.sqrt()).any()
        spike = (self.recorded >= self.min_steps) & above & finite
        slot = (self._slots == self.recorded % self.window) & finite
        self.values.copy_(torch.where(slot, x[:, None], self.values))  # in place: capturable
        self.recorded.add_(finite)
        return spike

    def state_dict(self) -> dict[str, Tensor]:
        return {"values": self.values.cpu(), "recorded": self.recorded.cpu()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        values = state["values"]
        if values.shape != self.values.shape:
            raise ValueError(
                f"spike statistics of a window of {values.shape[1]} steps, not {self.window}"
            )
        self.values.copy_(values)
        self.recorded.copy_(state["recorded"])


def _capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _local(tensor: Tensor) -> Tensor:
    """The local part of a ``DTensor`` (it shares its storage), or ``tensor``."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _kernel_step(*tensors: Tensor | None) -> Callable[..., None] | None:
    """moec's Triton AdamW where it takes these tensors, else None. Only CUDA tensors ask the
    kernel: a CPU-only torch build comes without Triton."""
    if not tensors[0].is_cuda:
        return None
    from moec.kernels.adamw import adamw_step_, kernel_applies

    return adamw_step_ if kernel_applies(*tensors) else None
