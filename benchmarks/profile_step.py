"""Where a training step's GPU time goes: the moec step beside a hand-written baseline's.

Uses the e2e workload (``benchmarks/e2e.py``, its learning rate: the router does not collapse);
prints the torch profiler's kernel table for one steady-state step of each, counts
cudaStreamSynchronize / cudaEventSynchronize / cudaMemcpy device-to-host calls in the trace (the
report's B.6 check), and ends with kernel time by kind (:data:`KERNEL_KINDS`) side by side:
where moec gains on the baseline and where it loses.

    python -m benchmarks.profile_step [--small] [--rows 25] [--shapes] [--kernels N] [--gaps N]
                                      [--steps N] [--moec-only]
                                      [--baseline eager|compiled-fp32|compiled-bf16]

On a machine without CUDA it runs both steps as a smoke run (no kernel times).

``--shapes`` adds a table grouped by op and input shapes (which copies, which elementwise ops);
``--kernels N`` lists each kind's N largest kernels; ``--gaps N`` measures the device's idle time
within the step (the step's span minus the union of its kernels) and lists the N longest idle
stretches with the kernels on either side: launch gaps or stalls.
"""

from __future__ import annotations

import argparse
import collections
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.e2e import (
    BASELINES,
    FULL,
    LR,
    SMALL,
    EagerTrainer,
    dense_model,
    hand_written,
    moe_plan,
)
from moec.train import TrainConfig, Trainer

BLOCKING = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")

KERNEL_KINDS = (  # (kind, lower-case substrings of a CUDA kernel's name); the first match wins
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("expert GEMMs", ("_gmm", "groupproblemshape", "grouped", "quack", "cute")),
    ("dense GEMMs", ("gemm", "nvjet", "xmma", "cublas", "cutlass")),
    ("FP8 quantizers", ("rowwise_quantize", "columnwise_quantize")),
    ("routing, dispatch, combine", ("_dispatch_kernel", "_combine", "_route", "_push")),
    ("LM head loss", ("cross_entropy", "log_softmax", "nll_loss")),
    ("optimizer", ("adam", "multi_tensor")),
    ("casts and copies", ("copy", "cast", "catarray")),
    ("Inductor kernels", ("triton_",)),
    ("moec elementwise (RoPE, GLU)", ("_rope", "_act_kernel")),
    ("norms, reductions", ("norm", "reduce")),
    ("other elementwise", ("elementwise", "vectorized")),
    ("communication", ("nccl",)),
)


def kernel_kind(name: str) -> str:
    lower = name.lower()
    for kind, keys in KERNEL_KINDS:
        if any(k in lower for k in keys):
            return kind
    return "other"


def kernel_spans(prof: profile) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every CUDA kernel in the profiled window, by start."""
    spans = [
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
        and not e.is_user_annotation
        and e.time_range.elapsed_us() > 0
    ]
    return sorted(spans)


def idle_gaps(spans: list[tuple[float, float, str]]) -> list[tuple[float, float, str, str]]:
    """The stretches inside the window where no kernel runs on any stream: (us, when in us from
    the first kernel's start, kernel before, kernel after). Kernels on different streams
    overlap, so busy time is their union."""
    gaps = []
    busy_until, last = spans[0][1], spans[0][2]
    for start, end, name in spans[1:]:
        if start > busy_until:
            gaps.append((start - busy_until, busy_until - spans[0][0], last, name))
        if end > busy_until:
            busy_until, last = end, name
    return gaps


def print_gaps(name: str, spans: list[tuple[float, float, str]], top: int) -> None:
    """The step's device idle time: in total, by gap length, and its ``top`` longest gaps."""
    gaps = idle_gaps(spans)
    span_ms = (max(end for _, end, _ in spans) - spans[0][0]) / 1e3
    idle_ms = sum(g for g, *_ in gaps) / 1e3
    print(
        f"\n=== {name}: device idle {idle_ms:.1f} ms of a {span_ms:.1f} ms span "
        f"({len(spans)} kernels, {len(gaps)} gaps)"
    )
    for lo, hi in ((0, 5), (5, 20), (20, 100), (100, 1000), (1000, float("inf"))):
        within = [g for g, *_ in gaps if lo <= g < hi]
        print(f"  gaps of {lo}-{hi} us: {len(within):6d}, {sum(within) / 1e3:7.2f} ms")
    for gap, at, before, after in sorted(gaps, reverse=True)[:top]:
        print(f"  {gap:9.1f} us at {at / 1e3:7.1f} ms  after {before[:55]}  before {after[:55]}")


def kernel_times(prof: profile) -> dict[str, tuple[float, int]]:
    """Device milliseconds and launch count of the profiled window's CUDA kernels, by name."""
    times: dict[str, tuple[float, int]] = {}
    for e in prof.events():
        # a region annotated on the GPU (the optimizer's step) spans kernels counted already
        kernel = e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation
        if kernel and e.time_range.elapsed_us() > 0:
            ms, count = times.get(e.name, (0.0, 0))
            times[e.name] = (ms + e.time_range.elapsed_us() / 1e3, count + 1)
    return times


def ms_by_kind(kernels: dict[str, tuple[float, int]]) -> dict[str, float]:
    """:func:`kernel_times` summed by :func:`kernel_kind`."""
    by_kind: dict[str, float] = collections.defaultdict(float)
    for name, (ms, _) in kernels.items():
        by_kind[kernel_kind(name)] += ms
    return dict(by_kind)


def print_largest_by_kind(name: str, kernels: dict[str, tuple[float, int]], top: int) -> None:
    """Each kind's ``top`` largest kernels: which launches a kind's milliseconds are."""
    print(f"\n=== {name}: the {top} largest kernels of each kind (ms, launches)")
    by_kind: dict[str, list[tuple[float, int, str]]] = collections.defaultdict(list)
    for kernel, (ms, count) in kernels.items():
        by_kind[kernel_kind(kernel)].append((ms, count, kernel))
    for kind, rows in sorted(by_kind.items(), key=lambda kv: -sum(r[0] for r in kv[1])):
        print(f"{kind}: {sum(r[0] for r in rows):.1f} ms")
        for ms, count, kernel in sorted(rows, reverse=True)[:top]:
            print(f"  {ms:8.2f} {count:5d}  {kernel[:100]}")


def print_kinds(steps: dict[str, dict[str, float]]) -> None:
    """Kernel ms by kind, one column per profiled step, and each column's difference to the
    first (moec's): positive where the other step spends more."""
    names = list(steps)
    kinds = sorted(
        {k for kinds in steps.values() for k in kinds}, key=lambda k: -steps[names[0]].get(k, 0)
    )
    print(f"\n=== kernel ms by kind, one step each ({', '.join(names)})")
    print(
        f"{'kind':32}"
        + "".join(f"{n[:22]:>24}" for n in names)
        + "".join(f"{'minus moec':>14}" for _ in names[1:])
    )
    for kind in [*kinds, "total"]:
        row = [sum(v.values()) if kind == "total" else v.get(kind, 0.0) for v in steps.values()]
        print(
            f"{kind:32}"
            + "".join(f"{ms:24.1f}" for ms in row)
            + "".join(f"{ms - row[0]:+14.1f}" for ms in row[1:])
        )


def profile_step(
    name: str, step, rows: int, shapes: bool = False, top: int = 0, gaps: int = 0, steps: int = 1
) -> dict[str, float]:
    """Kernel ms by kind of one step: the mean over ``steps`` profiled back to back (no sync
    between them, as in training: the host may run ahead into the next step)."""
    cuda = torch.cuda.is_available()
    for _ in range(3):
        step()
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=shapes) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    blocking = {e.key: e.count for e in events if e.key in BLOCKING or "DtoH" in e.key}
    print(f"\n=== {name}: blocking host calls {blocking or 'none'}")
    print(events.table(sort_by="self_cuda_time_total", row_limit=rows))
    if shapes:
        by_shape = prof.key_averages(group_by_input_shape=True)
        table = by_shape.table(
            sort_by="cuda_time_total",
            row_limit=2 * rows,
            max_name_column_width=40,
            max_shapes_column_width=90,
        )
        print(table)
    kernels = kernel_times(prof)
    if gaps and cuda:
        print_gaps(name, kernel_spans(prof), gaps)
    if top:
        print_largest_by_kind(name, kernels, top)
    return {kind: ms / steps for kind, ms in ms_by_kind(kernels).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--shapes", action="store_true", help="also group by input shapes")
    parser.add_argument("--kernels", type=int, default=0, help="list each kind's largest N kernels")
    parser.add_argument(
        "--gaps", type=int, default=0, help="the device's idle time and its N longest gaps"
    )
    parser.add_argument(
        "--steps", type=int, default=1, help="profile N steps back to back (kinds: per step)"
    )
    parser.add_argument("--moec-only", action="store_true", help="skip the baseline")
    parser.add_argument(
        "--fp8",
        nargs="*",
        metavar="SCOPE",
        help="moec with precision.gemm fp8_rowwise over these scopes (none named: the default)",
    )
    parser.add_argument(
        "--baseline",
        choices=BASELINES,
        default="eager",
        help="the hand-written step set beside moec's (e2e.py's baselines)",
    )
    args = parser.parse_args()
    s = SMALL if args.small else FULL
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: a smoke run
    cfg = TrainConfig(
        lr=LR,
        steps=100,
        batch_size=s["micro"],
        seq_len=s["seq"],
        device=str(device),
        synthetic=True,
        out=tempfile.mkdtemp(prefix="moec_profile_"),  # a fresh run directory per run
        plots=False,
    )
    torch.manual_seed(0)
    plan = moe_plan(s)
    if args.fp8 is not None:
        plan.precision.gemm = "fp8_rowwise"
        plan.precision.scope = args.fp8 or plan.precision.scope
    trainer = Trainer(dense_model(s), plan, cfg)
    kinds = {
        "moec": profile_step(
            "moec", trainer.train_step, args.rows, args.shapes, args.kernels, args.gaps, args.steps
        )
    }
    if not args.moec_only:
        trainer.batches.close()
        del trainer
        if device.type == "cuda":
            torch.cuda.empty_cache()
        _, options = BASELINES[args.baseline]
        hand = EagerTrainer(hand_written(s, dense_model(s)), s, device, **options)
        kinds[args.baseline] = profile_step(
            args.baseline,
            hand.train_step,
            args.rows,
            args.shapes,
            args.kernels,
            args.gaps,
            args.steps,
        )
    print_kinds(kinds)


if __name__ == "__main__":
    main()
