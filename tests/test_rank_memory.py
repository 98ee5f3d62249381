"""The per-rank memory model: exact for parameters, gradients, AdamW state and working copies
(compared with the tensors of a real training step), and the trainer's refusal of a plan whose
prediction exceeds the limit, before anything is allocated."""

import pytest

import moec
from moec.analysis.rank_memory import rank_memory
from moec.cli import main
from moec.optim import AdamW
from moec.train import LanguageModelWithLoss, MemoryPlanError, TrainConfig, Trainer
from tests.models import tiny_llama, tokens

PLAN = {
    "moe": {"num_experts": 4, "top_k": 2, "dense_first": 1},
    "precision": {"compute_dtype": "bf16"},
}


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_state_bytes_equal_a_training_steps_tensors():
    ids = tokens(2, 17)
    args = (ids[:, :-1], ids[:, 1:])
    compiled = moec.compile(LanguageModelWithLoss(tiny_llama()), PLAN, args)
    optimizer = AdamW(compiled.parameters(), working_weights=compiled.working_weights)
    compiled(*args).backward()
    optimizer.step()
    predicted = rank_memory(compiled.program, 1, 2, 16)
    params = list(compiled.parameters())
    assert predicted.parameters == _nbytes(params)
    assert predicted.gradients == _nbytes(p.grad for p in params)
    moments = [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert predicted.optimizer == _nbytes(moments)
    copies = compiled.program.working_weights
    assert predicted.working_copies == _nbytes(compiled.get_buffer(b) for b in copies) > 0
    assert predicted.activations > 0
    assert predicted.total == sum(size for what, size in predicted.rows()[:-1])


def test_a_plan_that_does_not_fit_is_refused_before_it_trains(tmp_path):
    cfg = TrainConfig(steps=1, batch_size=2, seq_len=16, out=str(tmp_path), memory_limit_gib=1e-4)
    with pytest.raises(MemoryPlanError, match=r"(?s)GiB per rank.*parallel.ep.*activations"):
        Trainer(tiny_llama(), moec.Plan.from_dict(PLAN), cfg)


def test_plan_show_prints_the_per_rank_memory(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    plan.write_text("moe: {num_experts: 4, top_k: 2}\n")
    assert main(["plan", "show", str(plan), "--model", "llama", "--gpu-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "per-rank memory of llama" in out and "optimizer" in out and "(fits)" in out
