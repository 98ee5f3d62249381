"""One optimizer step of a pipelined program with the runtime alone, for the runtime's tests: the
runtime's forward and backward over the microbatches, the Trainer's clipping
(:func:`moec.train.trainer.clip_job_gradients`) and the optimizer's step. The Trainer's own step
adds the learning-rate schedule, the skip guards and the rest (``tests/test_train_pp.py``)."""

from __future__ import annotations

import torch

from moec.runtime.pipeline import runtime_for
from moec.train.trainer import clip_job_gradients


def pipeline_step(
    compiled, optimizer, x: torch.Tensor, y: torch.Tensor, clip: float | None = None
) -> torch.Tensor | None:
    """One step of ``compiled`` (built with its pipeline runtime before ``optimizer``); the mean
    loss on the last stage's ranks, else None."""
    loss = runtime_for(compiled).forward_backward(x, y)
    if clip is not None:
        device = next(compiled.parameters()).device
        clip_job_gradients(compiled, compiled.mesh, clip, optimizer, device)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss
