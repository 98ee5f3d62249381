"""One optimizer step of a pipelined program with the runtime alone, for the runtime's tests: the
runtime's forward and backward over the microbatches, the Trainer's clipping
(:func:`moec.train.trainer.clip_job_gradients`) and the optimizer's step. The Trainer's own step
adds the learning-rate schedule, the skip guards and the rest (``tests/test_train_pp.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moec.runtime.pipeline import PipelineRuntime, runtime_for
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


def unsplit_step(model, x, y, microbatches: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The PP = 1 program: the same graph, microbatch by microbatch (gradient accumulation);
    returns the mean cross-entropy and the gradients, and leaves the gradients zeroed."""
    total = torch.zeros(())
    for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches), strict=True):
        logits = model(xm)
        ce = F.cross_entropy(logits.flatten(0, 1), ym.flatten())
        ((ce + model.aux_loss()) / microbatches).backward()
        total += ce.detach() / microbatches
    grads = {n: p.grad.clone() for n, p in model.graph_module.named_parameters()}
    model.zero_grad(set_to_none=True)
    return total, grads


def check_stage_grads(
    runtime: PipelineRuntime, expected: dict, where: str, expert_slice=None, **tolerance
) -> None:
    """Every gradient of the runtime's stages equals ``expected``'s of the same name (its
    ``expert_slice`` for experts), within ``tolerance`` (``assert_close``'s by default)."""
    checked = 0
    for module in runtime.modules:
        for name, param in module.graph_module.named_parameters():
            want = expected[name]
            if expert_slice is not None and module.program.role(name) == "expert":
                want = want[expert_slice]
            torch.testing.assert_close(
                param.grad, want, **tolerance, msg=lambda m, n=name: f"{where} {n}: {m}"
            )
            checked += 1
    assert checked > 0, f"{where}: no parameters on this rank"
