"""Training a compiled model: ``moec.train(model, plan, config)``, ``moec train``, ``moec demo``.

One optimizer step = ``plan.parallel.microbatches`` forward/backward passes (gradient
accumulation), gradient clipping, AdamW (:class:`moec.optim.AdamW`, which also writes the
program's bf16 working weights) with separate dense and expert parameter groups (no weight
decay on embeddings, norms and biases), a warmup-stable-decay learning rate. The step
itself never reads the device: losses, routing statistics and the non-finite counters stay on
the device and are read every ``log_every`` steps, which is also where step time is measured.

Non-finite steps: a step whose loss or global gradient norm is not finite is skipped on the
device (AdamW's ``found_inf``: parameters, moments and step counters keep their values) and
counted (``skipped_steps`` in the metrics); ``max_nonfinite_steps`` consecutive ones stop the
run with :class:`NonFiniteError` at the next log point.

Outputs under ``out``: ``run.json`` (the run's identity, :mod:`moec.runtime.run_identity`),
``metrics.jsonl`` (one line per log step), ``summary.json``, PNG plots (loss, throughput,
per-layer expert-load heatmap; need matplotlib) and ``checkpoints/step_N``, committed
atomically by :mod:`moec.runtime.checkpoint_store` (DCP shards loadable at any EP degree, a
manifest with checksums; the newest ``keep_checkpoints`` kept). ``resume=True`` continues the
same run from its newest checkpoint that verifies and reproduces the uninterrupted run bit for
bit (same data order, RNG, optimizer and scheduler state); its ``metrics.jsonl`` continues
from the checkpoint's step and its summary and plots cover the whole run. A resumed run that
has already reached ``steps`` writes nothing. A checkpoint that cannot be written stops the
run (``on_checkpoint_error="stop"``, after writing ``summary.json``) or is reported and
skipped (``"continue"``); whether checkpoints fit on the disk is checked before the first step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moec.analysis.cost import graph_cost
from moec.compiler import compile
from moec.data import TextBatches
from moec.errors import MoecError
from moec.optim import AdamW
from moec.plan import Plan, PlanError
from moec.runtime import checkpoint, run_identity
from moec.runtime.checkpoint_store import (
    CheckpointSpaceError,
    CheckpointStore,
    CheckpointWriteError,
    Committed,
)
from moec.runtime.compiled import CompiledModel
from moec.runtime.distributed import (
    GradientReducer,
    MoEMesh,
    clip_gradients_,
    global_grad_norm,
    init_from_env,
)
from moec.runtime.distributed import parameter_groups as dist_parameter_groups
from moec.runtime.metrics import bf16_peak_tflops, count_host_syncs, useful_mfu

CHECKPOINT_ERROR_POLICIES = ("stop", "continue")


class TrainConfigError(MoecError):
    """A TrainConfig field (a ``moec train`` flag) out of its accepted range."""


class NonFiniteError(MoecError):
    """Too many consecutive steps with a non-finite loss or gradient norm."""


class CheckpointLoadError(MoecError):
    """A resume whose checkpoints do not verify or do not load into this program."""


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
    keep_checkpoints: int = 3
    """Committed checkpoints kept on disk (the newest ones)."""
    on_checkpoint_error: str = "stop"
    """``stop``: a checkpoint that cannot be written (or is predicted not to fit) ends the run
    after writing its summary; ``continue``: it is reported and training goes on."""
    max_nonfinite_steps: int = 5
    """Consecutive skipped (non-finite) steps that stop the run."""
    warmup_log_steps: int = 2
    """Steps excluded from steady-state timing (capture, first-iteration allocations)."""
    out: str = "runs/train"
    seed: int = 0
    device: str = "auto"
    synthetic: bool = False
    resume: bool = False
    force: bool = False
    """Resume a run whose identity differs, or start a new run over another run's checkpoints
    (which it removes)."""
    plots: bool = True

    def __post_init__(self) -> None:
        at_least = {
            "steps": 1,
            "batch_size": 1,
            "seq_len": 2,
            "log_every": 1,
            "checkpoint_every": 0,
            "keep_checkpoints": 1,
            "max_nonfinite_steps": 1,
            "warmup_log_steps": 0,
        }
        for name, minimum in at_least.items():
            value = getattr(self, name)
            if not isinstance(value, int) or value < minimum:
                raise TrainConfigError(
                    f"{_flag(name)} = {value!r}: must be an integer >= {minimum}"
                )
        if self.on_checkpoint_error not in CHECKPOINT_ERROR_POLICIES:
            raise TrainConfigError(
                f"{_flag('on_checkpoint_error')} = {self.on_checkpoint_error!r}: must be one of "
                f"{', '.join(CHECKPOINT_ERROR_POLICIES)}"
            )
        resolve_device(self.device)


_CLI_FIELDS = frozenset(
    "steps batch_size seq_len log_every checkpoint_every keep_checkpoints on_checkpoint_error "
    "device seed".split()
)
"""TrainConfig fields that ``moec train`` sets from a flag of the same name."""


def _flag(field: str) -> str:
    """A TrainConfig field, with the ``moec train`` flag that sets it where there is one."""
    flag = f" (--{field.replace('_', '-')})" if field in _CLI_FIELDS else ""
    return f"TrainConfig.{field}{flag}"


@dataclasses.dataclass
class TrainResult:
    losses: list[float]
    """Loss of every step this call ran (read at log points, so available for every step)."""
    summary: dict[str, Any]
    compiled: CompiledModel
    out: Path
    written: list[Path] = dataclasses.field(default_factory=list)
    """The files and checkpoints this call wrote."""
    finished: bool = False
    """The run had already reached ``steps``: nothing was trained or written."""


def resolve_device(name: str) -> torch.device:
    """``auto`` (CUDA where available), ``cpu``, ``cuda`` or ``cuda:N``; a device this machine
    does not have is a :class:`TrainConfigError`."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise TrainConfigError(
            f"{_flag('device')} = {name!r}: not a device name; use auto, cpu or cuda"
        ) from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrainConfigError(
            f"{_flag('device')} = {name!r}: CUDA is not available on this machine; use "
            "--device cpu (or auto)"
        )
    if device.type not in ("cpu", "cuda"):
        raise TrainConfigError(f"{_flag('device')} = {name!r}: use auto, cpu or cuda")
    return device


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
    """The optimizer's groups: the dense and expert parameters
    (:func:`moec.runtime.distributed.parameter_groups`), each split into decayed matrices and
    undecayed embeddings/norms/biases."""
    gm = compiled.graph_module
    embeddings = {
        id(gm.get_parameter(str(n.args[0].target)))
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target == torch.ops.aten.embedding.default
    }
    groups: dict[tuple[str, bool], list[torch.nn.Parameter]] = {}
    for kind, params in zip(("dense", "expert"), dist_parameter_groups(compiled), strict=True):
        for param in params:
            decay = param.dim() >= 2 and id(param) not in embeddings
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
        self.console = console
        self.mesh = join_job(plan)
        self.rank = dist.get_rank() if self.mesh else 0
        self.device = resolve_device(cfg.device)
        self.out = Path(cfg.out)
        self.out.mkdir(parents=True, exist_ok=True)
        vocab = model_vocab(model)
        # every data-parallel rank reads its own batches (same model init on every rank)
        data_seed = cfg.seed + 7919 * self.rank
        self.data = TextBatches(cfg.batch_size, cfg.seq_len, data_seed, cfg.synthetic, vocab)
        self.identity = run_identity.run_identity(
            model,
            plan,
            batch_size=cfg.batch_size,
            seq_len=cfg.seq_len,
            synthetic=cfg.synthetic,
            vocab=vocab,
            seed=cfg.seed,
        )
        run_identity.check_run_dir(self.out, self.identity, resume=cfg.resume, force=cfg.force)
        torch.manual_seed(cfg.seed)
        micro = plan.parallel.microbatches
        if cfg.batch_size % micro:
            raise TrainConfigError(
                f"{_flag('batch_size')} = {cfg.batch_size}: must be divisible by "
                f"parallel.microbatches = {micro}"
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
            device_step=True,  # a non-finite step is skipped on the device
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, wsd_schedule(cfg))
        self.step = 0
        cost = graph_cost(self.compiled.program).evaluate()
        self.train_flops_per_token = cost.train_flops_per_token
        self.params, self.active_params = cost.params, cost.active_params
        self.store = CheckpointStore(
            self.out / run_identity.CHECKPOINTS,
            cfg.keep_checkpoints,
            distributed=self.mesh is not None,
            device=self.device,
            report=self._say,
        )
        # device-side run state, read at log points and saved with every checkpoint
        self.first_loss: torch.Tensor | None = None
        self.skipped_steps = torch.zeros((), dtype=torch.int64, device=self.device)
        self.nonfinite_streak = torch.zeros((), dtype=torch.int64, device=self.device)
        self.longest_streak = torch.zeros((), dtype=torch.int64, device=self.device)
        self.checkpoint_errors: list[str] = []

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
        norm = self._clip_gradients()
        nonfinite = self._nonfinite(total, norm)
        self.optimizer.found_inf = nonfinite.float()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self._count_nonfinite(nonfinite)
        self.step += 1
        if self.first_loss is None:
            self.first_loss = total
        return total

    def _clip_gradients(self) -> torch.Tensor:
        """Clip by the global norm (over the EP group's experts under EP; see
        :func:`~moec.runtime.distributed.global_grad_norm`) and return that norm."""
        dense, expert = dist_parameter_groups(self.compiled)
        ep_group = self.mesh.ep_group if self.mesh else None
        norm = global_grad_norm(dense, expert, self.device, ep_group)
        clip_gradients_(dense + expert, norm, self.cfg.grad_clip, self.optimizer)
        return norm

    def _nonfinite(self, loss: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        """Whether this step is skipped. In a job only the global gradient norm decides: it is
        the same on every rank (this rank's loss is not), and a non-finite loss anywhere makes
        it non-finite."""
        finite = torch.isfinite(norm)
        if self.mesh is None:
            finite = finite & torch.isfinite(loss)
        return ~finite

    def _count_nonfinite(self, nonfinite: torch.Tensor) -> None:
        self.skipped_steps += nonfinite
        self.nonfinite_streak = (self.nonfinite_streak + 1) * nonfinite
        self.longest_streak = torch.maximum(self.longest_streak, self.nonfinite_streak)

    # --- checkpoints ---------------------------------------------------------------------------

    def save_checkpoint(self) -> Committed | None:
        """Commit a checkpoint of this step; with ``on_checkpoint_error="continue"`` a failed
        write is reported and None returned."""
        try:
            return self.store.commit(self.step, self._write_checkpoint)
        except CheckpointWriteError as exc:
            if self.cfg.on_checkpoint_error == "stop":
                raise
            self.checkpoint_errors.append(str(exc))
            self._say(f"warning: {exc} (on_checkpoint_error: continue, so training goes on)")
            return None

    def _write_checkpoint(self, path: Path) -> None:
        checkpoint.save(self.compiled, self.optimizer, path, self.mesh)
        extra = {
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),
            "cpu_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if self.device.type == "cuda" else None,
            "first_loss": None if self.first_loss is None else self.first_loss.cpu(),
            "skipped_steps": self.skipped_steps.cpu(),
            "nonfinite_streak": self.nonfinite_streak.cpu(),
            "longest_streak": self.longest_streak.cpu(),
        }
        torch.save(extra, path / self._trainer_file)

    @property
    def _trainer_file(self) -> str:
        """Step, scheduler, RNG and run state: one file, or one per rank in a job."""
        return f"trainer_rank{self.rank}.pt" if self.mesh else "trainer.pt"

    def _load_checkpoint(self, committed: Committed) -> None:
        path = committed.path
        try:
            checkpoint.load(self.compiled, self.optimizer, path, self.mesh)
            extra = torch.load(path / self._trainer_file, weights_only=False)
        except Exception as exc:  # the files match their manifest: the program does not
            raise CheckpointLoadError(
                f"checkpoint {path} matches its manifest but does not load into this program "
                f"({type(exc).__name__}: {exc}); it was written by another model or moec "
                "version: start a new run (another --out)"
            ) from exc
        self.step = extra["step"]
        self.scheduler.load_state_dict(extra["scheduler"])
        torch.set_rng_state(extra["cpu_rng"])
        if extra["cuda_rng"] is not None:
            torch.cuda.set_rng_state_all(extra["cuda_rng"])
        first = extra.get("first_loss")
        self.first_loss = None if first is None else first.to(self.device)
        for name in ("skipped_steps", "nonfinite_streak", "longest_streak"):
            if name in extra:
                setattr(self, name, extra[name].to(self.device))

    # --- the run directory ---------------------------------------------------------------------

    def _prepare_out(self) -> Committed | None:
        """Record the run's identity (a new run over checkpoints with ``force``: remove them)
        and return the checkpoint to resume from, if any."""
        cfg = self.cfg
        resume_from = self.store.newest_verified() if cfg.resume else None
        if cfg.resume and resume_from is None:
            if (self.store.committed() or self.store.uncommitted()) and not cfg.force:
                raise CheckpointLoadError(
                    f"--resume: no checkpoint in {self.store.root} matches its manifest (the "
                    "reasons are above): restore one, or start over with --force"
                )
            self._say(f"nothing to resume in {self.out}: starting at step 0")
        if self.rank == 0:
            if not cfg.resume and cfg.force:
                shutil.rmtree(self.out / run_identity.CHECKPOINTS, ignore_errors=True)
            if not cfg.resume or cfg.force or run_identity.read(self.out) is None:
                run_identity.record(self.out, self.identity)
        if self.mesh is not None:
            dist.barrier()
        return resume_from

    def _check_space(self) -> None:
        problem = self.store.space_problem(self._checkpoint_bytes())
        if problem is None:
            return
        message, none_fits = problem
        if none_fits and self.cfg.on_checkpoint_error == "stop":
            raise CheckpointSpaceError(
                f"{message}: not even one checkpoint fits. Free space, write to another --out, "
                "or set on_checkpoint_error: continue (--on-checkpoint-error continue) to "
                "train without checkpoints"
            )
        self._say(f"warning: {message}")

    def _checkpoint_bytes(self) -> int:
        """Predicted size of one checkpoint: every parameter in its global shape (experts of
        all EP ranks), with AdamW's two moments for the trained ones."""
        program = self.compiled.program
        ep = self.mesh.ep_info.size if self.mesh else 1
        total = 0
        for name, param in program.graph.named_parameters():
            copies = ep if program.role(name) == "expert" else 1
            tensors = 3 if param.requires_grad else 1
            total += param.numel() * param.element_size() * copies * tensors
        return total

    def _metrics_history(self, path: Path) -> list[dict[str, Any]]:
        """The records of ``path`` up to this step (a resumed run rewrites the file without
        the steps after its checkpoint, and without a line cut short by a crash)."""
        if not path.exists():
            return []
        kept = []
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("step", self.step + 1) <= self.step:
                kept.append(record)
        partial = path.with_name(path.name + ".partial")
        partial.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(partial, path)
        return kept

    def _say(self, message: str) -> None:
        if self.rank != 0:
            return
        if self.console is not None:
            self.console.print(message, markup=False, highlight=False)
        else:
            print(message, file=sys.stderr)

    # --- the loop ------------------------------------------------------------------------------

    def run(self, progress=None) -> TrainResult:
        cfg = self.cfg
        resume_from = self._prepare_out()
        if resume_from is not None and resume_from.step >= cfg.steps:
            self._say(
                f"the run in {self.out} is finished ({resume_from.path.name} of "
                f"{cfg.steps} steps): nothing to do"
            )
            summary = self._recorded_summary()
            return TrainResult([], summary, self.compiled, self.out, finished=True)
        if resume_from is not None:
            self._load_checkpoint(resume_from)
            self._say(f"resumed from step {self.step} ({resume_from.path})")
        self._check_space()
        writer = self.rank == 0  # in a job, rank 0 writes the logs, summary and plots
        log_path = self.out / ("metrics.jsonl" if writer else f"metrics_rank{self.rank}.jsonl")
        history = self._metrics_history(log_path) if resume_from is not None else []
        loop = _Loop(self, history)
        written: list[Path] = []
        try:
            with log_path.open("a" if resume_from is not None else "w") as log:
                loop.run(log, progress, written)
        except MoecError as exc:
            if writer:  # the run's results survive its error
                summary = loop.summary(error=str(exc))
                (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
            raise
        summary = loop.summary()
        written.insert(0, log_path)
        if writer:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
            written.insert(1, self.out / "summary.json")
        if cfg.plots and writer:
            from moec.plots import write_plots

            written += write_plots(self.out, history, self.compiled.routing_stats())
        return TrainResult(loop.losses, summary, self.compiled, self.out, written)

    def _recorded_summary(self) -> dict[str, Any]:
        path = self.out / "summary.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    def _record(
        self, loss: float, step_time: float, tokens: int, syncs: int | None, skipped: int
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
            "skipped_steps": skipped,
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


class _Loop:
    """One call's training loop: steps, log points (the host reads), checkpoints, timing."""

    def __init__(self, trainer: Trainer, history: list[dict[str, Any]]):
        self.trainer, self.cfg = trainer, trainer.cfg
        self.history = history
        self.losses: list[float] = []
        self.pending: list[torch.Tensor] = []
        self.tokens_per_step = self.cfg.batch_size * self.cfg.seq_len
        self.start_step = trainer.step
        self.steady_from = self.start_step + self.cfg.warmup_log_steps
        self.steady_start: float | None = None
        self.steady_steps = 0
        self.timed_s, self.timed_steps = 0.0, 0
        self.syncs: int | None = None
        self.skipped = 0
        self.longest_streak = 0

    def run(self, log, progress, written: list[Path]) -> None:
        t, cfg = self.trainer, self.cfg
        task = (
            progress.add_task("training", total=cfg.steps, completed=t.step) if progress else None
        )
        window_start, window_steps = time.perf_counter(), 0
        while t.step < cfg.steps:
            if t.step == self.steady_from and self.syncs is None:
                self.syncs = count_host_syncs(lambda: self.pending.append(t.train_step()), t.device)
            else:
                self.pending.append(t.train_step())
            window_steps += 1
            if t.step == self.steady_from:
                _wait(t.device)
                self.steady_start, self.steady_steps = time.perf_counter(), 0
            elif self.steady_start is not None:
                self.steady_steps += 1
            done = t.step == cfg.steps
            if t.step % cfg.log_every == 0 or done:
                now = time.perf_counter()
                record = self._log_point((now - window_start) / window_steps)
                self.timed_s += now - window_start
                self.timed_steps += window_steps
                window_start, window_steps = now, 0
                log.write(json.dumps(record) + "\n")
                log.flush()
                self._check_nonfinite()
                if progress:
                    progress.update(task, completed=t.step, **_progress_fields(record))
            if (cfg.checkpoint_every and t.step % cfg.checkpoint_every == 0) or done:
                committed = t.save_checkpoint()
                if committed is not None and done:
                    written.append(committed.path)

    def _log_point(self, step_time: float) -> dict[str, Any]:
        """Read the window's losses and the non-finite counters (the one host read per log
        window) and build the record."""
        t = self.trainer
        counters = torch.stack([t.skipped_steps, t.longest_streak]).to(torch.float32)
        values = torch.cat([torch.stack(self.pending), counters]).tolist()
        losses, (skipped, longest) = values[:-2], values[-2:]
        self.pending.clear()
        self.losses += losses
        self.skipped = int(skipped)
        record = t._record(losses[-1], step_time, self.tokens_per_step, self.syncs, self.skipped)
        self.history.append(record)
        self.longest_streak = int(longest)
        return record

    def _check_nonfinite(self) -> None:
        t = self.trainer
        longest = self.longest_streak
        if longest >= self.cfg.max_nonfinite_steps:
            raise NonFiniteError(
                f"{int(longest)} consecutive steps had a non-finite loss or gradient norm "
                f"(skipped; by step {t.step}, {self.skipped} skipped in all), "
                f"TrainConfig.max_nonfinite_steps = {self.cfg.max_nonfinite_steps}: the run "
                "stopped. Lower the learning rate, check the data and the model's numerics, or "
                "resume from an earlier checkpoint"
            )

    def summary(self, error: str | None = None) -> dict[str, Any]:
        t = self.trainer
        throughput = self._throughput()
        peak = bf16_peak_tflops(t.device)
        step_time = throughput["step_time_s"]
        first = t.first_loss
        summary = {
            "plan": t.compiled.program.pass_pipeline,
            "device": torch.cuda.get_device_name(t.device) if t.device.type == "cuda" else "cpu",
            "steps": t.step,
            "first_loss": None if first is None else float(first),
            "final_loss": self.losses[-1] if self.losses else None,
            "skipped_steps": self.skipped,
            "steady_step_time_s": step_time,
            "tokens_per_s_per_gpu": throughput["tokens_per_s"],
            "throughput_from": throughput["source"],
            "useful_mfu": useful_mfu(
                t.train_flops_per_token * self.tokens_per_step, step_time or 0, 1, peak
            )
            if step_time
            else None,
            "bf16_peak_tflops": peak if peak else "unknown for this device",
            "train_flops_per_token": t.train_flops_per_token,
            "params": t.params,
            "active_params": t.active_params,
            "host_syncs_per_step": self.syncs,
            "checkpoint_errors": t.checkpoint_errors,
        }
        if error is not None:
            summary["error"] = error
        return summary

    def _throughput(self) -> dict[str, Any]:
        """Steady-state step time where this call ran past its warmup steps; else the mean
        over every step it timed (a short resumed run), saying which."""
        if self.steady_start is not None and self.steady_steps > 0:
            _wait(self.trainer.device)
            step_time = (time.perf_counter() - self.steady_start) / self.steady_steps
            source = f"{self.steady_steps} steady steps (after {self.cfg.warmup_log_steps} warmup)"
        elif self.timed_steps:
            step_time = self.timed_s / self.timed_steps
            source = f"all {self.timed_steps} steps of this call (too few for a steady window)"
        else:
            return {"step_time_s": None, "tokens_per_s": None, "source": "no step was timed"}
        return {
            "step_time_s": step_time,
            "tokens_per_s": self.tokens_per_step / step_time,
            "source": source,
        }


def model_vocab(model: torch.nn.Module) -> int:
    """The vocabulary the model declares (``cfg.vocab_size`` or ``config.vocab_size``), else
    256 (byte tokens)."""
    for holder in ("cfg", "config"):
        vocab = getattr(getattr(model, holder, None), "vocab_size", None)
        if isinstance(vocab, int):
            return vocab
    return 256


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
        force=args.force,
    )
    torch.manual_seed(cfg.seed)  # the model's initialisation is part of the run
    return _train_and_report(demo_model(), plan, cfg)


def cli_train(args) -> int:
    """``moec train``: a model the CLI knows, a plan file, offline text or synthetic data."""
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
        out=args.out,
        seed=args.seed,
        device=args.device,
        synthetic=args.synthetic,
        resume=args.resume,
        force=args.force,
    )
    torch.manual_seed(cfg.seed)  # the model's initialisation is part of the run
    return _train_and_report(load_model(args.model)[0], plan, cfg)


def _train_and_report(model: torch.nn.Module, plan: Plan, cfg: TrainConfig) -> int:
    result = train(model, plan, cfg, show_progress=True)
    if not result.finished:
        _print_summary(result)
    return 0


def _print_summary(result: TrainResult) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    s = result.summary
    tokens = s["tokens_per_s_per_gpu"]
    console.print(
        f"[bold]{s['plan']}[/bold] on {s['device']}: loss {s['first_loss']:.3f} -> "
        f"{s['final_loss']:.3f} in {s['steps']} steps; "
        + (f"{tokens:,.0f} tokens/s ({s['throughput_from']}); " if tokens else "")
        + (f"{s['skipped_steps']} non-finite steps skipped; " if s["skipped_steps"] else "")
        + f"{s['active_params']:,} of {s['params']:,} parameters active per token"
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
    names = ", ".join(str(p.relative_to(result.out)) for p in result.written)
    console.print(f"wrote in {result.out}: {names}", markup=False, highlight=False)
    if not any(p.suffix == ".png" for p in result.written) and result.written:
        console.print("no plots: they need matplotlib (pip install matplotlib)", markup=False)
