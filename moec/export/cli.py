"""``moec export RUN_OR_CHECKPOINT [--to DIR] [--format hf]``: the command line of
:mod:`moec.export`; ``moec export RUN`` alone writes the run's newest checkpoint of the model and
plan its ``run.json`` recorded to ``RUN/hf``.

:func:`add_export_parser` registers the subcommand on ``moec``'s subparsers (``build_parser``
in :mod:`moec.cli` calls it); :func:`cmd_export` runs it. Errors are
:class:`~moec.export.hf.ExportError` (a :class:`~moec.errors.MoecError`): one line, exit 2.
"""

from __future__ import annotations

import argparse
import sys

from moec.export import DTYPE_NAMES

FORMATS = ("hf",)


def cmd_export(args: argparse.Namespace) -> int:
    from moec.export.hf import export_hf

    result = export_hf(
        args.source,
        args.to,
        model=args.model,
        config=args.config,
        plan=args.plan,
        dtype=args.dtype,
        overwrite=args.force,
        report=lambda message: print(message, file=sys.stderr),
    )
    print(f"wrote {result.architecture} from {result.checkpoint} to {result.out}")
    for note in result.notes:
        print(f"note: {note}")
    return 0


def add_export_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``moec export`` on ``moec``'s subcommands."""
    export = subparsers.add_parser(
        "export",
        help="write a trained run's checkpoint as a transformers MoE model",
        description="Write a moec run's newest committed checkpoint (or the checkpoint given) "
        "as a transformers-loadable MoE model (config.json + model.safetensors): Llama/"
        "Mistral (moec's bundled llama too) -> Mixtral or Qwen2-MoE, Qwen2 -> Qwen2-MoE, "
        "Qwen3 -> Qwen3-MoE, OLMo-2 -> FlexOlmo. The model and plan are those the run's "
        "run.json recorded unless given. Semantic differences (capacity drops, router z-loss) "
        "are printed.",
    )
    export.add_argument("source", help="a moec run directory, or RUN/checkpoints/step_N")
    export.add_argument(
        "--to", metavar="DIR", help="output directory (default: hf/ in the run directory)"
    )
    export.add_argument("--format", choices=FORMATS, default="hf", help="hf: transformers")
    source = export.add_mutually_exclusive_group()
    source.add_argument(
        "--model",
        help="the model the run trained (as for moec train: hf-llama, file.py:factory; "
        "default: the one the run's run.json recorded); its config gives the architecture",
    )
    source.add_argument(
        "--config",
        metavar="PATH",
        help="the source model's config.json (or a folder with one, e.g. the --init-from "
        "checkpoint)",
    )
    export.add_argument(
        "--plan", help="the plan the checkpoint was trained with (default: the run's run.json)"
    )
    export.add_argument(
        "--dtype", choices=DTYPE_NAMES, help="tensor dtype (default: the checkpoint's)"
    )
    export.add_argument("--force", action="store_true", help="replace a model in DIR")
    export.set_defaults(func=cmd_export)
