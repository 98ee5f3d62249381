"""The per-rank memory model: exact for parameters, gradients, AdamW state and working copies
(compared with the tensors of a real training step, also FSDP-sharded on 2 gloo ranks), the
trainer's refusal of a plan whose prediction exceeds the limit, before anything is allocated,
and ``moec plan show --model/--world``."""

import pytest
import torch

import moec
from moec.analysis.rank_memory import rank_memory
from moec.cli import main
from moec.models import Llama, LlamaConfig
from moec.optim import AdamW
from moec.train import LanguageModelWithLoss, MemoryPlanError, TrainConfig, Trainer
from tests.distributed import spawn
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


@pytest.mark.slow
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


# odd rows (vocabulary 255, dense FFN width 65) so the two ranks' shards differ in size
FSDP = {
    "moe": {"num_experts": 4, "top_k": 2, "dense_first": 1},
    "precision": {"compute_dtype": "bf16"},
    "parallel": {"dp": 2, "ep": 2, "dp_shard": 2},
}


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "to_local")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _fsdp_worker(rank: int, world: int, out: str) -> None:
    torch.manual_seed(0)  # the same dense init on every rank
    model = Llama(LlamaConfig(vocab_size=255, dim=32, n_layers=2, ffn_hidden=65))
    cfg = TrainConfig(
        steps=1, batch_size=2, seq_len=16, out=out, plots=False, device="cpu", synthetic=True
    )
    trainer = Trainer(model, moec.Plan.from_dict(FSDP), cfg)
    compiled, program = trainer.compiled, trainer.compiled.program
    predicted = rank_memory(program, 1, 2, 16)
    sharded = set(program.data_parallel.params)
    inputs, targets = trainer.data.batch(0)
    loss = compiled(inputs, targets)
    # between forward and backward: the root's sharded parameters are gathered in bf16, each
    # block group's were freed when its block ended (moec.ops.param_groups)
    groups = program.data_parallel.groups
    assert groups
    root = [p for n, p in compiled.named_parameters() if n in sharded and not n.startswith(groups)]
    grouped = [p for n, p in compiled.named_parameters() if n.startswith(groups) and n in sharded]
    assert {p.dtype for p in root} == {torch.bfloat16} and not any(_is_dtensor(p) for p in root)
    assert grouped and all(_is_dtensor(p) for p in grouped)
    largest = max(
        sum(_local(p).numel() for n, p in compiled.named_parameters() if n.startswith(g))
        for g in groups
    )
    # root: bf16 parameters + bf16 gradients + float32 reduce input; two groups' likewise
    assert 4 * _nbytes(root) <= predicted.gathered <= 4.2 * _nbytes(root) + 2 * 8 * 2 * largest
    (loss + compiled.aux_loss()).backward()
    trainer.reducer.finish()
    trainer.optimizer.step()
    params = list(compiled.parameters())
    moments = [s[k] for s in trainer.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    held = {
        "parameters": _nbytes(_local(p) for p in params),
        "gradients": _nbytes(_local(p.grad) for p in params),
        "optimizer": _nbytes(_local(m) for m in moments),
    }
    for what, size in held.items():
        # rank 0 holds the larger chunk of an odd dim 0 (torch.chunk), the prediction's size
        got = getattr(predicted, what)
        assert got == size if rank == 0 else got > size, (rank, what, got, size)
    copies = _nbytes(compiled.get_buffer(b) for b in program.working_weights)
    assert predicted.working_copies == copies > 0  # the experts' only: they are not sharded


@pytest.mark.slow
def test_fsdp_state_bytes_equal_each_ranks_local_shards(tmp_path):
    spawn(_fsdp_worker, 2, str(tmp_path))


def test_plan_show_world_sets_dp_keeps_full_sharding_and_names_bad_worlds(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    plan.write_text("moe: {num_experts: 4, top_k: 2}\nparallel: {dp: 2, ep: 2, dp_shard: 2}\n")
    args = ["plan", "show", str(plan), "--model", "llama", "--world", "8", "--batch", "4"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "dp_shard: 8" in out and "fsdp{replicate=1,shard=8}" in out
    assert "world 8 = dp 8 x pp 1; FSDP" in out and "gathered" in out
    assert main(["plan", "show", str(plan), "--world", "5"]) == 2  # ep = 2 does not divide 5
    assert "--world 5" in capsys.readouterr().err
    plan.write_text("moe: {num_experts: 4, top_k: 2}\nparallel: {dp: 4, ep: 2, dp_shard: 2}\n")
    assert main(["plan", "show", str(plan), "--world", "8"]) == 0  # HSDP keeps its shard size
    assert "dp 8 x pp 1; HSDP: dense parameters sharded over dp_shard=2, 4 replicas" in (
        capsys.readouterr().out
    )


def test_plan_show_fsdp_shards_the_dense_state_of_ddp(tmp_path, capsys):
    tables = {}
    for name, shard in (("ddp", 1), ("fsdp", 4)):
        plan = tmp_path / f"{name}.yaml"
        plan.write_text(
            f"moe: {{num_experts: 4, top_k: 2}}\nparallel: {{dp: 4, ep: 4, dp_shard: {shard}}}\n"
        )
        assert main(["plan", "show", str(plan), "--model", "llama", "--world", "4"]) == 0
        out = capsys.readouterr().out
        tables[name] = {
            line.split()[0]: float(line.split()[1]) for line in out.splitlines() if "GiB" in line
        }
    ddp, fsdp = tables["ddp"], tables["fsdp"]
    assert ddp["gathered"] == 0 < fsdp["gathered"]
    for what in ("parameters", "gradients", "optimizer"):
        assert fsdp[what] < ddp[what], what
    assert fsdp["activations"] == pytest.approx(ddp["activations"], rel=0.02)
