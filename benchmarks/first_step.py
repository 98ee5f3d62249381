"""Time to the first training step: the e2e workload launched twice, each in a fresh process.

Both launches share one moec cache (:mod:`moec.cache`), empty before the first (a fresh folder
unless ``--cache`` names one): the first launch is cold, the second finds what the first
compiled. Each launch (``--launch``, a new Python process) builds ``benchmarks/e2e.py``'s moec
trainer (the report's Table 47 workload; ``--tiny``: the same structure at a CPU's size) as
``moec train --init-from fresh`` does (the dense model on the meta device, its tensors drawn at
materialization, on the CPU, and copied to the training device; the hand-written anchor is built
on the device directly), runs its first step, then ``--warmup`` and ``--steps`` more for the
steady step time (``e2e.measure``). Printed per launch: seconds from the process's start to the
end of its first step (imports included), the first step's breakdown
(``moec.train.timing.FirstStepClock``: capture, passes, materialize, Inductor and its FX graphs
compiled / found in the cache, kernel JIT and autotuning per backend, the step itself, the rest)
and the steady step time, with the second launch's over the first's.

``--anchors`` (or ``--kinds compiled``): also the hand-written MoE of ``e2e.py`` with each
block under ``torch.compile`` (its ``compiled, fp32 weights`` baseline: per-block compilation,
as torchtitan compiles), launched twice the same way with Inductor's cache in a fresh folder of
its own. OLMo-core and torchtitan themselves are not driven by this script: where they are
installed it says so, and their own launchers give their figures.

    python benchmarks/first_step.py [--tiny] [--steps 5] [--warmup 3] [--cache DIR]
                                    [--anchors | --kinds moec compiled] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KINDS = {"moec": "moec", "compiled": "hand-written, blocks compiled"}
ANCHOR_PACKAGES = {"olmo_core": "OLMo-core", "torchtitan": "torchtitan"}
TINY = dict(
    dim=64,
    layers=2,
    dense_first=1,
    dense_width=128,
    experts=4,
    top_k=2,
    width=64,
    seq=32,
    micro=2,
    vocab=256,
    heads=2,
)
"""``--tiny``: the e2e workload's structure (dense blocks first, routed experts with a shared
one) at a shape a CPU compiles and steps in seconds."""


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a CPU-sized shape (TINY)")
    parser.add_argument("--steps", type=int, default=5, help="timed steady steps per launch")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the timed ones")
    parser.add_argument("--cache", help="moec's cache folder (default: a fresh one)")
    parser.add_argument("--anchors", action="store_true", help="also the per-block compiled MoE")
    parser.add_argument(
        "--kinds", nargs="+", choices=KINDS, default=["moec"], help="what to launch (twice each)"
    )
    parser.add_argument("--json", help="write the launches' reports here")
    parser.add_argument("--launch", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--launched-at", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--report", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = arguments().parse_args()
    if args.launch:
        report = launch(args)
        Path(args.report).write_text(json.dumps(report, indent=2))
        return
    cache = args.cache or tempfile.mkdtemp(prefix="moec_first_step_cache_")
    env = {k: v for k, v in os.environ.items() if k not in _tool_variables()}
    env["MOEC_CACHE_DIR"] = cache
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    kinds = list(dict.fromkeys([*args.kinds, *(["compiled"] if args.anchors else [])]))
    reports = {}
    for kind in kinds:
        # the hand-written model compiles with Inductor alone: its cache in a fresh folder too
        fresh = {"TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="anchor_")}
        kind_env = env if kind == "moec" else {**env, **fresh}
        reports[kind] = [run_launch(args, kind, kind_env, i) for i in (1, 2)]
    if "compiled" in kinds:
        for package, name in ANCHOR_PACKAGES.items():
            found = importlib.util.find_spec(package) is not None
            state = "installed: run its own launcher" if found else "not installed"
            print(f"{name}: {state} (not driven by this script)")
    print(describe(reports, cache))
    if args.json:
        Path(args.json).write_text(json.dumps({"cache": cache, "launches": reports}, indent=2))


def _tool_variables() -> set[str]:
    """The cache variables moec sets: a launch must not inherit this shell's."""
    from moec.cache import TOOL_DIRS

    return set(TOOL_DIRS)


def run_launch(args: argparse.Namespace, kind: str, env: dict[str, str], n: int) -> dict:
    """Launch ``kind`` in a fresh process and return its report."""
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "report.json"
        command = [
            sys.executable,
            __file__,
            "--launch",
            kind,
            "--launched-at",
            str(time.time()),
            "--report",
            str(report),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
        ] + (["--tiny"] if args.tiny else [])
        print(f"launch {n} of {KINDS[kind]}", flush=True)
        subprocess.run(command, env=env, check=True, cwd=ROOT)
        return json.loads(report.read_text())


def launch(args: argparse.Namespace) -> dict[str, Any]:
    """One launch (in its own process): the first step, broken down, then the steady steps."""
    import torch

    from benchmarks import e2e
    from moec import cache
    from moec.train import TrainConfig, Trainer
    from moec.train.config import FRESH_INIT
    from moec.train.timing import FirstStepClock

    cache.setup()
    s = TINY if args.tiny else e2e.FULL
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    tokens = s["micro"] * s["seq"]
    if args.launch == "moec":
        cfg = TrainConfig(
            lr=e2e.LR,
            steps=args.steps + args.warmup + 2,
            batch_size=s["micro"],
            seq_len=s["seq"],
            device=str(device),
            synthetic=True,
            out=tempfile.mkdtemp(prefix="moec_first_step_"),
            plots=False,
            init_from=FRESH_INIT,
        )
        with torch.device("meta"):  # as `moec train --init-from fresh`: drawn at materialize
            dense = e2e.dense_model(s)
        trainer = Trainer(dense, e2e.moe_plan(s), cfg)
        clock, step = trainer.startup, trainer.train_step
        flops = trainer.train_flops_per_token * tokens
    else:
        clock = FirstStepClock(device)  # Inductor's time and graphs; no moec compile phases
        with device:  # built where it trains, as torchtitan's meta-then-device init does
            model = e2e.hand_written(s, e2e.dense_model(s))
        hand = e2e.EagerTrainer(model, s, device, compiled=True)
        step, flops = hand.train_step, 0.0
    clock.step_starts()
    step()
    first = clock.finish()
    to_first_step = time.time() - args.launched_at
    steady = e2e.measure(KINDS[args.launch], step, device, args.steps, args.warmup, flops, tokens)
    return {
        "kind": args.launch,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "shape": s,
        "cache": str(cache.active().folder),
        "launch_to_first_step_s": to_first_step,
        "first_step": first,
        "steady_step_s": steady["step_s"],
        "steady_median_step_ms": steady["median_step_ms"],
    }


def describe(reports: dict[str, list[dict]], cache: str) -> str:
    """A table: per launch, the time to its first step, its parts and the steady step."""
    lines = [f"\ntime to the first step, cache {cache}"]
    header = (
        f"{'launch':36} {'to step 1':>9} {'target':>7} {'capture':>8} {'passes':>7} {'mater.':>7} "
        f"{'Inductor':>9} {'graphs':>9} {'triton':>13} {'cute':>13} {'step':>7} {'other':>7} "
        f"{'steady ms':>10}"
    )
    lines.append(header)
    for kind, launches in reports.items():
        for n, r in enumerate(launches, 1):
            f = r["first_step"]
            k = f["kernels"]
            kernels = [f"{k[b]['jit_s']:.1f}/{k[b]['autotune_s']:.1f}" for b in ("triton", "cute")]
            lines.append(
                f"{KINDS[kind] + f', launch {n}':36} {r['launch_to_first_step_s']:9.1f} "
                f"{f['target_s']:7.1f} {f['capture_s']:8.1f} "
                f"{f['passes_s']:6.1f}{'*' if f['programs_cached'] else ' '}"
                f"{f['materialize_s']:7.1f} "
                f"{f['inductor_s']:9.1f} {f['graphs_compiled']:>4}/{f['graphs_cached']:<4} "
                f"{kernels[0]:>13} {kernels[1]:>13} {f['step_s']:7.1f} {f['other_s']:7.1f} "
                f"{1e3 * r['steady_step_s']:10.1f}"
            )
        if len(launches) == 2:
            ratio = launches[1]["steady_step_s"] / launches[0]["steady_step_s"]
            lines.append(f"{KINDS[kind]}: steady step, launch 2 / launch 1: {ratio:.3f}")
    lines.append(
        "(seconds; target: the machine's detection, which imports the kernel backends; "
        "passes*: the program was found in the cache, its load; graphs: FX graphs "
        "compiled / found in the cache; triton, cute: kernel JIT / autotuning)"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
