"""GPU: peak memory and step time of recompute none / block / selective on a mid-size MoE."""

import pytest
import torch

from benchmarks.recompute import build, measure

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MID = dict(dim=512, layers=6, dense_first=1, dense_width=2048, experts=16, top_k=4,
           width=512, seq=2048, micro=4, vocab=8192, heads=8)  # fmt: skip


def test_recompute_lowers_peak_memory_and_costs_bounded_time():
    torch.manual_seed(0)
    model = build(MID)
    rows = {p: measure(model, MID, p, "cuda", steps=3) for p in ("none", "block", "selective")}
    for r in rows.values():
        print(
            f"{r['policy']:<10} step {r['step_s'] * 1e3:7.1f} ms"
            f"  peak {r['peak_bytes'] / 2**30:6.2f} GiB"
            f"  activations {r['activation_bytes'] / 2**30:6.2f} GiB"
        )
    none, block, selective = rows["none"], rows["block"], rows["selective"]
    assert block["activation_bytes"] < 0.5 * none["activation_bytes"]
    assert selective["activation_bytes"] < none["activation_bytes"]
    # one extra forward in FLOPs; at this mid size checkpointing's per-region launch overhead
    # adds more (measured 2.3x on an H200; 1.25x at the e2e shape, benchmarks/RESULTS.md)
    assert block["step_s"] < 3.0 * none["step_s"]
    assert selective["step_s"] <= block["step_s"] * 1.1
