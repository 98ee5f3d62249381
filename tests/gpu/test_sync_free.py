"""GPU: a steady-state compiled training step of the demo model in bf16 never syncs the host."""

import pytest
import torch

from moec.kernels.gemm_backend import have_quack
from moec.plan import Plan
from moec.runtime.metrics import run_without_host_sync
from moec.train import DEMO_PLAN, TrainConfig, Trainer, demo_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("routing", ["learned", "random"])
def test_steady_state_step_has_no_host_sync(tmp_path, routing):
    plan = Plan.from_dict({**DEMO_PLAN, "precision": {"compute_dtype": "bf16"}})
    plan.moe.routing = routing
    trainer = Trainer(
        demo_model(),
        plan,
        TrainConfig(steps=10, batch_size=16, seq_len=128, device="cuda", out=str(tmp_path)),
    )
    for _ in range(3):
        trainer.train_step()
    losses = run_without_host_sync(trainer.train_step, 2)
    assert all(torch.isfinite(loss) for loss in losses)
    assert trainer.compiled.pass_results["fused_loss"].stats["fused"] == 1  # the fused head ran
    # the program read bf16 working weights and moec's AdamW wrote every one of them
    assert len(trainer.compiled.working_weights) > 0
    assert trainer.compiled.working_weights.refresh() == 0


@pytest.mark.skipif(not have_quack(), reason="quack-kernels (moec[cutlass]) is not installed")
def test_steady_state_step_on_quacks_fused_loss_has_no_host_sync(tmp_path, monkeypatch):
    """The demo model's head (vocabulary 256, 2048 rows) runs on quack's fused loss GEMMs."""
    import quack.linear_cross_entropy as quack_lce

    calls: list[int] = []
    original = quack_lce.scaled_exp_linear_cross_entropy_fwd
    monkeypatch.setattr(
        quack_lce,
        "scaled_exp_linear_cross_entropy_fwd",
        lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs),
    )
    plan = Plan.from_dict({**DEMO_PLAN, "precision": {"compute_dtype": "bf16"}})
    trainer = Trainer(
        demo_model(),
        plan,
        TrainConfig(steps=10, batch_size=16, seq_len=128, device="cuda", out=str(tmp_path)),
    )
    for _ in range(3):
        trainer.train_step()
    steps = len(calls)
    losses = run_without_host_sync(trainer.train_step, 2)
    assert all(torch.isfinite(loss) for loss in losses)
    assert steps > 0 and len(calls) > steps  # it ran in the steps without a host sync
