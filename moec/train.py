"""Training a compiled model: ``moec.train(model, plan, config)``, ``moec train``, ``moec demo``.

One optimizer step = ``plan.parallel.microbatches`` forward/backward passes (gradient
accumulation), gradient clipping, AdamW (:class:`moec.optim.AdamW`, which also writes the
program's bf16 working weights) with separate dense and expert parameter groups (no weight
decay on embeddings, norms and biases), a warmup-stable-decay learning rate. The step
itself never reads the device: losses and routing statistics stay on the device and are read
every ``log_every`` steps, which is also where step time is measured.

Outputs under ``out``: ``metrics.jsonl`` (one line per log step), ``summary.json``, PNG plots
(loss, throughput, per-layer expert-load heatmap; needs matplotlib) and ``checkpoints/step_N``
written by :mod:`moec.runtime.checkpoint` (DCP; loadable at any EP degree). ``resume=True``
continues from the newest checkpoint and reproduces the uninterrupted run's losses bit for bit
(same data order, RNG, optimizer and scheduler state).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moec.analysis.cost import graph_cost
from moec.data import TextBatches
from moec.optim import AdamW
from moec.plan import Plan, PlanError
from moec.runtime import checkpoint
from moec.runtime.compiled import CompiledModel, compile
from moec.runtime.distributed import (
    GradientReducer,
    MoEMesh,
    clip_gradients_,
    global_grad_norm,
    init_from_env,
)
from moec.runtime.distributed import parameter_groups as dist_parameter_groups
from moec.runtime.metrics import bf16_peak_tflops, count_host_syncs, useful_mfu


@dataclasses.dataclass
class TrainConfig:
    steps: int = 200
    batch_size: int = 16
    """Sequences per optimizer step (split into plan.parallel.microbatches)."""
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    """Final LR of the decay phase, as a fraction of ``lr``."""
    warmup_steps: int = 20
    decay_fraction: float = 0.2
    """Share of the steps spent in the final linear decay (WSD schedule)."""
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    log_every: int = 10
    checkpoint_every: int = 0
    """0: checkpoint only at the end."""
    warmup_log_steps: int = 2
    """Steps excluded from steady-state timing (capture, first-iteration allocations)."""
    out: str = "runs/train"
    seed: int = 0
    device: str = "auto"
    synthetic: bool = False
    resume: bool = False
    plots: bool = True


@dataclasses.dataclass
class TrainResult:
    losses: list[float]
    """Loss of every step (read at log points, so available for every step)."""
    summary: dict[str, Any]
    compiled: CompiledModel
    out: Path


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def language_model_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    logits = output.logits if hasattr(output, "logits") else output
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class LanguageModelWithLoss(torch.nn.Module):
    """``model(inputs)`` and its next-token loss as one module: the loss is then part of the
    captured graph, where the ``fused_loss`` pass can fuse it with the LM head."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return language_model_loss(self.model(inputs), targets)


def parameter_groups(compiled: CompiledModel, weight_decay: float) -> list[dict[str, Any]]:
    """Dense and expert groups, each split into decayed matrices and undecayed
    embeddings/norms/biases."""
    gm = compiled.graph_module
    roles = gm.meta.get("moec_param_roles", {})
    embeddings = {
        str(n.args[0].target)
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target == torch.ops.aten.embedding.default
    }
    groups: dict[tuple[str, bool], list[torch.nn.Parameter]] = {}
    for name, param in gm.named_parameters():
        if not param.requires_grad:
            continue
        kind = "expert" if roles.get(name) == "expert" else "dense"
        decay = param.dim() >= 2 and name not in embeddings
        groups.setdefault((kind, decay), []).append(param)
    return [
        {
            "name": f"{kind}{'' if decay else '_no_decay'}",
            "params": params,
            "weight_decay": weight_decay if decay else 0.0,
        }
        for (kind, decay), params in sorted(groups.items())
    ]


def wsd_schedule(cfg: TrainConfig):
    decay_steps = max(1, int(cfg.steps * cfg.decay_fraction))
    decay_start = cfg.steps - decay_steps

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if step < decay_start:
            return 1.0
        progress = (step - decay_start) / decay_steps
        return 1.0 - (1.0 - cfg.min_lr_ratio) * min(progress, 1.0)

    return factor


class Trainer:
    def __init__(self, model: torch.nn.Module, plan: Plan, cfg: TrainConfig, console=None):
        self.plan, self.cfg = plan, cfg
        self.mesh = join_job(plan)
        self.rank = dist.get_rank() if self.mesh else 0
        self.device = resolve_device(cfg.device)
        self.out = Path(cfg.out)
        self.out.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.seed)
        vocab = getattr(getattr(model, "cfg", None), "vocab_size", None) or getattr(
            getattr(model, "config", None), "vocab_size", 256
        )
        # every data-parallel rank reads its own batches (same model init on every rank)
        data_seed = cfg.seed + 7919 * self.rank
        self.data = TextBatches(cfg.batch_size, cfg.seq_len, data_seed, cfg.synthetic, vocab)
        micro = plan.parallel.microbatches
        if cfg.batch_size % micro:
            raise ValueError(
                f"batch_size={cfg.batch_size} must be divisible by parallel.microbatches={micro}"
            )
        model = model.to(self.device)
        example = tuple(t[: cfg.batch_size // micro].to(self.device) for t in self.data.batch(0))
        self.compiled = compile(LanguageModelWithLoss(model), plan, example, mesh=self.mesh)
        self.reducer = GradientReducer(self.compiled, self.mesh) if self.mesh else None
        self.optimizer = AdamW(
            parameter_groups(self.compiled, cfg.weight_decay),
            lr=cfg.lr,
            betas=cfg.betas,
            working_weights=self.compiled.working_weights,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, wsd_schedule(cfg))
        self.step = 0
        cost = graph_cost(self.compiled.graph_module).evaluate()
        self.train_flops_per_token = cost.train_flops_per_token
        self.params, self.active_params = cost.params, cost.active_params
        self.console = console

    # --- one optimizer step (no host reads) ----------------------------------------------------

    def train_step(self) -> torch.Tensor:
        inputs, targets = (_to_device(t, self.device) for t in self.data.batch(self.step))
        micro = self.plan.parallel.microbatches
        total = torch.zeros((), device=self.device)
        pairs = list(zip(inputs.chunk(micro), targets.chunk(micro), strict=True))
        for i, (x, y) in enumerate(pairs):
            local = self.reducer is not None and i < len(pairs) - 1
            with self.reducer.no_sync() if local else contextlib.nullcontext():
                loss = self.compiled(x, y)
                has_moe = bool(self.compiled.moe_layers)
                objective = loss + self.compiled.aux_loss() if has_moe else loss
                (objective / micro).backward()
            total = total + loss.detach() / micro
        if self.reducer is not None:
            self.reducer.finish()
        self._clip_gradients()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        return total

    def _clip_gradients(self) -> None:
        """Clip by the global norm (over the EP group's experts under EP; see
        :func:`~moec.runtime.distributed.global_grad_norm`)."""
        dense, expert = dist_parameter_groups(self.compiled)
        ep_group = self.mesh.ep_group if self.mesh else None
        norm = global_grad_norm(dense, expert, self.device, ep_group)
        clip_gradients_(dense + expert, norm, self.cfg.grad_clip, self.optimizer)

    # --- checkpoints ---------------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        path = self.out / "checkpoints" / f"step_{self.step}"
        checkpoint.save(self.compiled, self.optimizer, path, self.mesh)
        extra = {
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),
            "cpu_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if self.device.type == "cuda" else None,
        }
        torch.save(extra, path / self._trainer_file)
        return path

    @property
    def _trainer_file(self) -> str:
        """Step, scheduler and RNG state: one file, or one per rank in a job."""
        return f"trainer_rank{self.rank}.pt" if self.mesh else "trainer.pt"

    def load_latest_checkpoint(self) -> bool:
        root = self.out / "checkpoints"
        steps = (
            sorted(
                (
                    int(p.name.removeprefix("step_"))
                    for p in root.glob("step_*")
                    if (p / self._trainer_file).exists()
                ),
            )
            if root.exists()
            else []
        )
        if not steps:
            return False
        path = root / f"step_{steps[-1]}"
        checkpoint.load(self.compiled, self.optimizer, path, self.mesh)
        extra = torch.load(path / self._trainer_file, weights_only=False)
        self.step = extra["step"]
        self.scheduler.load_state_dict(extra["scheduler"])
        torch.set_rng_state(extra["cpu_rng"])
        if extra["cuda_rng"] is not None:
            torch.cuda.set_rng_state_all(extra["cuda_rng"])
        return True

    # --- the loop ------------------------------------------------------------------------------

    def run(self, progress=None) -> TrainResult:
        cfg = self.cfg
        if cfg.resume and self.load_latest_checkpoint() and self.console:
            self.console.print(f"resumed from step {self.step}")
        writer = self.rank == 0  # in a job, rank 0 writes the logs, summary and plots
        log_path = self.out / ("metrics.jsonl" if writer else f"metrics_rank{self.rank}.jsonl")
        log = log_path.open("a" if cfg.resume else "w")
        pending: list[torch.Tensor] = []
        losses: list[float] = []
        tokens_per_step = cfg.batch_size * cfg.seq_len
        history: list[dict[str, Any]] = []
        steady_start = None
        steady_steps = 0
        window_start, window_steps = time.perf_counter(), 0
        syncs = None
        task = (
            progress.add_task("training", total=cfg.steps, completed=self.step)
            if progress
            else None
        )
        while self.step < cfg.steps:
            if self.step == cfg.warmup_log_steps and syncs is None:
                syncs = count_host_syncs(lambda: pending.append(self.train_step()), self.device)
            else:
                pending.append(self.train_step())
            window_steps += 1
            if self.step == cfg.warmup_log_steps:
                _wait(self.device)
                steady_start, steady_steps = time.perf_counter(), 0
            elif steady_start is not None:
                steady_steps += 1
            done = self.step == cfg.steps
            if self.step % cfg.log_every == 0 or done:
                values = torch.stack(pending).tolist()  # the one host read per log window
                losses += values
                pending.clear()
                now = time.perf_counter()
                step_time = (now - window_start) / window_steps
                window_start, window_steps = now, 0
                record = self._record(values[-1], step_time, tokens_per_step, syncs)
                history.append(record)
                log.write(json.dumps(record) + "\n")
                log.flush()
                if progress:
                    progress.update(task, completed=self.step, **_progress_fields(record))
            if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0 and not done:
                self.save_checkpoint()
        log.close()
        self.save_checkpoint()
        steady = None
        if steady_start is not None and steady_steps > 0:
            _wait(self.device)
            steady = (time.perf_counter() - steady_start) / steady_steps
        summary = self._summary(losses, steady, tokens_per_step, syncs)
        if writer:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        if cfg.plots and writer:
            from moec.plots import write_plots

            write_plots(self.out, history, self.compiled.routing_stats())
        return TrainResult(losses, summary, self.compiled, self.out)

    def _record(
        self, loss: float, step_time: float, tokens: int, syncs: int | None
    ) -> dict[str, Any]:
        routing = self.compiled.routing_stats() if self.compiled.moe_layers else {}
        layers = list(routing.values())
        peak = bf16_peak_tflops(self.device)
        mfu = useful_mfu(self.train_flops_per_token * tokens, step_time, 1, peak)
        return {
            "step": self.step,
            "loss": loss,
            "lr": self.scheduler.get_last_lr()[0],
            "step_time_s": step_time,
            "tokens_per_s_per_gpu": tokens / step_time,
            "useful_mfu": mfu,
            "drop_rate": _mean(layer["drop_rate"] for layer in layers),
            "load_imbalance": max((layer["load_imbalance"] for layer in layers), default=None),
            "capacity_use": _mean(layer["capacity_use"] for layer in layers),
            "lbl": _mean(layer["lbl"] for layer in layers),
            "host_syncs_per_step": syncs,
            "peak_memory_bytes": torch.cuda.max_memory_allocated(self.device)
            if self.device.type == "cuda"
            else None,
            "routing": {path: {k: v for k, v in s.items()} for path, s in routing.items()},
        }

    def _summary(
        self, losses: list[float], steady: float | None, tokens: int, syncs: int | None
    ) -> dict[str, Any]:
        peak = bf16_peak_tflops(self.device)
        return {
            "plan": self.plan.pipeline_string(),
            "device": torch.cuda.get_device_name(self.device)
            if self.device.type == "cuda"
            else "cpu",
            "steps": self.step,
            "first_loss": losses[0] if losses else None,
            "final_loss": losses[-1] if losses else None,
            "steady_step_time_s": steady,
            "tokens_per_s_per_gpu": tokens / steady if steady else None,
            "useful_mfu": useful_mfu(self.train_flops_per_token * tokens, steady or 0, 1, peak),
            "bf16_peak_tflops": peak if peak else "unknown for this device",
            "train_flops_per_token": self.train_flops_per_token,
            "params": self.params,
            "active_params": self.active_params,
            "host_syncs_per_step": syncs,
        }


def join_job(plan: Plan) -> MoEMesh | None:
    """The (edp, ep) mesh when ``plan`` is data/expert parallel (under torchrun), else None."""
    p = plan.parallel
    if p.pp > 1:
        raise PlanError(
            "parallel.pp",
            p.pp,
            "1 for the Trainer; pipelined programs train through "
            "CompiledModel.train_step (moec.runtime.pipeline)",
        )
    if p.dp == 1 and p.ep == 1:
        return None
    return init_from_env(plan)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host batch -> device without blocking the host (pinned memory, async copy)."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _wait(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def _progress_fields(record: dict[str, Any]) -> dict[str, str]:
    drop = record["drop_rate"]
    return {
        "loss": f"{record['loss']:.3f}",
        "tps": f"{record['tokens_per_s_per_gpu']:,.0f}",
        "drop": "-" if drop is None else f"{100 * drop:.1f}%",
        "imb": "-" if record["load_imbalance"] is None else f"{record['load_imbalance']:.2f}",
    }


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
    steps = args.steps or 200
    cfg = TrainConfig(
        steps=steps,
        batch_size=16,
        seq_len=128,
        lr=3e-3,
        warmup_steps=15,
        log_every=10,
        out=args.out,
        device=str(device),
    )
    result = train(demo_model(), plan, cfg, show_progress=True)
    _print_summary(result)
    return 0


def cli_train(args) -> int:
    """``moec train``: a model the CLI knows, a plan file, offline text or synthetic data."""
    from moec.models.zoo import load_model

    loaded = load_model(args.model)
    plan = Plan.load(args.plan) if args.plan else Plan()
    cfg = TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        log_every=args.log_every,
        checkpoint_every=args.checkpoint_every,
        out=args.out,
        device=args.device,
        synthetic=args.synthetic,
        resume=args.resume,
    )
    result = train(loaded[0], plan, cfg, show_progress=True)
    _print_summary(result)
    return 0


def _print_summary(result: TrainResult) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    s = result.summary
    console.print(
        f"[bold]{s['plan']}[/bold] on {s['device']}: loss {s['first_loss']:.3f} -> "
        f"{s['final_loss']:.3f} in {s['steps']} steps; "
        f"{s['tokens_per_s_per_gpu'] or 0:,.0f} tokens/s; "
        f"{s['active_params']:,} of {s['params']:,} parameters active per token"
    )
    stats = result.compiled.routing_stats()
    if stats:
        table = Table("MoE block", "drop rate", "load max/mean", "capacity use", "LBL")
        for path, st in stats.items():
            table.add_row(
                path,
                f"{100 * st['drop_rate']:.1f}%",
                f"{st['load_imbalance']:.2f}",
                f"{100 * st['capacity_use']:.0f}%",
                f"{st['lbl']:.3f}",
            )
        console.print(table)
    console.print(f"logs, plots and checkpoint in {result.out}")
