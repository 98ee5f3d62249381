"""GPU: a steady-state compiled training step of the demo model in bf16 never syncs the host."""

import pytest
import torch

from moec.kernels.gemm_backend import have_quack
from moec.plan import Plan
from moec.runtime.metrics import run_without_host_sync
from moec.train import DEMO_PLAN, TrainConfig, Trainer, demo_model
from tests.gpu.test_kernels_ops import quack_loss_calls

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("routing", ["learned", "random"])
def test_steady_state_step_has_no_host_sync(tmp_path, monkeypatch, routing):
    """With quack-kernels installed, the head (vocabulary 256, 2048 rows) runs on quack's fused
    loss GEMMs in those steps too."""
    fused_loss_calls = quack_loss_calls(monkeypatch) if have_quack() else None
    plan = Plan.from_dict({**DEMO_PLAN, "precision": {"compute_dtype": "bf16"}})
    plan.moe.routing = routing
    trainer = Trainer(
        demo_model(),
        plan,
        TrainConfig(steps=10, batch_size=16, seq_len=128, device="cuda", out=str(tmp_path)),
    )
    for _ in range(3):
        trainer.train_step()
    warm = None if fused_loss_calls is None else len(fused_loss_calls)
    losses = run_without_host_sync(trainer.train_step, 2)
    assert all(torch.isfinite(loss) for loss in losses)
    assert trainer.compiled.pass_results["fused_loss"].stats["fused"] == 1  # the fused head ran
    if fused_loss_calls is not None:
        assert 0 < warm < len(fused_loss_calls)
    # the program read bf16 working weights and moec's AdamW wrote every one of them
    assert len(trainer.compiled.working_weights) > 0
    assert trainer.compiled.working_weights.refresh() == 0
