"""The Trainer in a data + expert parallel job (2 gloo ranks, EP = 2): it trains, keeps the
dense parameters identical across ranks, writes one set of logs and commits one checkpoint
whose manifest lists every rank's files. In float32 with two
microbatches (local accumulation, then one reduction), and in bf16 with one (working weights:
bf16 gradients reduced in float32)."""

import json

import pytest
import torch
import torch.distributed as dist

from moec.plan import Plan
from moec.train import TrainConfig, Trainer
from tests.distributed import spawn
from tests.models import tiny_llama

PLAN = {
    "moe": {"num_experts": 4, "top_k": 2, "init": "random", "capacity_factor": None},
    "parallel": {"dp": 2, "ep": 2, "microbatches": 2},
}


BF16 = {
    **PLAN,
    "parallel": {**PLAN["parallel"], "microbatches": 1},
    "precision": {"compute_dtype": "bf16"},
}


def _worker(rank: int, world: int, out: str, plan: dict) -> None:
    torch.manual_seed(0)  # the same dense init on every rank
    cfg = TrainConfig(
        steps=16,
        batch_size=8,
        seq_len=32,
        lr=3e-3,
        warmup_steps=2,
        log_every=4,
        out=out,
        plots=False,
        device="cpu",
    )
    trainer = Trainer(tiny_llama(2), Plan.from_dict(plan), cfg)
    assert (trainer.compiled.working_weights is not None) == ("precision" in plan)
    result = trainer.run()
    assert sum(result.losses[-4:]) / 4 < sum(result.losses[:4]) / 4 - 0.3, result.losses
    roles = trainer.compiled.program.param_roles
    for name, param in trainer.compiled.graph_module.named_parameters():
        gathered = [torch.empty_like(param) for _ in range(world)]
        dist.all_gather(gathered, param.detach())
        same = torch.equal(gathered[0], gathered[1])
        assert same == (roles.get(name) != "expert"), name  # experts differ: each rank its own


@pytest.mark.slow
@pytest.mark.parametrize("plan", [PLAN, BF16], ids=["fp32", "bf16"])
def test_trainer_runs_a_dp2_ep2_job(tmp_path, plan):
    spawn(_worker, 2, str(tmp_path), plan)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[-1])["step"] == 16
    step_16 = tmp_path / "checkpoints" / "step_16"
    files = json.loads((step_16 / "manifest.json").read_text())["files"]
    assert {"trainer_rank0.pt", "trainer_rank1.pt", ".metadata"} <= set(files)
    assert sorted(p.name for p in step_16.iterdir()) == sorted([*files, "manifest.json"])
