"""Entry points: ``moec.train.train(model, plan, config)``, and the ``moec train`` / ``moec demo``
commands with their printed summary."""

from __future__ import annotations

import contextlib

import torch

from moec.plan import Plan
from moec.train.config import TrainConfig, resolve_device
from moec.train.loop import TrainResult
from moec.train.routing_health import busiest_share
from moec.train.trainer import Trainer


def train(
    model: torch.nn.Module,
    plan: Plan | dict | None,
    config: TrainConfig | None = None,
    *,
    show_progress: bool = False,
) -> TrainResult:
    """Compile ``model`` with ``plan`` and train it (see module)."""
    plan = Plan.from_dict(plan) if isinstance(plan, dict) else plan or Plan()
    cfg = config or TrainConfig()
    if not show_progress:
        return Trainer(model, plan, cfg).run()
    from moec.progress import training_progress

    with training_progress() as (progress, console):
        return Trainer(model, plan, cfg, console).run(progress)


DEMO_PLAN = {
    "moe": {
        "num_experts": 8,
        "top_k": 2,
        "init": "random",
        "expert_width": 256,
        "dense_first": 1,
        "capacity_factor": 1.25,
    },
}


def demo_model() -> torch.nn.Module:
    from moec.models import Llama, LlamaConfig

    return Llama(LlamaConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=512))


def cli_demo(args) -> int:
    """``moec demo``: the bundled dense Llama -> 8-expert top-2 MoE, trained on offline text."""
    device = resolve_device(args.device)
    plan = Plan.from_dict(DEMO_PLAN)
    if device.type == "cuda":
        plan.precision.compute_dtype = "bf16"
    cfg = TrainConfig(
        steps=args.steps or 200,
        batch_size=16,
        seq_len=128,
        lr=3e-3,
        warmup_steps=15,
        log_every=10,
        out=args.out,
        device=str(device),
        seed=args.seed,
        resume=args.resume,
        replan_schedule=args.replan_schedule,
        force=args.force,
    )
    torch.manual_seed(cfg.seed)  # the model's initialisation is part of the run
    return _train_and_report(demo_model(), plan, cfg)


def cli_train(args) -> int:
    """``moec train``: a model the CLI knows, a plan file, offline text, synthetic data or your
    own tokens (``--data``; a named model's vocabulary is that of the corpus ``moec data build``
    wrote, where ``--data`` is one)."""
    from moec.corpus import built_vocab, parse_spec
    from moec.models.zoo import load_model

    plan = Plan.load(args.plan) if args.plan else Plan()
    cfg = TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        log_every=args.log_every,
        checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints,
        on_checkpoint_error=args.on_checkpoint_error,
        on_router_collapse=args.on_router_collapse,
        out=args.out,
        seed=args.seed,
        device=args.device,
        synthetic=args.synthetic,
        resume=args.resume,
        replan_schedule=args.replan_schedule,
        force=args.force,
        init_from=args.init_from,
        max_nonfinite_steps=args.max_nonfinite_steps,
        memory_limit_gib=args.memory_limit_gib,
        data=args.data,
        data_dtype=args.data_dtype,
        tokenizer=args.tokenizer,
        text_column=args.text_column,
        prefetch=args.prefetch,
        batch_warmup=args.batch_warmup or (),
        spike_sigma=args.spike_sigma,
        spike_window=args.spike_window,
        spike_min_steps=args.spike_min_steps,
        z_loss=args.z_loss,
        no_decay=args.no_decay,
        profile=args.profile,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        eval_data=args.eval_data,
    )
    vocab = built_vocab(parse_spec(cfg.data, cfg.data_dtype)) if cfg.data else None
    torch.manual_seed(cfg.seed)  # the model's initialisation is part of the run
    # from a checkpoint or fresh, the model is built on shapes: each rank builds only its part
    with torch.device("meta") if cfg.init_from else contextlib.nullcontext():
        model = load_model(args.model, vocab_size=vocab)[0]
    return _train_and_report(model, plan, cfg)


def _train_and_report(model: torch.nn.Module, plan: Plan, cfg: TrainConfig) -> int:
    result = train(model, plan, cfg, show_progress=True)
    if not result.finished:
        print_summary(result)
    return 0


def print_summary(result: TrainResult) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    s = result.summary
    tokens = s["tokens_per_s_per_gpu"]
    console.print(
        f"[bold]{s['plan']}[/bold] on {s['device']}: loss {s['first_loss']:.3f} -> "
        f"{s['final_loss']:.3f} in {s['steps']} steps; "
        + (
            f"eval loss {s['eval_loss']:.3f} at step {s['eval_step']} (best "
            f"{s['best_eval_loss']:.3f} at step {s['best_eval_step']}; {s['eval_s']:.1f} s, not "
            "counted as step time); "
            if s.get("eval_loss") is not None and s.get("best_eval_loss") is not None
            else ""
        )
        + (f"{tokens:,.0f} tokens/s ({s['throughput_from']}); " if tokens else "")
        + (
            f"checkpoint writes {s['checkpoint_s']:.1f} s (not counted as step time); "
            if s.get("checkpoint_s")
            else ""
        )
        + (f"{s['skipped_steps']} non-finite steps skipped; " if s["skipped_steps"] else "")
        + (
            f"{s['spike_skipped_steps']} loss or gradient-norm spikes skipped; "
            if s.get("spike_skipped_steps")
            else ""
        )
        + f"{s['active_params']:,} of {s['params']:,} parameters active per token"
    )
    stats = result.routing
    if stats:
        table = Table(
            "MoE block",
            "drop rate",
            "load max/mean",
            "top-k share",
            "capacity use",
            "LBL",
            "MaxVio (step)",
        )
        for path, st in stats.items():
            load, k = st["expert_load"], st["top_k"]
            vio = st["max_vio"]
            table.add_row(
                path,
                f"{100 * st['drop_rate']:.1f}%",
                f"{st['load_imbalance']:.2f}",
                f"{100 * busiest_share(load, k):.0f}% ({100 * k / len(load):.0f}%)",
                f"{100 * st['capacity_use']:.0f}%",
                f"{st['lbl']:.3f}",
                "-" if vio is None else f"{vio:.2f}",
            )
        console.print(table)
    names = ", ".join(str(p.relative_to(result.out)) for p in result.written)
    console.print(f"wrote in {result.out}: {names}", markup=False, highlight=False)
    if not any(p.suffix == ".png" for p in result.written) and result.written:
        console.print("no plots: they need matplotlib (pip install matplotlib)", markup=False)
