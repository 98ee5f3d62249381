"""GPU: a steady-state compiled training step of the demo model in bf16 never syncs the host."""

import pytest
import torch

from moec.kernels.target import Target
from moec.plan import Plan
from moec.runtime.metrics import run_without_host_sync
from moec.runtime.router_losses import bias_step
from moec.train import DEMO_PLAN, TrainConfig, Trainer, demo_model
from tests.gpu.test_kernels_ops import quack_loss_calls

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_steady_state_step_has_no_host_sync(tmp_path, monkeypatch):
    """With quack-kernels installed, the head (vocabulary 256, 2048 rows) runs on quack's fused
    loss GEMMs in those steps too."""
    fused_loss_calls = quack_loss_calls(monkeypatch) if Target.detect("cuda").quack else None
    plan = Plan.from_dict({**DEMO_PLAN, "precision": {"compute_dtype": "bf16"}})
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


@pytest.mark.parametrize("balance", ["microbatch", "global_batch", "sequence", "aux_free"])
def test_every_balance_method_steps_without_host_sync(tmp_path, balance):
    """Two microbatches a step: the step's loads accumulate, the global-batch loss forms, MaxVio
    and the aux-free bias update run, all on the device; the reads come after."""
    moe = {**DEMO_PLAN["moe"], "balance": balance, "bias_update_rate": 1e-2}
    plan = Plan.from_dict(
        {
            "moe": moe,
            "parallel": {"microbatches": 2},
            "precision": {"compute_dtype": "bf16"},
        }
    )
    trainer = Trainer(
        demo_model(),
        plan,
        TrainConfig(steps=10, batch_size=16, seq_len=128, device="cuda", out=str(tmp_path)),
    )
    for _ in range(3):
        trainer.train_step()
    compiled = trainer.compiled
    losses = run_without_host_sync(trainer.train_step, 2)
    assert all(torch.isfinite(loss) for loss in losses)
    layers = [x for x in compiled.moe_layers if x.expert_bias]
    assert len(layers) == (len(compiled.moe_layers) if balance == "aux_free" else 0)
    before = [compiled.get_buffer(x.expert_bias).clone() for x in layers]
    run_without_host_sync(trainer.train_step, 1)
    stats = compiled.routing_stats()
    assert all(s["max_vio"] is not None and s["max_vio"] >= 0 for s in stats.values())
    assert all(sum(s["step_load"]) == 16 * 128 * 2 for s in stats.values())
    for layer, bias in zip(layers, before, strict=True):
        load = torch.tensor(stats[layer.path]["step_load"], device=bias.device)
        want = bias + bias_step(load, plan.moe.bias_update_rate)
        torch.testing.assert_close(compiled.get_buffer(layer.expert_bias), want)
