"""The ``moec`` command line: one function per subcommand, wired up by :func:`build_parser`.

    moec plan show plan.yaml                  the resolved plan as YAML + its pipeline string
                                              (runs no code the plan names: moe.activations)
    moec plan show plan.yaml --model M --world 64 --gpu-memory 80
                                              ... laid out on 64 GPUs, and one rank's memory
    moec inspect llama                        blocks and FFN regions, parameters, FLOPs/token
    moec debug llama --plan p.yaml --out dbg  the graph after every pass, and dbg/repro.py
    moec demo / moec train ...                training (moec.train)
    moec data build DIR [--source PATH ...]   a corpus from the text on this machine, tokenized
    moec warmup PLAN --model M                fill the compile cache for a job (moec.warmup)

Building the parser imports no torch (``moec --help`` and every ``moec COMMAND --help`` start at
once): the commands import what they run inside their function, or are named by
:func:`~moec.lazy.lazy_command`. ``moec train``'s flags are made from
:class:`~moec.train.config.TrainConfig`, ``moec data build``'s from
:class:`~moec.corpus_build.BuildOptions` (:func:`moec.flags.add_flags`). A new command is
one ``_add_..._parser(sub)`` line in :func:`build_parser` and its function.

MODEL is a short name (``llama``, ``gpt2``, ``hf-llama``, ``hf-qwen2``, ``hf-gpt2``) or
``path/to/file.py:factory`` (see :mod:`moec.models.zoo`).

Errors: a :class:`~moec.errors.MoecError` (a bad plan, model, input, file or environment) is
printed as one line ``moec: error: ...`` and the exit status is its ``exit_code`` (2); ``moec
--debug ...`` prints its traceback too. Any other exception is a bug in moec and keeps its
traceback (exit status 1). Exit status 0 on success.
"""

from __future__ import annotations

import argparse
import sys
import traceback
import typing
from collections.abc import Sequence
from types import SimpleNamespace

import moec.flags as flags
from moec.analysis.gpus import GPUS
from moec.errors import MoecError, one_line
from moec.export.cli import add_export_parser
from moec.lazy import lazy_command
from moec.models.zoo import SHORT_NAMES
from moec.plan import Plan
from moec.train.cli import DEMO_CONFIG, DEMO_FLAGS
from moec.train.config import DEFAULT_BATCH_SIZE, add_flags, batch_per_rank
from moec.warmup import add_parser as _add_warmup_parser

if typing.TYPE_CHECKING:  # the commands import torch when they run: building the parser does not
    from rich.console import Console

    from moec.models.zoo import Loaded


def _console() -> Console:
    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = 140  # logs and pipes: wide enough for the tables
    return console


def _load_plan(path: str | None) -> Plan:
    return Plan() if path is None else Plan.load(path)


def cmd_plan_show(args: argparse.Namespace) -> int:
    from moec.autoplan.memory import without_named_code
    from moec.passes.manager import pipeline_string

    plan = _load_plan(args.file)
    if args.world is not None:
        plan = plan_for_world(plan, args.world)
    console = _console()
    console.print(plan.to_yaml(), end="", markup=False)
    # one line, never wrapped: it is what --passes takes back
    console.print(f"passes: {pipeline_string(plan)}", markup=False, soft_wrap=True)
    if args.world is not None:
        console.print(describe_layout(plan), markup=False)
    if args.model is not None:
        if plan.moe.activations:
            console.print(
                f"note: plan show runs no code a plan names, so moe.activations "
                f"({', '.join(plan.moe.activations)}) is not loaded: FFNs computing them stay "
                f"dense in this table (moec debug {args.model} --plan {args.file} compiles "
                "with them)",
                markup=False,
            )
            plan = without_named_code(plan)
        console.print(_memory_table(plan, args), markup=False)
    return 0


class WorldSizeError(MoecError, ValueError):
    """A ``--world`` the plan's pipeline, expert or sharding degrees cannot be laid out on."""


def plan_for_world(plan: Plan, world: int) -> Plan:
    """``plan`` on ``world`` ranks: ``parallel.dp = world / pp``; a fully sharded plan
    (``dp_shard == dp > 1``) stays fully sharded, any other ``dp_shard`` (1: DDP, or an HSDP
    shard size) is kept as it is."""
    p = plan.parallel
    if world < 1 or world % p.pp:
        raise WorldSizeError(
            f"--world {world}: must be a positive multiple of parallel.pp={p.pp} "
            "(the world is dp x pp ranks)"
        )
    dp = world // p.pp
    if dp % p.ep:
        raise WorldSizeError(
            f"--world {world}: gives parallel.dp={dp} (world / pp), which parallel.ep={p.ep} "
            f"does not divide; use a multiple of pp x ep = {p.pp * p.ep}"
        )
    dp_shard = dp if p.dp_shard == p.dp > 1 else p.dp_shard
    if dp % dp_shard:
        raise WorldSizeError(
            f"--world {world}: gives parallel.dp={dp}, which parallel.dp_shard={dp_shard} (HSDP "
            "shard size) does not divide; use a world whose dp is a multiple of it"
        )
    data = plan.to_dict()
    data["parallel"] = {**data["parallel"], "dp": dp, "dp_shard": dp_shard}
    return Plan.from_dict(data)


def describe_layout(plan: Plan) -> str:
    """One line: how the plan's ranks divide between data, sharding, expert and pipeline
    parallelism."""
    p = plan.parallel
    if p.dp_shard == 1:
        dense = "DDP: dense parameters replicated on every dp rank"
    elif p.dp_shard == p.dp:
        dense = f"FSDP: dense parameters sharded over dp_shard={p.dp_shard}"
    else:
        dense = (
            f"HSDP: dense parameters sharded over dp_shard={p.dp_shard}, "
            f"{p.dp // p.dp_shard} replicas"
        )
    experts = plan.moe.num_experts // p.ep
    return (
        f"layout: world {p.dp * p.pp} = dp {p.dp} x pp {p.pp}; {dense}; "
        f"ep {p.ep} ({experts} of {plan.moe.num_experts} experts per rank, "
        f"{p.dp // p.ep} expert replicas)"
    )


def _meta_model(spec: str) -> Loaded:
    """The model ``spec`` names with its example inputs, built on the meta device: shapes and
    dtypes only, no parameter or input allocated, so a model of any size can be analysed."""
    import torch

    from moec.models.zoo import load_model

    with torch.device("meta"):
        return load_model(spec)


def _memory_table(plan: Plan, args: argparse.Namespace) -> str:
    """Per-rank memory of ``plan`` on ``args.model`` (:func:`moec.autoplan.memory.plan_memory`,
    which ``moec plan auto`` prices its plans with) at the batch ``moec train`` runs the plan
    at without ``--batch-size`` (:func:`~moec.train.config.batch_per_rank`: the plan's
    ``parallel.microbatch_size`` per microbatch where it fixes one), or at ``--batch`` per step
    where given (a what-if, which may differ from the plan's)."""
    from moec.analysis.rank_memory import format_rank_memory
    from moec.autoplan.memory import CapturedModel, plan_memory
    from moec.models.zoo import load_model

    micro = plan.parallel.microbatches
    micro_batch = (args.batch or batch_per_rank(None, plan.parallel)) // micro
    model = CapturedModel(lambda: load_model(args.model), args.model)
    memory, pp_rank = plan_memory(model, plan, micro_batch, args.seq)
    device = None if args.gpu_memory is None else round(args.gpu_memory * 1024**3)
    title = (
        f"per-rank memory of {args.model} (EP rank 0, pipeline rank {pp_rank} of "
        f"{plan.parallel.pp}, the fullest; {micro_batch} x {args.seq} tokens per microbatch, "
        f"{micro} microbatches):"
    )
    return title + "\n" + format_rank_memory(memory, device)


def cmd_inspect(args: argparse.Namespace) -> int:
    """Blocks, FFN regions and costs of MODEL, captured on the meta device (see
    :func:`_meta_model`)."""
    from rich.table import Table

    import moec
    from moec.analysis.cost import format_count, graph_cost
    from moec.analysis.structure import find_structure
    from moec.fx import module_path

    model, inputs, kwargs = _meta_model(args.model)
    gm = moec.trace(model, inputs, kwargs)
    cost = graph_cost(gm)
    sizes = {k: v for k, v in (("batch", args.batch), ("seq", args.seq)) if v is not None}
    report = cost.evaluate(**sizes)
    per_token = max(report.tokens, 1)
    table = Table(title=f"{args.model}: residual blocks and FFN regions")
    for column in ("#", "FFN module", "FFN", "block params", "FLOPs/token", "FFN FLOPs/token"):
        table.add_column(column, justify="left" if column in ("FFN module", "FFN") else "right")
    for block in report.blocks:
        table.add_row(
            str(block["index"]),
            block["ffn_path"],
            block["ffn"],
            format_count(block["params"]),
            format_count(block["flops"] / per_token),
            format_count(block["ffn_flops"] / per_token),
        )
    console = _console()
    console.print(table)
    structure = find_structure(gm)
    for reason in structure.rejected:
        console.print(f"not an FFN: {reason}", markup=False)
    for block in structure.blocks:
        if block.ffn.router is not None:  # the moe pass leaves these as they are
            router = module_path(block.ffn.router) or block.ffn.router.name
            console.print(
                f"kept by the moe pass: {block.ffn.module_path}, the shared expert of an MoE "
                f"block the model routes already (aten.topk in {router})",
                markup=False,
            )
    size_text = ", ".join(f"{k}={v}" for k, v in report.sizes.items())
    console.print(
        f"{len(report.blocks)} FFN regions (one per residual block); "
        f"params {format_count(report.params)}; tokens {report.tokens} ({size_text}); "
        f"forward FLOPs/token {format_count(report.flops_per_token)}; "
        f"training FLOPs/token {format_count(report.train_flops_per_token)}; "
        f"activations saved {format_count(report.saved_bytes)}B",
        markup=False,
    )
    return 0


def cmd_debug(args: argparse.Namespace) -> int:
    import moec
    from moec.debug import DebugDump, with_next_token_loss
    from moec.folders import writable_folder
    from moec.models.zoo import load_model
    from moec.passes.manager import pipeline_string, select

    if args.out is None and not args.print_after_all:
        print("moec debug: error: give --out DIR or --print-after-all", file=sys.stderr)
        return 2
    if args.out is not None and not args.print_after_all:
        writable_folder(args.out, "--out")
    plan = _load_plan(args.plan)
    model, inputs, kwargs = load_model(args.model)
    if not args.no_loss:
        model, inputs = with_next_token_loss(model, inputs, kwargs, args.model)
        kwargs = {}
    console = _console()
    names = select(plan, args.passes, args.disable)
    pass_pipeline = pipeline_string(plan, names)
    console.print(f"passes: {pass_pipeline}", markup=False, soft_wrap=True)
    dump = DebugDump(
        args.out,
        plan,
        pass_pipeline=pass_pipeline,
        print_after_all=args.print_after_all,
        console=console,
    )
    mesh = _debug_mesh(plan, args.ep_rank)
    compiled = moec.compile(
        model,
        plan,
        inputs,
        kwargs,
        dump=dump,
        mesh=mesh,
        passes=pass_pipeline,
        print_after=args.print_after,
    )
    dump.write_lowering(compiled, inputs)
    if args.out is None or args.print_after_all:
        return 0
    console.print(f"wrote {len(dump.stages)} stages to {args.out}", markup=False)
    lowered = dump.write_lowered(compiled, inputs, kwargs)
    if lowered is not None:
        console.print(f"wrote Inductor's trace of one step to {lowered}", markup=False)
    if mesh is not None:
        console.print("no repro.py: an expert-parallel program needs its process group")
    else:
        title = f"moec debug {args.model}" + (" --no-loss" if args.no_loss else "")
        script = dump.write_repro(compiled, inputs, kwargs, title)
        if script is not None:
            console.print(f"wrote {script} (python3 {script})", markup=False)
    return 0


def _debug_mesh(plan: Plan, ep_rank: int) -> SimpleNamespace | None:
    """Without a process group, show the graph EP rank ``ep_rank`` would run (it is not run)."""
    from moec.program import EPGroup

    if plan.parallel.ep == 1:
        return None
    if not 0 <= ep_rank < plan.parallel.ep:
        raise SystemExit(f"moec debug: --ep-rank {ep_rank} not in [0, {plan.parallel.ep})")
    return SimpleNamespace(ep_info=EPGroup(ep_rank, plan.parallel.ep, "moec-debug"))


def cmd_data_build(args: argparse.Namespace) -> int:
    import time

    from moec.corpus_build import BuildOptions, build_corpus

    options = flags.from_flags(BuildOptions, args)
    console, start = _console(), time.monotonic()

    def say(line: str) -> None:
        console.print(f"{time.monotonic() - start:7.1f} s  {line}", markup=False, soft_wrap=True)

    build_corpus(args.dir, options, force=args.force, say=say)
    console.print(f"train on it: moec train --data {args.dir} ...", markup=False)
    return 0


def _add_data_parser(sub: argparse._SubParsersAction) -> None:
    """``moec data build`` (:mod:`moec.corpus_build`)."""
    from moec.corpus_build import BuildOptions

    data = sub.add_parser("data", help="build training corpora")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    build = data_sub.add_parser(
        "build",
        help="a tokenized corpus, train and eval splits, from the text on this machine",
        description="Read the .py/.md/.rst/.txt files of the installed Python packages (or "
        "--source), split them train/eval by content hash, train a byte-level BPE tokenizer "
        "and write DIR/{train,eval}/tokens.bin, DIR/tokenizer.json and DIR/manifest.json "
        "(see moec.corpus_build); moec train --data DIR trains on it.",
    )
    build.add_argument("dir", metavar="DIR", help="the corpus folder (new or empty)")
    flags.add_flags(build, BuildOptions)
    build.add_argument(
        "--force",
        action="store_true",
        help="build into a folder that is not empty, replacing its corpus files",
    )
    build.set_defaults(func=cmd_data_build)


class HelpFormatter(argparse.HelpFormatter):
    """Help that shows each option's default, in the form the option takes
    (:func:`~moec.flags.shown_default`), unless its help already says it (``(default``)
    or there is none to show (None, a switch, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        shown = flags.shown_default(action.default) if action.option_strings else None
        if shown is None or action.default is argparse.SUPPRESS or "(default" in text:
            return action.help
        return f"{text} (default: {shown.replace('%', '%%')})".lstrip()


class Parser(argparse.ArgumentParser):
    """``moec``'s parsers (its subcommands' too): defaults shown in ``--help``."""

    def __init__(self, *args: typing.Any, **kwargs: typing.Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


MODEL_HELP = f"one of {', '.join(SHORT_NAMES)} or path/to/file.py:factory"


def build_parser() -> argparse.ArgumentParser:
    """The ``moec`` parser. Building it imports no torch (nor does ``--help``): each command's
    function is imported when it runs (:func:`~moec.lazy.lazy_command`)."""
    parser = Parser(
        prog="moec", description="Compile dense PyTorch models into MoE training programs."
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="print the traceback of an error, not just its line (anywhere on the line)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_plan_parser(sub)
    _add_inspect_parser(sub)
    _add_debug_parser(sub)
    _add_demo_parser(sub)
    _add_train_parser(sub)
    add_export_parser(sub)
    _add_data_parser(sub)
    _add_warmup_parser(sub)
    return parser


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    """``moec plan show`` and ``moec plan auto``."""
    plan = sub.add_parser("plan", help="work with plan files")
    plan_sub = plan.add_subparsers(dest="plan_command", required=True)
    show = plan_sub.add_parser("show", help="print the resolved plan and its pipeline string")
    show.add_argument("file", help="plan YAML file")
    show.add_argument("--model", help=f"also print the per-rank memory on {MODEL_HELP}")
    show.add_argument(
        "--batch",
        type=int,
        help="sequences per step per dp rank (with --model; default: moec train's, the plan's "
        f"parallel.microbatch_size x microbatches, else {DEFAULT_BATCH_SIZE})",
    )
    show.add_argument("--seq", type=int, default=128, help="sequence length (with --model)")
    show.add_argument("--gpu-memory", type=float, help="GiB per GPU to check the plan against")
    show.add_argument(
        "--world",
        type=int,
        help="GPUs of the job: sets parallel.dp = world / pp (a fully sharded plan, dp_shard = "
        "dp, stays fully sharded) and prints the layout",
    )
    show.set_defaults(func=cmd_plan_show)
    _add_plan_auto_parser(plan_sub)


def _add_plan_auto_parser(plan_sub: argparse._SubParsersAction) -> None:
    """``moec plan auto`` (:mod:`moec.autoplan.cli`)."""
    auto = plan_sub.add_parser(
        "auto", help="search parallelism, recompute, microbatching and precision for a model"
    )
    auto.add_argument("--model", required=True, help="zoo name or path/to/file.py:factory")
    auto.add_argument("--world", type=int, required=True, help="GPUs of the job")
    auto.add_argument("--gpu", required=True, help=f"one of {', '.join(sorted(GPUS))}")
    auto.add_argument(
        "--global-batch", type=int, default=2**20, help="tokens per optimizer step (job)"
    )
    auto.add_argument("--seq", type=int, default=4096, help="sequence length")
    auto.add_argument(
        "--plan",
        help="plan YAML whose moe/loss/lowering sections are kept (but lowering."
        "combine_in_experts, which the search chooses)",
    )
    auto.add_argument("--probe", help="JSON of measured GPU values replacing the datasheet's")
    auto.add_argument(
        "--probe-out", help="measure this machine's GPU first (CUDA) and write the JSON here"
    )
    auto.add_argument("--inter-node-gbps", type=float, help="network GB/s per GPU, one way")
    auto.add_argument(
        "--calibrate",
        metavar="RUN",
        help="fit the time model to a profiled step first: a run directory of moec train "
        "--profile (or its profile/ops_rank0.json), a profiler trace or a JSON list of samples",
    )
    auto.add_argument(
        "--efficiency", metavar="FILE", help="time model factors (JSON) to start from"
    )
    auto.add_argument(
        "--efficiency-out", metavar="FILE", help="write the factors the search used (JSON)"
    )
    auto.add_argument(
        "--memory-fraction", type=float, default=0.92, help="usable share of GPU memory"
    )
    auto.add_argument("--top", type=int, default=5, help="plans to print")
    auto.add_argument(
        "--min-micro-seqs",
        type=int,
        default=2,
        help="fewest sequences per microbatch (moec train captures at the microbatch and "
        "needs >= 2; 1 for a search on paper)",
    )
    auto.add_argument(
        "--pp", type=int, help="only plans of this pipeline degree (a divisor of --world)"
    )
    auto.add_argument("--out", help="write the chosen plan here (YAML)")
    auto.set_defaults(func=lazy_command("moec.autoplan.cli:cmd_plan_auto"))


def _add_inspect_parser(sub: argparse._SubParsersAction) -> None:
    inspect = sub.add_parser("inspect", help="list blocks and FFN regions with their costs")
    inspect.add_argument("model", help=MODEL_HELP)
    inspect.add_argument("--batch", type=int, help="evaluate costs at this batch size")
    inspect.add_argument("--seq", type=int, help="evaluate costs at this sequence length")
    inspect.set_defaults(func=cmd_inspect)


def _add_debug_parser(sub: argparse._SubParsersAction) -> None:
    debug = sub.add_parser("debug", help="compile and dump the graph after every pass")
    debug.add_argument("model", help=MODEL_HELP)
    debug.add_argument("--plan", help="plan YAML file (default: Plan())")
    debug.add_argument("--out", help="output directory")
    debug.add_argument(
        "--print-after-all", action="store_true", help="print to the terminal instead of files"
    )
    debug.add_argument(
        "--ep-rank", type=int, default=0, help="with parallel.ep > 1: the EP rank to show"
    )
    debug.add_argument(
        "--passes",
        help="the passes to run, as a pass-pipeline string ('moe,fused_loss' or what "
        "'moec plan show' prints; options in braces must match the plan); default: the plan's",
    )
    debug.add_argument(
        "--disable", action="append", default=[], metavar="PASS", help="skip this pass"
    )
    debug.add_argument(
        "--print-after",
        action="append",
        metavar="PASS",
        help="dump only after these passes ('capture' for the captured graph); default: all",
    )
    debug.add_argument(
        "--no-loss",
        action="store_true",
        help="compile the bare model, without the next-token loss moec train adds",
    )
    debug.set_defaults(func=cmd_debug)


def _add_demo_parser(sub: argparse._SubParsersAction) -> None:
    """``moec demo``: a few of ``moec train``'s flags (:data:`~moec.train.cli.DEMO_FLAGS`),
    defaulting to the demo's run."""
    demo = sub.add_parser("demo", help="compile the bundled Llama into an MoE and train it")
    add_flags(demo, DEMO_FLAGS, defaults=DEMO_CONFIG)
    demo.set_defaults(func=lazy_command("moec.train.cli:cli_demo"))


def _add_train_parser(sub: argparse._SubParsersAction) -> None:
    """``moec train``: MODEL and PLAN, then one flag per TrainConfig field
    (:func:`~moec.train.config.add_flags`)."""
    train = sub.add_parser("train", help="train a compiled model")
    train.add_argument("--model", default="llama", help=MODEL_HELP)
    train.add_argument("--plan", help="plan YAML file (default: Plan())")
    add_flags(train)
    train.set_defaults(func=lazy_command("moec.train.cli:cli_train"))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command ``argv``; a :class:`MoecError` becomes one line on stderr and its exit
    code (with its traceback under ``--debug``, which may stand anywhere on the line)."""
    words = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in words
    args = build_parser().parse_args([w for w in words if w != "--debug"])
    args.debug = debug
    try:
        return args.func(args)
    except MoecError as exc:
        if args.debug:
            traceback.print_exc(file=sys.stderr)
        print(f"moec: error: {one_line(str(exc))}", file=sys.stderr)
        return exc.exit_code
