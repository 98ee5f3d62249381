"""The batch a run trains at: ``--batch-size``, else the plan's ``parallel.microbatches`` x
``parallel.microbatch_size`` (what ``moec plan auto`` priced), else the default; a
``--batch-size`` that contradicts the plan's microbatch size is refused in one line."""

import pytest

from moec.plan import Plan
from moec.train import TrainConfig, Trainer
from moec.train.config import DEFAULT_BATCH_SIZE, TrainConfigError, batch_per_rank
from tests.models import tiny_llama

MOE = {"num_experts": 4, "top_k": 2, "init": "random", "dense_first": 1}


def _parallel(microbatches: int = 1, microbatch_size: int | None = None):
    parallel = {"microbatches": microbatches, "microbatch_size": microbatch_size}
    return Plan.from_dict({"moe": MOE, "parallel": parallel}).parallel


def test_the_plans_microbatch_size_sets_the_batch_where_none_is_given():
    assert batch_per_rank(None, _parallel()) == DEFAULT_BATCH_SIZE
    assert batch_per_rank(None, _parallel(2, 3)) == 6
    assert batch_per_rank(6, _parallel(2, 3)) == 6  # the same batch, given
    assert batch_per_rank(10, _parallel(2)) == 10  # a plan without a size takes any split


@pytest.mark.parametrize(
    "given, micro, size, says",
    [
        (8, 2, 3, "give --batch-size 6 or none"),
        (7, 2, None, "must be divisible by parallel.microbatches = 2"),
    ],
)
def test_a_batch_size_the_plan_cannot_run_is_refused_naming_both_fields(given, micro, size, says):
    with pytest.raises(TrainConfigError, match="TrainConfig.batch_size \\(--batch-size\\)") as e:
        batch_per_rank(given, _parallel(micro, size))
    assert says in str(e.value) and "parallel.microbatches" in str(e.value)
    if size is not None:
        assert f"parallel.microbatch_size = {size}" in str(e.value)


def test_the_trainer_reads_and_captures_the_plans_microbatch(tmp_path):
    plan = Plan.from_dict({"moe": MOE, "parallel": {"microbatches": 2, "microbatch_size": 3}})
    cfg = TrainConfig(steps=1, seq_len=16, synthetic=True, out=str(tmp_path), plots=False)
    trainer = Trainer(tiny_llama(), plan, cfg)
    try:
        assert cfg.batch_size is None and trainer.cfg.batch_size == 6
        inputs, _ = trainer.data.batch(0)
        assert tuple(inputs.shape) == (6, 16)  # per rank and step: 2 microbatches of 3
        assert trainer.identity["data"]["batch_size"] == 6  # a resume checks the batch it ran at
        assert trainer.train_step().isfinite()
    finally:
        if trainer.batches is not None:
            trainer.batches.close()


def test_moec_train_refuses_a_batch_size_against_the_plan_in_one_line(tmp_path, capsys):
    from moec.cli import main

    plan = tmp_path / "plan.yaml"
    plan.write_text(
        "moe: {num_experts: 4, top_k: 2, init: random, dense_first: 1}\n"
        "parallel: {microbatches: 2, microbatch_size: 3}\n"
    )
    argv = ["train", "--plan", str(plan), "--synthetic", "--steps", "1", "--batch-size", "8"]
    assert main([*argv, "--out", str(tmp_path / "run"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moec: error: "), err
    assert "--batch-size" in err[0] and "parallel.microbatch_size = 3" in err[0]
    assert "give --batch-size 6" in err[0]
    assert not (tmp_path / "run").exists()  # refused before the run folder is made
