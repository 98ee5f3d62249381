"""GPU: the training step captured as a CUDA graph (``plan.experimental.cuda_graph``) trains as the
eager step does, follows the learning-rate schedule and the skip-step logic, replays without a
host sync, and is captured again at a new batch shape and after an eager (profiled) step."""

from __future__ import annotations

import pytest
import torch

from moec.plan import Plan
from moec.runtime.metrics import run_without_host_sync
from moec.train import Trainer
from tests.test_run_reliability import PLAN, _cfg, _optimizer_state, tiny_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _trainer(tmp_path, name: str, graph: bool, bf16: bool = False, **cfg) -> Trainer:
    torch.manual_seed(0)
    plan = Plan.from_dict(
        {
            **PLAN,
            "experimental": {"cuda_graph": graph},
            "precision": {"compute_dtype": "bf16" if bf16 else "fp32"},
        }
    )
    settings = dict(device="cuda", steps=12, warmup_steps=4, spike_sigma=6.0, spike_min_steps=3)
    return Trainer(tiny_llama(2), plan, _cfg(tmp_path / name, **{**settings, **cfg}))


@pytest.mark.parametrize("bf16", [False, True])
def test_the_graphed_step_trains_as_the_eager_step(tmp_path, bf16):
    eager = _trainer(tmp_path, "eager", graph=False, bf16=bf16)
    graphed = _trainer(tmp_path, "graphed", graph=True, bf16=bf16)
    assert graphed.step_graph is not None and eager.step_graph is None
    for step in range(8):
        a, b = eager.train_step(), graphed.train_step()
        # the schedule's warmup changes the lr every step: the replay reads it from the device
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"step {step}")
    assert graphed.step_graph.captured and graphed.step_graph.captures == 1
    for p, q in zip(eager.compiled.parameters(), graphed.compiled.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6)
    for name in ("skipped_steps", "spike_skipped_steps", "longest_streak"):
        assert torch.equal(getattr(graphed, name), getattr(eager, name)), name
    assert torch.equal(graphed.spikes.values, eager.spikes.values)
    for p in graphed.compiled.parameters():  # the AdamW step counters advanced in the graph
        assert float(graphed.optimizer.state[p]["step"]) == 8
    if bf16:  # the graph wrote every working copy
        assert graphed.compiled.working_weights.refresh() == 0
    losses = run_without_host_sync(graphed.train_step, 2)  # replays
    assert all(torch.isfinite(loss) for loss in losses)


def test_a_non_finite_replayed_step_is_skipped(tmp_path):
    trainer = _trainer(tmp_path, "nan", graph=True)
    poison = torch.ones((), device="cuda")  # read by the replays: NaN poisons the loss
    forward = trainer.compiled.forward
    # not a gradient hook on a parameter: that would pin its gradient accumulator to the
    # stream it was registered on, which the capture cannot depend on
    trainer.compiled.forward = lambda *args: forward(*args) * poison
    for _ in range(4):
        trainer.train_step()
    assert trainer.step_graph.captured
    before = [t.clone() for t in _optimizer_state(trainer)]
    poison.fill_(float("nan"))
    trainer.train_step()
    assert int(trainer.skipped_steps) == 1 and int(trainer.longest_streak) == 1
    after = _optimizer_state(trainer)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    poison.fill_(1.0)
    trainer.train_step()
    assert int(trainer.skipped_steps) == 1 and int(trainer.nonfinite_streak) == 0
    del trainer.compiled.forward


def test_a_new_batch_shape_and_an_eager_step_capture_again(tmp_path):
    trainer = _trainer(tmp_path, "shapes", graph=True, batch_warmup="2:0,4:4")
    for _ in range(4):  # batch 2: two eager steps, a capture
        trainer.train_step()
    assert trainer.step_graph.captures == 1
    for _ in range(3):  # batch 4: warmup again, then the second capture
        trainer.train_step()
    assert trainer.step_graph.captures == 2
    trainer.train_step(eager=True)  # a profiled step drops the graph
    assert not trainer.step_graph.captured
    for _ in range(3):
        trainer.train_step()
    assert trainer.step_graph.captures == 3
    stats = trainer.compiled.routing_stats()  # the aux outputs the replays write
    assert all(s["offered"] == 4 * 16 * 2 for s in stats.values())
