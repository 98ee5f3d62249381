"""Held-out evaluation in training (``eval_every``, ``eval_batches``, ``eval_data``): the eval
loss is the LM loss of the held-out batches in eval mode, evaluating changes no training step,
the records and summary carry it across a resume, a built corpus's eval split is the default
eval set, and data + expert (+ FSDP) parallel jobs give the single process's eval loss."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as tf

from moec.corpus import built_corpus
from moec.data import TextBatches
from moec.plan import Plan
from moec.train import TrainConfig, TrainConfigError, Trainer, language_model_loss, train
from moec.train.evaluation import EVAL_SEED, held_out, rank_batches
from tests.distributed import spawn
from tests.models import tiny_dropout_llama, tiny_llama

PLAN = {
    "moe": {"num_experts": 4, "top_k": 2, "dense_first": 1},
}
TIMING = ("step_time_s", "tokens_per_s_per_device", "useful_mfu", "eval_s", "checkpoint_s")
WINDOW = ("step_losses", "step_lrs")
"""A record's per-step values, over its log window (eval points are log points too)."""


def _cfg(out: Path, **kw) -> TrainConfig:
    base = dict(
        steps=6,
        batch_size=4,
        seq_len=16,
        warmup_steps=2,
        log_every=3,
        out=str(out),
        plots=False,
        device="cpu",
    )
    return TrainConfig(**{**base, **kw})


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _dropout_gpt2() -> torch.nn.Module:
    """A transformers GPT-2 with dropout, so that eval mode changes its loss."""
    config = tf.GPT2Config(
        vocab_size=256,
        n_embd=32,
        n_layer=2,
        n_head=4,
        use_cache=False,
        resid_pdrop=0.3,
        embd_pdrop=0.3,
        attn_pdrop=0.3,
        bos_token_id=0,
        eos_token_id=0,
    )
    return tf.GPT2LMHeadModel(config)


def test_eval_loss_is_the_dense_lm_loss_of_the_held_out_batches_in_eval_mode(tmp_path):
    torch.manual_seed(0)
    model = _dropout_gpt2()
    dense = copy.deepcopy(model).eval()
    # upcycled without a capacity limit: the MoE's first forward is the dense model's, and the
    # dense model has no router losses to add
    plan = {"moe": {"num_experts": 4, "top_k": 2, "capacity_factor": None}}
    plan["parallel"] = {"microbatches": 2}
    cfg = _cfg(tmp_path, eval_every=1, eval_batches=3)
    trainer = Trainer(model, Plan.from_dict(plan), cfg)
    text = TextBatches(cfg.batch_size, cfg.seq_len, EVAL_SEED)
    batches = [text.eval_batch(i) for i in range(3)]
    held = text.eval_data.unfold(0, cfg.seq_len + 1, 1)  # every window of the held-out tail
    for inputs, targets in batches:
        rows = torch.cat([inputs, targets[:, -1:]], 1)
        assert all((held == row).all(1).any() for row in rows)
    with torch.no_grad():
        by_hand = sum(float(language_model_loss(dense(x), y)) for x, y in batches) / 3
        dropped = sum(float(trainer.compiled(x, y)) for x, y in batches) / 3  # train mode
    assert trainer.evaluator() == pytest.approx(by_hand, rel=1e-5)
    assert trainer.compiled.training
    assert abs(dropped - by_hand) > 1e-3  # eval mode matters here: dropout is on


def test_rank_batches_share_every_batch_once_in_equal_rounds():
    for count, ranks in [(3, 2), (8, 4), (2, 4), (5, 1)]:
        shares = [rank_batches(count, r, ranks) for r in range(ranks)]
        assert len({len(s) for s in shares}) == 1
        counted = sorted(i for s in shares for i, kept in s if kept)
        assert counted == list(range(count))
    assert rank_batches(3, 1, 2) == [(1, True), (1, False)]
    assert rank_batches(2, 3, 4) == [(0, False)]


def test_eval_changes_no_training_step_and_is_reported_across_a_resume(tmp_path):
    torch.manual_seed(0)
    plain = train(tiny_dropout_llama(2), PLAN, _cfg(tmp_path / "plain"))
    torch.manual_seed(0)
    cfg = dict(eval_every=2, eval_batches=2, checkpoint_every=3, plots=True)
    full = train(tiny_dropout_llama(2), PLAN, _cfg(tmp_path / "eval", **cfg))
    assert full.losses == plain.losses  # bit for bit: the dropout draws from the RNG too
    records, before = _records(tmp_path / "eval"), _records(tmp_path / "plain")
    assert [r["step"] for r in records] == [2, 3, 4, 6]  # eval points are log points too
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4, 6]
    by_step = {r["step"]: r for r in records}
    for r in before:  # the routing statistics are the training forward's, not the eval's
        assert {k: v for k, v in r.items() if k not in (*TIMING, *WINDOW)} == {
            k: v for k, v in by_step[r["step"]].items() if k not in (*TIMING, *WINDOW, "eval_loss")
        }
    for key in WINDOW:  # every step's, whatever the windows
        assert [v for r in before for v in r[key]] == [v for r in records for v in r[key]]
    evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    best = min(evals, key=evals.get)
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["eval_loss"] == evals[6] and summary["eval_step"] == 6
    assert summary["best_eval_loss"] == evals[best] and summary["best_eval_step"] == best
    assert summary["eval_data"] == "held-out 5% of the offline text" and summary["eval_s"] > 0
    assert plain.summary["eval_loss"] is None and plain.summary["eval_s"] == 0
    assert (tmp_path / "eval" / "loss.png").exists()

    shutil.rmtree(tmp_path / "eval" / "checkpoints" / "step_6")  # as if it died after step 3
    torch.manual_seed(1234)
    resumed = train(tiny_dropout_llama(2), PLAN, _cfg(tmp_path / "eval", resume=True, **cfg))
    assert resumed.losses == full.losses[3:]
    again = {r["step"]: r["eval_loss"] for r in _records(tmp_path / "eval") if "eval_loss" in r}
    assert again == evals  # step 2's from before the checkpoint, 4 and 6 evaluated again
    assert resumed.summary["best_eval_loss"] == evals[best]


def test_eval_settings_are_checked_and_a_source_without_a_split_says_so(tmp_path, capsys):
    with pytest.raises(TrainConfigError, match=r"eval_every \(--eval-every\) = -1"):
        _cfg(tmp_path, eval_every=-1)
    with pytest.raises(TrainConfigError, match=r"eval_batches \(--eval-batches\) = 0"):
        _cfg(tmp_path, eval_batches=0)
    with pytest.raises(TrainConfigError, match=r"--eval-data.*set .*--eval-every"):
        _cfg(tmp_path, eval_data="x.bin")
    tokens = tmp_path / "tokens.bin"
    (np.arange(4000) % 256).astype(np.uint16).tofile(tokens)
    assert held_out(_cfg(tmp_path, data=str(tokens), eval_every=1), 256)[0] is None
    batches, what = held_out(_cfg(tmp_path, eval_every=1, eval_data=str(tokens)), 256)
    assert what == f"--eval-data {tokens}" and batches(0)[0].shape == (4, 16)
    torch.manual_seed(0)
    result = train(
        tiny_llama(2), PLAN, _cfg(tmp_path / "run", synthetic=True, steps=2, eval_every=1)
    )
    assert "no evaluation: synthetic tokens have no held-out split" in capsys.readouterr().err
    assert result.summary["eval_loss"] is None
    assert all("eval_loss" not in r for r in _records(tmp_path / "run"))


def test_moec_train_passes_the_eval_flags_to_the_config(tmp_path, monkeypatch, capsys):
    import moec.train.cli as train_cli
    from moec.cli import main

    configs = []
    monkeypatch.setattr(train_cli, "_train_and_report", lambda m, p, cfg: configs.append(cfg))
    flags = ["--eval-every", "5", "--eval-batches", "3", "--eval-data", "held.bin"]
    assert main(["train", "--out", str(tmp_path), *flags]) == 0
    assert (configs[0].eval_every, configs[0].eval_batches) == (5, 3)
    assert configs[0].eval_data == "held.bin"
    assert main(["train", "--out", str(tmp_path)]) == 0
    assert (configs[1].eval_every, configs[1].eval_batches, configs[1].eval_data) == (0, 8, None)
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "0: off (default: 0)" in " ".join(capsys.readouterr().out.split())


def test_a_built_corpus_is_evaluated_on_its_eval_split(tmp_path):
    from tests.test_corpus_build import _build, _sources

    out, manifest = _build(tmp_path, sources=(str(_sources(tmp_path / "src")),))
    corpus = built_corpus(out)
    vocab = corpus.vocab_size
    windows = {}
    for split in ("train", "eval"):
        ids = np.fromfile(getattr(corpus, split).path, np.uint16).astype(np.int64)
        windows[split] = torch.from_numpy(ids).unfold(0, 9, 1)
    for cfg in (
        _cfg(tmp_path, data=str(out), seq_len=8, eval_every=1),
        _cfg(tmp_path, eval_data=str(out), seq_len=8, eval_every=1, synthetic=True),
    ):
        batches, what = held_out(cfg, vocab)
        rows = torch.cat([batches(0)[0], batches(0)[1][:, -1:]], 1)
        assert all((windows["eval"] == row).all(1).any() for row in rows), what
        assert not any((windows["train"] == row).all(1).any() for row in rows), what
    model = tf.LlamaForCausalLM(
        tf.LlamaConfig(
            vocab_size=vocab,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            use_cache=False,
        )
    )
    cfg = _cfg(tmp_path / "run", data=str(out), seq_len=8, steps=2, eval_every=2)
    summary = train(model, PLAN, cfg).summary
    assert summary["eval_data"] == f"eval split of {out}"
    assert np.isfinite(summary["eval_loss"]) and summary["eval_step"] == 2
    assert manifest["tokens"]["eval"] > 0


# --- data + expert parallel jobs (gloo) --------------------------------------------------------

LAYOUTS = {
    "single": {},
    "ddp2_ep2": {"dp": 2, "ep": 2},
    "fsdp2_ep2": {"dp": 2, "ep": 2, "dp_shard": 2},
}


def _job_trainer(layout: str, out: str) -> Trainer:
    torch.manual_seed(0)
    plan = {
        "moe": {"num_experts": 4, "top_k": 2, "init": "random", "capacity_factor": None},
        "parallel": LAYOUTS[layout],
    }
    cfg = _cfg(Path(out), steps=2, log_every=1, eval_every=1, eval_batches=3)
    return Trainer(tiny_llama(2), Plan.from_dict(plan), cfg)


def _eval_worker(rank: int, world: int, layout: str, out: str) -> None:
    trainer = _job_trainer(layout, out)
    initial = trainer.evaluator()  # every rank runs its share; the mean is the job's
    summary = trainer.run().summary
    if rank == 0:
        (Path(out) / "eval.json").write_text(json.dumps({"initial": initial, **summary}))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ddp2_ep2", "fsdp2_ep2"])
def test_a_data_and_expert_parallel_job_evaluates_as_one_process(tmp_path, layout):
    single = _job_trainer("single", str(tmp_path / "single")).evaluator()
    spawn(_eval_worker, 2, layout, str(tmp_path))
    job = json.loads((tmp_path / "eval.json").read_text())
    assert job["initial"] == pytest.approx(single, rel=1e-5)
    records = _records(tmp_path)
    assert [r["step"] for r in records if "eval_loss" in r] == [1, 2]
    assert job["eval_loss"] == records[-1]["eval_loss"]
