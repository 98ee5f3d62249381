"""Activation recompute: peak memory and step time of none / block / selective (pass ``recompute``).

``--full`` is the report's e2e workload (Table 47): 8 blocks, the first 2 dense (FFN width 24576),
32 routed experts top-8 of width 1536 with one shared expert, d = 1536, 12 heads, sequence 8192,
3 sequences per microbatch, bf16 autocast over fp32 weights; ``--mid`` is the shape of
``tests/gpu/test_recompute_gpu.py``; the default is a small shape that runs anywhere. Each policy
compiles a fresh copy of the same dense ``moec.models.Llama``; a step is forward + backward of
the model with its loss (as the Trainer captures it: the LM head and loss fused), no optimizer.
Printed per policy: steady-state step time, peak memory (``torch.cuda.max_memory_allocated``),
activation memory (peak minus what was allocated before the step), the recompute pass's
predicted saved bytes and predicted peak (saved bytes plus, for the block whose backward needs
most, the transient of recomputing it and the gradients live in its backward), measured /
predicted peak; ratios against ``none`` (whose prediction comes from the other policies'
compiles: without recompute the pass does not run); then the step time of ``selective`` over
``block`` (selective caches the GEMM outputs block recomputes; whether that is faster depends on
the shape and the device, so no test asserts it).

    python -m benchmarks.recompute [--full | --mid] [--steps 5] [--out recompute.json]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import time

import torch

import moec
from benchmarks.e2e import FULL, dense_model
from moec.models import Llama
from moec.train import LanguageModelWithLoss

SMALL = dict(dim=128, layers=4, dense_first=1, dense_width=512, experts=8, top_k=2,
             width=128, seq=256, micro=2, vocab=1024, heads=4)  # fmt: skip
MID = dict(dim=512, layers=6, dense_first=1, dense_width=2048, experts=16, top_k=4,
           width=512, seq=2048, micro=4, vocab=8192, heads=8)  # fmt: skip
POLICIES = ("none", "block", "selective")
build = dense_model  # the e2e benchmark's dense model: same shapes, one definition


def plan(shape: dict, policy: str, dtype: str) -> dict:
    return {
        "moe": {
            "num_experts": shape["experts"],
            "top_k": shape["top_k"],
            "expert_width": shape["width"],
            "init": "random",
            "shared_expert": True,
            "dense_first": shape["dense_first"],
        },
        "precision": {"compute_dtype": dtype},
        "recompute": {"policy": policy},
    }


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(model: Llama, shape: dict, policy: str, device: str, steps: int) -> dict:
    ids = torch.randint(0, shape["vocab"], (shape["micro"], shape["seq"]), device=device)
    dtype = "bf16" if device == "cuda" else "fp32"
    with_loss = LanguageModelWithLoss(copy.deepcopy(model).to(device))  # the Trainer's program
    compiled = moec.compile(with_loss, plan(shape, policy, dtype), (ids, ids))
    stats = compiled.pass_results.get("recompute")

    def step() -> None:
        (compiled(ids, ids) + compiled.aux_loss()).backward()
        compiled.graph_module.zero_grad(set_to_none=False)

    step()
    step()
    sync(device)
    before = torch.cuda.memory_allocated() if device == "cuda" else 0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    seconds = (time.perf_counter() - start) / steps
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    result = {
        "policy": policy,
        "step_s": seconds,
        "peak_bytes": peak,
        "activation_bytes": peak - before,
        "predicted_saved_bytes": stats.stats["predicted_saved_bytes_after"] if stats else None,
        "predicted_peak_bytes": stats.stats["predicted_peak_bytes"] if stats else None,
        "predicted_saved_bytes_none": stats.stats["predicted_saved_bytes_before"]
        if stats
        else None,
        "predicted_peak_bytes_none": stats.stats["predicted_peak_bytes_before"] if stats else None,
        "recompute_flops": stats.stats["recompute_flops"] if stats else 0,
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shapes = parser.add_mutually_exclusive_group()
    shapes.add_argument("--full", action="store_true", help="the Table 47 e2e shape")
    shapes.add_argument("--mid", action="store_true", help="the GPU test's mid-size shape")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    name = "full" if args.full else "mid" if args.mid else "small"
    shape = {"full": FULL, "mid": MID, "small": SMALL}[name]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = build(shape)
    rows = []
    for policy in POLICIES:
        try:
            rows.append(measure(model, shape, policy, device, args.steps))
        except torch.cuda.OutOfMemoryError:
            print(f"{policy}: out of memory")
            continue
        gc.collect()  # the compiled model of the previous policy frees its memory
        if device == "cuda":
            torch.cuda.empty_cache()
    if [r["policy"] for r in rows[:2]] != ["none", "block"]:
        print(json.dumps(rows, indent=2))
        return
    base = rows[0]
    print(f"recompute benchmark, {name} shape on {device}: {shape}")
    print(f"{'policy':<10} {'step ms':>9} {'x none':>7} {'peak GiB':>9} {'act GiB':>8} "
          f"{'x none':>7} {'pred GiB':>9} {'pred peak':>9} {'meas/pred':>9}")  # fmt: skip
    gib = 2**30
    base["predicted_saved_bytes"] = rows[1]["predicted_saved_bytes_none"]
    base["predicted_peak_bytes"] = rows[1]["predicted_peak_bytes_none"]
    for r in rows:
        pred, pred_peak = r["predicted_saved_bytes"], r["predicted_peak_bytes"]
        print(
            f"{r['policy']:<10} {r['step_s'] * 1e3:>9.1f} {r['step_s'] / base['step_s']:>7.2f} "
            f"{r['peak_bytes'] / gib:>9.2f} {r['activation_bytes'] / gib:>8.2f} "
            f"{r['activation_bytes'] / max(base['activation_bytes'], 1):>7.2f} {pred / gib:>9.2f} "
            f"{pred_peak / gib:>9.2f} {r['activation_bytes'] / max(pred_peak, 1):>9.2f}"
        )
    by_policy = {r["policy"]: r for r in rows}
    if "selective" in by_policy:
        ratio = by_policy["selective"]["step_s"] / by_policy["block"]["step_s"]
        print(f"step time selective / block: {ratio:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": shape, "device": device, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
