"""The report's trainer (B.7, B.8): skip-step AdamW on loss / gradient-norm spikes, batch-size
warmup with sqrt learning-rate scaling (and bit-exact resume across a transition), weight-decay
groups with the LM head, LM-head z-loss."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

import moec
from moec.data import TextBatches
from moec.optim import SpikeDetector
from moec.plan import Plan
from moec.train import (
    LanguageModelWithLoss,
    TrainConfig,
    TrainConfigError,
    Trainer,
    language_model_loss,
    parameter_groups,
    train,
)
from moec.train.config import lr_factor, rank_batch_size
from tests.test_run_reliability import PLAN, _cfg, _optimizer_state, tiny_llama


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# --- skip-step ---------------------------------------------------------------------------------


def test_spike_detector_flags_outliers_after_its_minimum_history():
    spikes = SpikeDetector(sigma=3.0, window=3, min_steps=3, device=torch.device("cpu"))
    t = torch.tensor
    flags = [bool(spikes(t(v), t(1.0))) for v in (5.0, 50.0, 5.1, 4.9, 5.0, 50.0, 5.0)]
    # 50 at step 1: too early; at step 5: a spike (the window [5.1, 4.9, 5.0]); the recorded
    # spike widens the statistics after it
    assert flags == [False, False, False, False, False, True, False]
    assert not spikes(t(float("nan")), t(1.0))  # non-finite: found_inf's, and not recorded
    assert int(spikes.recorded) == 7
    assert bool(spikes(t(5.0), t(40.0)))  # the gradient norm alone
    state = spikes.state_dict()
    again = SpikeDetector(3.0, 3, 3, torch.device("cpu"))
    again.load_state_dict(state)
    assert torch.equal(again.values, spikes.values) and int(again.recorded) == 8


def test_an_injected_loss_spike_is_skipped_and_counted(tmp_path):
    # sigma 20: natural step-to-step changes stay below it, a loss x 100 does not
    cfg = _cfg(tmp_path, steps=8, spike_sigma=20.0, spike_window=8, spike_min_steps=3)
    trainer = Trainer(tiny_llama(), Plan.from_dict(PLAN), cfg)
    forward = trainer.compiled.forward

    def spiking(*args):  # step 5's loss x 100 (its gradients too): finite, but a spike
        loss = forward(*args)
        return loss * 100 if trainer.step == 5 else loss

    trainer.compiled.forward = spiking
    for _ in range(5):
        trainer.train_step()
    before = _optimizer_state(trainer)
    loss = trainer.train_step()  # step 5: skipped
    assert loss.item() > 100
    after = _optimizer_state(trainer)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert trainer.spike_skipped_steps.item() == 1 and trainer.skipped_steps.item() == 0
    assert trainer.scheduler.last_epoch == 6  # the schedule goes on, as for non-finite steps
    trainer.train_step()
    assert {float(s["step"]) for s in trainer.optimizer.state.values()} == {6.0}
    del trainer.compiled.forward


def test_spike_skips_reach_the_metrics_and_resume(tmp_path):
    # a tiny sigma: any step above the running mean is skipped
    cfg = dict(steps=6, spike_sigma=1e-6, spike_window=4, spike_min_steps=2, checkpoint_every=3)
    torch.manual_seed(0)  # a model whose run skips some steps (checked below)
    full = train(tiny_llama(), PLAN, _cfg(tmp_path, **cfg))
    counts = [r["spike_skipped_steps"] for r in _metrics(tmp_path)]
    assert counts[-1] == full.summary["spike_skipped_steps"] > 0
    shutil.rmtree(tmp_path / "checkpoints" / "step_6")
    resumed = train(tiny_llama(), PLAN, _cfg(tmp_path, resume=True, **cfg))
    assert resumed.losses == full.losses[3:]  # the statistics are part of the checkpoint
    assert [r["spike_skipped_steps"] for r in _metrics(tmp_path)] == counts


# --- batch-size warmup -------------------------------------------------------------------------


def test_batch_warmup_changes_batch_and_lr_and_resumes_across_a_transition(tmp_path):
    cfg = dict(
        steps=6, batch_size=4, batch_warmup="2:0,4:3", warmup_steps=1, checkpoint_every=2, lr=1e-3
    )
    config = _cfg(tmp_path / "probe", **cfg)
    data = TextBatches(rank_batch_size(config, dp=1), 16, synthetic=True)
    assert [data.batch(s)[0].shape[0] for s in range(5)] == [2, 2, 2, 4, 4]
    factor = lr_factor(config)
    assert [factor(s) for s in (1, 2)] == [1.0, 1.0]
    assert factor(3) == pytest.approx(math.sqrt(2))  # batch 2 -> 4
    assert rank_batch_size(config, dp=2)(3) == 2  # a global batch, split over the dp ranks

    out = tmp_path / "run"
    full = train(tiny_llama(), PLAN, _cfg(out, **cfg))
    records = _metrics(out)
    assert [r["global_batch"] for r in records] == [2, 2, 2, 4, 4, 4]
    lrs = [r["lr"] for r in records]  # the rate of the next step, as the scheduler reports
    assert lrs[1] == pytest.approx(1e-3) and lrs[2] == pytest.approx(1e-3 * math.sqrt(2))
    shutil.rmtree(out / "checkpoints" / "step_6")
    shutil.rmtree(out / "checkpoints" / "step_4")  # resume from step 2, before the transition
    resumed = train(tiny_llama(), PLAN, _cfg(out, resume=True, **cfg))
    assert resumed.losses == full.losses[2:]


def test_batch_warmup_is_checked(tmp_path):
    plan = Plan.from_dict({**PLAN, "parallel": {"microbatches": 2}})
    with pytest.raises(TrainConfigError, match=r"batch 3 is not divisible by .*2 x 1"):
        Trainer(tiny_llama(), plan, _cfg(tmp_path, batch_warmup="2:0,3:2,4:4"))
    with pytest.raises(TrainConfigError, match=r"the last batch \(6\) must be .* = 4"):
        Trainer(tiny_llama(), plan, _cfg(tmp_path, batch_warmup="2:0,6:2"))
    for bad, message in [
        ("2:1,4:3", "must start at step 0"),
        ("4:0,2:3", "must increase"),
        ("2:0,4:0", "must increase"),
        ("2-0", "is not BATCH:FROM_STEP"),
    ]:
        with pytest.raises(TrainConfigError, match=message):
            _cfg(tmp_path, batch_warmup=bad)


# --- weight decay groups, z-loss ---------------------------------------------------------------


@pytest.mark.parametrize("fused", [True, False])
def test_the_lm_head_joins_the_no_decay_group_when_configured(fused):
    model = tiny_llama()
    ids = torch.randint(0, 256, (2, 8))
    plan = {**PLAN, "loss": {"fused": fused}}
    compiled = moec.compile(LanguageModelWithLoss(model), plan, (ids, ids))
    head = compiled.get_parameter("model.lm_head.weight")

    def decay_of(no_decay):
        groups = parameter_groups(compiled, 0.1, no_decay)
        return {id(p): g["weight_decay"] for g in groups for p in g["params"]}

    default = decay_of(("embeddings", "norms", "biases"))
    assert default[id(head)] == 0.1
    assert default[id(compiled.get_parameter("model.embed.weight"))] == 0.0
    assert default[id(compiled.get_parameter("model.norm.weight"))] == 0.0
    with_head = decay_of(("embeddings", "norms", "biases", "lm_head"))
    assert with_head[id(head)] == 0.0
    changed = [k for k in default if default[k] != with_head[k]]
    assert changed == [id(head)]
    only_head = decay_of(("lm_head",))  # norms and embeddings decayed when not named
    assert only_head[id(compiled.get_parameter("model.norm.weight"))] == 0.1
    assert only_head[id(compiled.get_parameter("model.embed.weight"))] == 0.1
    with pytest.raises(TrainConfigError, match=r"heads unknown; accepted: embeddings, norms"):
        TrainConfig(no_decay="heads")


def _compiled(module: torch.nn.Module, plan: dict, inputs: tuple) -> torch.nn.Module:
    torch.manual_seed(0)  # the same random experts in every program
    return moec.compile(module, plan, inputs)


def test_z_loss_adds_its_coefficient_times_the_mean_squared_logsumexp():
    model = tiny_llama()
    ids, targets = torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8))
    logits = model(ids)
    expected = 1e-2 * torch.logsumexp(logits.float(), -1).square().mean()
    plain = language_model_loss(logits, targets)
    assert torch.allclose(language_model_loss(logits, targets, 1e-2) - plain, expected)
    # compiled with the fused loss: z-loss leaves the head unfused, the values agree
    logits = _compiled(model, PLAN, (ids,))(ids)
    expected = 1e-2 * torch.logsumexp(logits.float(), -1).square().mean()
    without = _compiled(LanguageModelWithLoss(model), PLAN, (ids, targets))  # fused
    with_z = _compiled(LanguageModelWithLoss(model, 1e-2), PLAN, (ids, targets))
    difference = with_z(ids, targets) - without(ids, targets)
    torch.testing.assert_close(difference, expected, rtol=1e-4, atol=1e-6)


def test_z_loss_trains_and_is_noted_with_the_fused_loss(tmp_path, capsys):
    result = train(tiny_llama(), PLAN, _cfg(tmp_path, steps=2, z_loss=1e-3))
    assert "--z-loss reads the LM head's logits" in capsys.readouterr().err
    assert all(math.isfinite(v) for v in result.losses)


def test_the_inductor_lowering_is_announced_where_it_runs(tmp_path, capsys):
    lowered = Plan.from_dict({**PLAN, "lowering": {"inductor": True}})
    Trainer(tiny_llama(), lowered, _cfg(tmp_path / "lowered", steps=1))
    assert "runs through Inductor" in capsys.readouterr().err
    Trainer(tiny_llama(), Plan.from_dict(PLAN), _cfg(tmp_path / "auto", steps=1))  # auto: CPU
    assert "Inductor" not in capsys.readouterr().err


def test_moec_train_flags_reach_the_config(tmp_path, monkeypatch):
    import moec.train.cli as train_cli
    from moec.cli import build_parser

    seen = {}
    monkeypatch.setattr(train_cli, "_train_and_report", lambda m, p, cfg: seen.setdefault("c", cfg))
    args = build_parser().parse_args(
        [
            "train",
            "--model", "llama",
            "--data", "a.bin:0.7,b/*.npy:0.3",
            "--data-dtype", "uint32",
            "--tokenizer", "tok",
            "--text-column", "body",
            "--batch-warmup", "4:0,8:10",
            "--batch-size", "8",
            "--spike-sigma", "6",
            "--spike-window", "64",
            "--spike-min-steps", "32",
            "--z-loss", "1e-4",
            "--no-decay", "embeddings,norms,lm_head",
            "--lr", "2e-4",
            "--warmup-steps", "5",
            "--weight-decay", "0.01",
        ]
    )  # fmt: skip
    args.func(args)
    cfg = seen["c"]
    assert cfg.data == "a.bin:0.7,b/*.npy:0.3" and cfg.data_dtype == "uint32"
    assert cfg.tokenizer == "tok" and cfg.text_column == "body"
    assert cfg.batch_warmup == ((4, 0), (8, 10))
    assert (cfg.spike_sigma, cfg.spike_window, cfg.spike_min_steps) == (6.0, 64, 32)
    assert cfg.z_loss == 1e-4 and cfg.no_decay == ("embeddings", "norms", "lm_head")
    assert (cfg.lr, cfg.warmup_steps, cfg.weight_decay) == (2e-4, 5, 0.01)


@pytest.mark.parametrize(
    "capability,gemm,says",
    [
        ((9, 0), "fp8_rowwise", None),
        ((9, 0), "mxfp8", "mxfp8 has no kernels on this GPU (sm90): it runs emulated"),
        ((10, 0), "mxfp8", None),
        ((10, 3), "fp8_rowwise", "mxfp8 is the recipe with kernels here"),
        ((10, 0), "bf16", None),
    ],
)
def test_trainer_names_an_emulated_precision(monkeypatch, capability, gemm, says):
    """The note a trainer prints when the plan's GEMM recipe has no kernels on its GPU."""
    from moec.kernels import arch

    monkeypatch.setattr(arch, "_capability", lambda index: capability)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    note = arch.emulated_precision(gemm, torch.device("cuda"))
    if says is None:
        assert note is None
    else:
        assert says in note and "right values, not faster" in note
    assert arch.emulated_precision(gemm, torch.device("cpu")) is None
