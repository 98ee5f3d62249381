"""Entry points: ``moec.train.train(model, plan, config)``, and the ``moec train`` / ``moec demo``
commands with their printed summary."""

from __future__ import annotations

import contextlib
import typing

from moec.plan import Plan
from moec.train.config import TrainConfig, from_flags, resolve_device

if typing.TYPE_CHECKING:  # torch is imported where a command runs: moec --help needs none
    import torch

    from moec.train.loop import TrainResult


def train(
    model: torch.nn.Module,
    plan: Plan | dict | None,
    config: TrainConfig | None = None,
    *,
    show_progress: bool = False,
) -> TrainResult:
    """Compile ``model`` with ``plan`` and train it (see module)."""
    from moec.train.trainer import Trainer

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


DEMO_CONFIG = {
    "steps": 200,
    "batch_size": 16,
    "seq_len": 128,
    "lr": 3e-3,
    "warmup_steps": 15,
    "log_every": 10,
    "out": "runs/demo",
}
"""``moec demo``'s run: its flags (:data:`DEMO_FLAGS`) default to these, the rest is fixed."""
DEMO_FLAGS = ("steps", "device", "out", "seed", "resume", "replan_schedule", "force")


def cli_demo(args) -> int:
    """``moec demo``: the bundled dense Llama -> 8-expert top-2 MoE, trained on offline text."""
    import dataclasses

    import torch

    cfg = from_flags(args, **DEMO_CONFIG)
    device = resolve_device(cfg.device)
    cfg = dataclasses.replace(cfg, device=str(device))
    plan = Plan.from_dict(DEMO_PLAN)
    if device.type == "cuda":
        plan.precision.compute_dtype = "bf16"
    torch.manual_seed(cfg.seed)  # the model's initialisation is part of the run
    return _train_and_report(demo_model(), plan, cfg)


def cli_train(args) -> int:
    """``moec train``: a model the CLI knows, a plan file, offline text, synthetic data or your
    own tokens (``--data``; a named model's vocabulary is that of the corpus ``moec data build``
    wrote, where ``--data`` is one)."""
    import torch

    from moec.corpus import built_vocab, parse_spec
    from moec.models.zoo import load_model

    plan = Plan.load(args.plan) if args.plan else Plan()
    cfg = from_flags(args)
    vocab = built_vocab(parse_spec(cfg.data, cfg.data_dtype)) if cfg.data else None
    torch.manual_seed(cfg.seed)  # the model's initialisation is part of the run
    # from a checkpoint or fresh, the model is built on shapes: each rank builds only its part
    with torch.device("meta") if cfg.init_from else contextlib.nullcontext():
        model = load_model(args.model, vocab_size=vocab)[0]
    return _train_and_report(model, plan, cfg)


def _train_and_report(model: torch.nn.Module, plan: Plan, cfg: TrainConfig) -> int:
    from moec.train.summary import print_summary

    result = train(model, plan, cfg, show_progress=True)
    if not result.finished:
        print_summary(result, plots=cfg.plots)
    return 0
