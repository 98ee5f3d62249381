"""GPU: recompute block / selective lower the measured activation memory of a mid-size MoE.

Step times are the benchmark's (``python -m benchmarks.recompute --mid`` prints selective /
block), not asserted here: their ratio depends on the device and the shape.
"""

import pytest
import torch

from benchmarks.recompute import MID, build, measure

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_recompute_lowers_activation_memory():
    model = build(MID)
    rows = {p: measure(model, MID, p, "cuda", steps=3) for p in ("none", "block", "selective")}
    for r in rows.values():
        print(
            f"{r['policy']:<10} peak {r['peak_bytes'] / 2**30:6.2f} GiB"
            f"  activations {r['activation_bytes'] / 2**30:6.2f} GiB"
        )
    none, block, selective = rows["none"], rows["block"], rows["selective"]
    assert block["activation_bytes"] < 0.5 * none["activation_bytes"]
    assert selective["activation_bytes"] < none["activation_bytes"]
