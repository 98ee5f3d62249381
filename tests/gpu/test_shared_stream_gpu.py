"""GPU: pass ``shared_stream`` runs the shared expert on a second stream, forward and backward,
with the values of the program without it and no host sync."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moec.ops.side_stream import side_stream
from moec.plan import Plan
from tests.models import assert_same_grads, loss_and_grads, tiny_llama, tokens
from tests.test_shared_stream import compile_shared

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


class _StreamsOfOps(TorchDispatchMode):
    """The current stream each aten/moec op was called on, by op name."""

    def __init__(self) -> None:
        super().__init__()
        self.streams: dict[str, set[int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        stream = torch.cuda.current_stream().stream_id
        self.streams.setdefault(str(func), set()).add(stream)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_shared_expert_on_the_side_stream_keeps_values_and_syncs_nothing(dtype):
    torch.manual_seed(0)
    model = tiny_llama(layers=2).cuda()
    ids = tokens(batch=2, seq=64).cuda()
    want_loss, want = loss_and_grads(compile_shared(model, ids, False, dtype=dtype), ids)
    streamed = compile_shared(model, ids, True, dtype=dtype)
    assert streamed.pass_results["shared_stream"].stats["layers"] == 1

    mode = _StreamsOfOps()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with mode:
            got_loss, got = loss_and_grads(streamed, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()

    side = side_stream(ids.device).stream_id
    gemms = mode.streams.get("aten.mm.default", set()) | mode.streams.get(
        "aten.linear.default", set()
    )
    assert side in gemms, f"no shared-expert GEMM ran on the side stream: {mode.streams}"
    routed = mode.streams["moec.expert_mlp.default"]
    assert routed and side not in routed  # the routed experts stay on the program's stream
    assert torch.cuda.current_stream().stream_id != side  # the program's stream is back

    tol = {"fp32": (1e-6, 1e-5), "bf16": (1e-2, 1e-2)}[dtype]
    torch.testing.assert_close(got_loss, want_loss, atol=tol[0], rtol=tol[1])
    assert_same_grads(got, want, atol=tol[0], rtol=tol[1])


def test_the_graphed_step_with_the_shared_expert_stream_trains_as_the_eager_step(tmp_path):
    """The CUDA-graph capture takes the side stream's work (forked from and joined to the
    capture stream, the backward's by autograd) and replays it as the eager step runs it."""
    from moec.train import Trainer
    from tests.test_run_reliability import PLAN, _cfg
    from tests.test_run_reliability import tiny_llama as one_block_llama

    def trainer(name: str, graph: bool) -> Trainer:
        torch.manual_seed(0)
        plan = {
            **PLAN,
            "moe": {**PLAN["moe"], "shared_expert": True},
            "lowering": {"cuda_graph": graph, "shared_expert_stream": True},
        }
        cfg = _cfg(tmp_path / name, device="cuda", steps=8, warmup_steps=4)
        return Trainer(one_block_llama(2), Plan.from_dict(plan), cfg)

    eager, graphed = trainer("eager", False), trainer("graphed", True)
    assert graphed.step_graph is not None
    for step in range(6):
        a, b = eager.train_step(), graphed.train_step()
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"step {step}")
    assert graphed.step_graph.captured
