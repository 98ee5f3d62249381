"""``moec warmup PLAN --model M [--batch B --seq S]``: fill the compile cache before a job.

It builds the program ``moec train --plan PLAN --model M --batch-size B --seq-len S`` builds
(the same trainer, on synthetic tokens of the same shapes) and runs its first training step,
so every graph Inductor compiles and every kernel JIT-compiled or autotuned in that step lands
in moec's cache (:mod:`moec.cache`; ``MOEC_CACHE_DIR`` chooses it). A launch of the same plan
on the same kind of GPU and software then finds them there, e.g. warm one node's shared cache
before a many-node launch. Nothing is kept: no run folder, no checkpoint, no optimizer state.

It reports what it compiled (:class:`moec.train.timing.FirstStepClock`): the FX graphs compiled
and found in the cache, the kernels compiled and autotuned per backend, and the seconds each
part took; ``--json`` writes the same report to a file.

A plan that runs distributed (``parallel.dp`` or ``parallel.ep`` > 1) is warmed under
``torchrun`` with the job's layout, as it trains: each rank's program depends on it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> None:
    """Register ``moec warmup`` on the CLI's subcommands."""
    parser = subparsers.add_parser(
        "warmup",
        help="fill the compile cache for a plan: compile it and run one training step",
        description="Fill moec's compile cache for a job: build the trainer moec train would "
        "for PLAN and MODEL at this batch and sequence length, run its first step on synthetic "
        "tokens, and report what was compiled and what came from the cache.",
    )
    parser.add_argument("plan", help="plan YAML file (as moec train --plan)")
    parser.add_argument(
        "--model",
        required=True,
        help="the model, as moec train --model (a short name or path/to/file.py:factory)",
    )
    parser.add_argument(
        "--batch",
        type=int,
        help="sequences per step per rank (moec train --batch-size; default: as moec train's, "
        "the plan's microbatches x microbatch_size where it fixes one)",
    )
    parser.add_argument("--seq", type=int, default=128, help="sequence length (--seq-len)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument(
        "--vocab-size",
        type=int,
        help="a named model's vocabulary: that of the corpus moec train --data reads (default: "
        "the model's own, as moec train without --data)",
    )
    parser.add_argument("--json", help="also write the report to this file")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Warm the cache for ``args`` (see module); print the report."""
    from moec import cache

    dirs = cache.setup()  # before torch compiles anything
    report = warm(args.plan, args.model, args.batch, args.seq, args.device, args.vocab_size)
    report["cache"] = str(dirs.folder)
    print(describe(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def warm(
    plan_path: str,
    model: str,
    batch: int | None,
    seq: int,
    device: str,
    vocab_size: int | None = None,
) -> dict[str, Any]:
    """Build the trainer ``moec train`` would for these arguments (``batch``: its
    ``--batch-size``, None for none) and run its first step; the time to it by part
    (:class:`~moec.train.timing.FirstStepClock`) and the batch it ran at."""
    import torch

    from moec.models.zoo import load_model
    from moec.plan import Plan
    from moec.train import TrainConfig, Trainer

    plan = Plan.load(plan_path)
    with tempfile.TemporaryDirectory(prefix="moec_warmup_") as out:
        cfg = TrainConfig(
            steps=1,
            batch_size=batch,
            seq_len=seq,
            device=device,
            synthetic=True,
            out=out,
            plots=False,
        )
        torch.manual_seed(cfg.seed)
        trainer = Trainer(load_model(model, vocab_size=vocab_size)[0], plan, cfg)
        try:
            trainer.startup.step_starts()
            loss = trainer.train_step()
            first = trainer.startup.finish()
        finally:
            trainer.batches.close()
    return {
        "plan": plan_path,
        "model": model,
        "batch": trainer.cfg.batch_size,
        "seq": seq,
        "device": str(trainer.device),
        "loss": float(loss),
        "first_step": first,
    }


def describe(report: dict[str, Any]) -> str:
    """The report as lines: what was compiled, what came from the cache, and the seconds."""
    from moec.train.timing import format_first_step

    first = report["first_step"]
    lines = [
        f"moec warmup: {report['plan']} on {report['model']}, batch {report['batch']} x seq "
        f"{report['seq']}, {report['device']}; loss {report['loss']:.4f}; cache {report['cache']}",
        f"graphs: {first['graphs_compiled']} compiled, {first['graphs_cached']} from the cache",
        f"programs from the cache (passes skipped): {first['programs_cached']}",
    ]
    for backend, k in first["kernels"].items():
        lines.append(
            f"{backend} kernels: {k['kernels_compiled']} compiled, {k['kernels_cached']} from "
            f"the cache; {k['configs_benchmarked']} configs benchmarked, "
            f"{k['autotune_cached']} autotuned keys from the cache"
        )
    lines.append(format_first_step(first))
    return "\n".join(lines)
