"""GPU: a second launch of a plan compiles nothing the first compiled (:mod:`moec.cache`): no
FX graph, no Triton kernel, no autotuning; and the first launch's breakdown sees moec's Triton
kernels compile (``first_step`` of :class:`moec.train.timing.FirstStepClock`)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_first_step import _finish, _job, _moec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PLAN = """
moe: {num_experts: 4, top_k: 2, init: random, dense_first: 0}
precision: {compute_dtype: bf16}
"""


def test_a_second_launch_compiles_and_autotunes_nothing(tmp_path):
    plan, env = _job(tmp_path)
    (tmp_path / "plan.yaml").write_text(PLAN)  # Inductor on (the CUDA default), bf16
    env["MOEC_AUTOTUNE"] = "1"
    warmup = ["warmup", *plan, "--batch", "2", "--seq", "16", "--device", "cuda", "--json"]
    reports = []
    for n in range(2):
        _finish(_moec([*warmup, f"{n}.json"], env, tmp_path))
        reports.append(json.loads((tmp_path / f"{n}.json").read_text()))
    cold, warm = (r["first_step"] for r in reports)
    assert cold["graphs_compiled"] > 0 and cold["kernels"]["triton"]["kernels_compiled"] > 0
    assert warm["graphs_compiled"] == 0 and warm["graphs_cached"] > 0, warm
    for backend, k in warm["kernels"].items():
        assert k["kernels_compiled"] == 0 and k["configs_benchmarked"] == 0, (backend, k)
    assert reports[0]["loss"] == reports[1]["loss"]
