"""``plan.experimental.cuda_graph`` where no graph can be captured: the trainer says why and its
eager steps equal those of a plan without it (the capture itself:
tests/gpu/test_step_graph_gpu.py)."""

from __future__ import annotations

import torch

from moec.plan import Plan
from moec.runtime.step_graph import graph_blocker
from moec.train import Trainer
from tests.test_run_reliability import PLAN, _cfg, tiny_llama


def test_graph_blockers_name_the_reason():
    assert "CUDA device" in graph_blocker(torch.device("cpu"), distributed=False)
    assert "multi-process job" in graph_blocker(torch.device("cuda", 0), distributed=True)
    assert graph_blocker(torch.device("cuda", 0), distributed=False) is None


def test_on_the_cpu_the_plan_runs_eagerly_with_a_note(tmp_path, capsys):
    losses = {}
    for graph in (False, True):
        torch.manual_seed(0)
        plan = Plan.from_dict({**PLAN, "experimental": {"cuda_graph": graph}})
        trainer = Trainer(tiny_llama(), plan, _cfg(tmp_path / str(graph)))
        assert trainer.step_graph is None and not trainer.optimizer.lr_on_device
        losses[graph] = [float(trainer.train_step()) for _ in range(3)]
    assert losses[True] == losses[False]
    assert "experimental.cuda_graph: the step is not captured: the step runs on cpu" in (
        capsys.readouterr().err
    )
