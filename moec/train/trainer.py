"""Training a compiled model: ``moec.train(model, plan, config)``, ``moec train``, ``moec demo``.

One training step for every layout (one process; data, expert and FSDP/HSDP parallel; pipeline
parallel, ``parallel.pp > 1``): the forward and backward of ``plan.parallel.microbatches``
microbatches (gradient accumulation; under PP, the plan's pipeline schedule over the stages this
rank holds, :mod:`moec.runtime.pipeline`), gradient clipping by the norm over every gradient of
the job (all experts, shards and pipeline stages), AdamW (:class:`moec.optim.AdamW`, which also
writes the program's bf16 working weights) with separate dense and expert parameter groups (no
weight decay on embeddings, norms and biases), a warmup-stable-decay learning rate. The step
itself never reads the device: losses, routing statistics and the non-finite counters stay on
the device and are read every ``log_every`` steps, which is also where step time is measured.

Jobs run under torchrun with ``dp x pp`` processes (:func:`join_job`). Under PP, rank =
pp_index * dp + dp_index: the pipeline ranks of one data-parallel rank read the same batches, and
the loss lives on the last stage's ranks (the other ranks' step returns 0); at log points (only
there) each pipeline group's losses and routing statistics reach its ranks, so rank 0 logs
them. Checkpoints name parameters as the full graph does, whatever ``pp``: a run resumes at
another PP, EP or data-parallel degree (parameters and optimizer state resharded).

Non-finite steps: a step whose loss or global gradient norm is not finite is skipped on the
device (AdamW's ``found_inf``: parameters, moments and step counters keep their values) and
counted (``skipped_steps`` in the metrics); ``max_nonfinite_steps`` consecutive ones stop the
run with :class:`NonFiniteError` at the next log point. Spikes (``spike_sigma`` > 0, skip-step
AdamW): a finite step whose loss or gradient norm exceeds the running statistics
(:class:`moec.optim.SpikeDetector`) is skipped through the same ``found_inf`` and counted as
``spike_skipped_steps``; in a job the loss it judges is the mean over the data-parallel ranks
(one scalar all-reduce over the job; under PP, of the last stage's losses), so every rank, every
pipeline rank included, skips the same steps.

Balance: after each step's backwards the trainer calls ``compiled.finish_step()`` (under PP the
pipeline runtime does, per stage; :mod:`moec.runtime.router_losses`): the step's expert loads
summed over the data-parallel ranks, MaxVio per block (``max_vio`` in the metrics) and, under
``moe.balance: aux_free``, the selection biases' update from those loads, on the device; a
skipped step moves them too.

Data: the offline text, synthetic tokens or ``data`` (:mod:`moec.corpus`), each batch a pure
function of (seed, step, data-parallel rank), read ``prefetch`` steps ahead by a background thread
(:class:`moec.data.Prefetcher`). Batch-size warmup (``batch_warmup``) changes the global batch at
the configured steps (each rank's share split into ``plan.parallel.microbatches``) and scales
the learning rate by sqrt(batch / first batch) (:func:`moec.train.config.lr_factor`).

Outputs under ``out`` (never written through a link, :mod:`moec.runtime.run_files`):
``run.lock`` while the run runs (one run per folder, :mod:`moec.train.run_lock`),
``run.json`` (the run's identity, :mod:`moec.runtime.run_identity`),
``metrics.jsonl`` (one line per log step, with its window's per-step losses and learning
rates), ``summary.json``, PNG plots (every step's loss and learning rate, throughput,
load-balancing loss and MaxVio, per-layer expert-load heatmap; need matplotlib) and
``checkpoints/step_N``, committed atomically by :mod:`moec.runtime.checkpoint_store` (DCP
shards loadable at any EP or PP degree, a manifest with checksums; the newest ``keep_checkpoints``
kept). ``resume=True`` continues the
same run from its newest checkpoint that verifies and loads (each one that does not is skipped
with the reason; files are read without running code, :mod:`moec.runtime.safe_read`; ``run.json``
is rewritten only once one has loaded) and reproduces the uninterrupted run bit for
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
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from moec import cache as moec_cache
from moec.analysis.cost import graph_cost
from moec.analysis.rank_memory import GIB, format_rank_memory, rank_memory
from moec.compiler import compile
from moec.corpus import TokenCorpus, parse_spec
from moec.data import Batches, DataError, Prefetcher, TextBatches
from moec.errors import MoecError
from moec.folders import writable_folder
from moec.kernels import arch
from moec.kernels.target import Target
from moec.optim import AdamW, SpikeDetector
from moec.plan import Plan
from moec.program import Program
from moec.runtime import checkpoint, run_files, run_identity, safe_read
from moec.runtime.checkpoint_store import (
    CheckpointSpaceError,
    CheckpointStore,
    CheckpointWriteError,
    Committed,
)
from moec.runtime.distributed import (
    GradientReducer,
    MoEMesh,
    bucket_bytes_for,
    clip_gradients_,
    global_grad_norm,
    init_from_env,
    join_plan_job,
)
from moec.runtime.distributed import parameter_groups as dist_parameter_groups
from moec.runtime.fsdp import set_gradient_sync
from moec.runtime.materialize import FreshInit, SubmoduleSource, open_source
from moec.runtime.pipeline import PipelineMesh, PipelineRuntime, build_pipeline_mesh, runtime_for
from moec.runtime.step_graph import StepGraph, graph_blocker
from moec.train.config import (
    FRESH_INIT,
    TrainConfig,
    batch_per_rank,
    check_batch_warmup,
    flag_of,
    global_batch_at,
    lr_factor,
    rank_batch_size,
    resolve_device,
)
from moec.train.evaluation import Evaluator, compiled_loss, held_out
from moec.train.loop import TrainingLoop, TrainResult
from moec.train.objective import LanguageModelWithLoss, parameter_groups
from moec.train.run_lock import RunLock, RunLockError, check_free, lock_run_dir
from moec.train.timing import FirstStepClock


class MemoryPlanError(MoecError):
    """The plan's predicted per-rank memory exceeds what the rank has."""


class CheckpointLoadError(MoecError):
    """A resume whose checkpoints do not verify or do not load into this program."""


class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        plan: Plan,
        cfg: TrainConfig,
        console=None,
        target: Target | None = None,
    ):
        """``target``: the machine the program is bound for (``moec.compile``'s; default
        detected for ``cfg.device``), e.g. a benchmark's target without the CuTe DSL.
        ``self.cfg`` is ``cfg`` with the batch size the run trains at (:func:`batch_per_rank`:
        the plan's microbatches x microbatch size where ``cfg`` gives none)."""
        cfg = dataclasses.replace(cfg, batch_size=batch_per_rank(cfg.batch_size, plan.parallel))
        self.plan, self.cfg = plan, cfg
        self.console = console
        job = join_job(plan)
        self.pp_mesh = job if isinstance(job, PipelineMesh) else None
        """The pipeline mesh under ``parallel.pp > 1``, else None."""
        self.mesh = job.moe if isinstance(job, PipelineMesh) else job
        """The data/expert-parallel groups (under PP, among this pipeline rank's ranks); None
        for one process."""
        self.rank = dist.get_rank() if job else 0
        self.device = resolve_device(cfg.device)
        moec_cache.setup()  # before anything compiles: launches reuse what others compiled
        self.startup = FirstStepClock(self.device)
        """Time to the first step, by part (``first_step`` in the summary)."""
        self.out = writable_folder(cfg.out, flag_of("out"))
        vocab = model_vocab(model)
        micro = plan.parallel.microbatches
        self.dp = plan.parallel.dp  # data-parallel ranks
        dp_rank = dist.get_rank(self.mesh.dp_group) if self.mesh else 0
        check_batch_warmup(cfg, micro, self.dp)
        # every data-parallel rank reads its own batches (same model init on every rank); the
        # pipeline ranks of one data-parallel rank read the same ones
        data_seed = cfg.seed + 7919 * dp_rank
        self.batches: Prefetcher | None = None
        self.data = make_batches(cfg, vocab, data_seed, rank_batch_size(cfg, self.dp))
        self.identity = run_identity.run_identity(
            model,
            plan,
            batch_size=cfg.batch_size,
            seq_len=cfg.seq_len,
            synthetic=cfg.synthetic,
            vocab=vocab,
            seed=cfg.seed,
        )
        self.identity["data"].update(data_identity(cfg, self.data))
        self._on_rank_0(lambda: check_free(self.out))  # a busy folder, refused before compiling
        run_identity.check_run_dir(self.out, self.identity, resume=cfg.resume, force=cfg.force)
        torch.manual_seed(cfg.seed)
        # a model given on the meta device (init_from) is captured on meta inputs too
        capture_device = "meta" if cfg.init_from else self.device
        # captured at the run's own microbatch (a warmup's first batches are smaller)
        steady = cfg.batch_warmup[-1][1] if cfg.batch_warmup else 0
        example = tuple(
            t[: cfg.batch_size // micro].to(capture_device) for t in self.data.batch(steady)
        )
        if cfg.init_from == FRESH_INIT:  # bound to the model: its _init_weights, its names
            dense = FreshInit(cfg.seed, model)
            if dense.uses_module_defaults():
                self._say(
                    f"note: --init-from fresh: {type(model).__name__} has no "
                    "_init_weights(module), so each module is drawn by its own "
                    "reset_parameters(); what the model's __init__ initializes after that is "
                    "not applied (define _init_weights(module) for it)"
                )
        else:
            dense = cfg.init_from and open_source(cfg.init_from)
        if cfg.z_loss and plan.loss.fused:
            self._say(
                "note: --z-loss reads the LM head's logits, which moec::linear_cross_entropy "
                "does not return: the head runs unfused (loss.fused has no effect)"
            )
        wrapped = LanguageModelWithLoss(model, cfg.z_loss)
        move = not cfg.init_from  # a meta model is materialized on the device instead
        limited = self._memory_limit() is not None

        def check(program: Program) -> None:
            # predicted on the meta device before the model moves to the device; compile then
            # gives the program the moved model's tensors, as it shares them without a limit
            self._check_memory(program)
            if move:
                wrapped.to(self.device)

        self.compiled = compile(
            wrapped.to(self.device) if move and not limited else wrapped,
            plan,
            example,
            mesh=job,
            # the wrapper holds the checkpoint's model at "model."
            init_from=dense and SubmoduleSource(dense, "model."),
            init_device=self.device,
            check=check if limited else None,
            target=target,
        )
        self.pipeline: PipelineRuntime | None = runtime_for(self.compiled) if self.pp_mesh else None
        """This rank's pipeline stages under PP (built before the optimizer: it frees the
        other ranks' parameters)."""
        self.eval_source: str | None = None
        """What the eval batches are (None: no evaluation)."""
        self.evaluator = self._evaluator(vocab, dp_rank)
        self.reducer = (
            GradientReducer(self.compiled, self.mesh, bucket_bytes_for(plan, self.device.type))
            if self.mesh and self.pipeline is None  # the pipeline's stages have their own
            else None
        )
        graph_off = (
            graph_blocker(self.device, job is not None)
            if plan.experimental.cuda_graph
            else "experimental.cuda_graph is off"
        )
        if plan.experimental.cuda_graph and graph_off:
            self._say(f"note: experimental.cuda_graph: the step is not captured: {graph_off}")
        if plan.lowers_to_inductor(self.device.type):
            self._say(
                f"note: lowering.inductor ({plan.lowering.inductor}): the program runs through "
                "Inductor, which compiles it during the first step (tens of seconds on a large "
                "model); lowering.inductor: false runs it eagerly"
            )
        emulated = arch.emulated_precision(plan.precision.gemm, self.device)
        if emulated:
            self._say(f"note: precision.gemm: {emulated}")
        self.optimizer = AdamW(
            parameter_groups(self.compiled, cfg.weight_decay, cfg.no_decay),
            lr=cfg.lr,
            betas=cfg.betas,
            working_weights=(self.pipeline or self.compiled).working_weights,
            device_step=True,  # a non-finite step is skipped on the device
            lr_on_device=graph_off is None,  # a replayed step reads the schedule's lr there
        )
        self.schedule_steps = cfg.steps
        """The steps the learning-rate schedule is planned over (a resume keeps the run's)."""
        self._lr_factor = lr_factor(cfg)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: self._lr_factor(step)
        )
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
        self.first_loss: float | None = None
        """The run's first loss (rank 0's data-parallel rank's), set at its first log point."""
        # device-side run state, read at log points and saved with every checkpoint
        self.skipped_steps = torch.zeros((), dtype=torch.int64, device=self.device)
        self.nonfinite_streak = torch.zeros((), dtype=torch.int64, device=self.device)
        self.longest_streak = torch.zeros((), dtype=torch.int64, device=self.device)
        self.spike_skipped_steps = torch.zeros((), dtype=torch.int64, device=self.device)
        self.spikes = (
            SpikeDetector(cfg.spike_sigma, cfg.spike_window, cfg.spike_min_steps, self.device)
            if cfg.spike_sigma > 0
            else None
        )
        self.checkpoint_errors: list[str] = []
        self.step_graph = (
            StepGraph(self._device_step, self.optimizer.write_lr) if graph_off is None else None
        )
        """The step as a CUDA graph (``plan.experimental.cuda_graph`` where it can be captured)."""

    @property
    def data(self) -> Batches:
        """This rank's batches (``batch(step)``); setting another source restarts the read-ahead
        on it."""
        return self._data

    @data.setter
    def data(self, source: Batches) -> None:
        if self.batches is not None:
            self.batches.close()
        self._data = source
        self.batches = Prefetcher(source, self.device, self.cfg.prefetch)

    def _evaluator(self, vocab: int, dp_rank: int) -> Evaluator | None:
        """The held-out evaluation of ``eval_every`` (:mod:`moec.train.evaluation`); None when
        it is off or there is nothing held out (said in one line)."""
        cfg = self.cfg
        if not cfg.eval_every:
            return None
        batches, what = held_out(cfg, vocab)
        if batches is None:
            self._say(f"note: {flag_of('eval_every')} = {cfg.eval_every}: no evaluation: {what}")
            return None
        self.eval_source = what
        micro = self.plan.parallel.microbatches
        loss_of = self.pipeline.evaluate if self.pipeline else compiled_loss(self.compiled, micro)
        return Evaluator(
            loss_of,
            batches,
            cfg.eval_batches,
            self.device,
            share=(dp_rank, self.dp),
            in_job=self.mesh is not None,
        )

    def _memory_limit(self) -> int | None:
        """The bytes a rank may use (``TrainConfig.memory_limit_gib``, else the GPU's memory);
        None where nothing limits it (the CPU without a limit)."""
        limit = self.cfg.memory_limit_gib
        if limit is not None:
            return round(limit * GIB)
        if self.device.type == "cuda":
            return torch.cuda.get_device_properties(self.device).total_memory
        return None

    def _check_memory(self, program: Program) -> None:
        """Refuse the plan when its predicted per-rank memory exceeds :meth:`_memory_limit`
        (``program`` may be on the meta device: only shapes and dtypes are read)."""
        limit_bytes = self._memory_limit()
        if limit_bytes is None:
            return
        micro = self.plan.parallel.microbatches
        memory = rank_memory(program, micro, self.cfg.batch_size // micro, self.cfg.seq_len)
        if memory.total > limit_bytes:
            raise MemoryPlanError(
                f"the plan needs {memory.total / GIB:.3g} GiB per rank, more than the "
                f"{limit_bytes / GIB:.3g} GiB available; add expert- or pipeline-parallel ranks "
                "(parallel.ep, parallel.pp), recompute (recompute.policy), or a smaller "
                f"--batch-size / --seq-len. Predicted per rank:\n"
                + format_rank_memory(memory, limit_bytes)
            )

    # --- one optimizer step (no host reads) ----------------------------------------------------

    def global_batch(self, step: int) -> int:
        """Sequences in optimizer step ``step`` over all data-parallel ranks."""
        return global_batch_at(self.cfg, step, self.dp)

    def train_step(self, eager: bool = False) -> torch.Tensor:
        """One optimizer step; its loss (a device scalar). With ``plan.experimental.cuda_graph``
        the device work is a replayed CUDA graph (:mod:`moec.runtime.step_graph`) unless
        ``eager`` (a profiled step: its ranges need the ops launched one by one; the graph is
        then captured again after a new warmup)."""
        inputs, targets = self.batches.batch(self.step)
        if self.step_graph is not None and eager:
            self.step_graph.release()
        run = self._device_step if self.step_graph is None or eager else self.step_graph
        total = run(inputs, targets)
        self.scheduler.step()
        self.step += 1
        return total

    def _device_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The step's device work: forward/backward over the microbatches (with the gradient
        reduction), clipping, the skip decision and AdamW. Capturable at PP = 1: it reads no
        host value that changes between steps, and updates the run's device state in place."""
        total = self._forward_backward(inputs, targets)
        norm = self._clip_gradients()
        nonfinite = self._nonfinite(total, norm)
        skip = nonfinite
        if self.spikes is not None:
            spike = self.spikes(self._job_mean(total), norm)
            self.spike_skipped_steps += spike
            skip = nonfinite | spike
        self.optimizer.found_inf = skip.float()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._count_nonfinite(nonfinite)
        return total

    def _forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The part of the step that differs by layout: every microbatch's forward and backward,
        gradients reduced over the data-parallel ranks and the routers' step balance ended.
        Returns the step's mean loss; under PP, on the last stage's ranks (0 elsewhere)."""
        if self.pipeline is not None:
            loss = self.pipeline.forward_backward(inputs, targets)
            return torch.zeros((), device=self.device) if loss is None else loss
        micro = self.plan.parallel.microbatches
        total = torch.zeros((), device=self.device)
        pairs = list(zip(inputs.chunk(micro), targets.chunk(micro), strict=True))
        for i, (x, y) in enumerate(pairs):
            local = self.reducer is not None and i < len(pairs) - 1
            set_gradient_sync(self.compiled, not local)
            with self.reducer.no_sync() if local else contextlib.nullcontext():
                loss = self.compiled(x, y)
                has_moe = bool(self.compiled.moe_layers)
                objective = loss + self.compiled.aux_loss() if has_moe else loss
                (objective / micro).backward()
            total = total + loss.detach() / micro
        self.compiled.detach_aux_outputs()  # the step keeps no autograd graph alive
        self.compiled.finish_step()  # global expert loads, MaxVio, the aux_free bias update
        if self.reducer is not None:
            self.reducer.finish()
        return total

    def _clip_gradients(self) -> torch.Tensor:
        """:func:`clip_job_gradients` of this step; the norm, the same on every rank."""
        job = self.pp_mesh or self.mesh
        return clip_job_gradients(
            self.compiled, job, self.cfg.grad_clip, self.optimizer, self.device
        )

    def _nonfinite(self, loss: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        """Whether this step is skipped. In a job only the global gradient norm decides: it is
        the same on every rank, every pipeline rank included (this rank's loss is not), and a
        non-finite loss anywhere makes it non-finite."""
        finite = torch.isfinite(norm)
        if self.mesh is None:
            finite = finite & torch.isfinite(loss)
        return ~finite

    def _job_mean(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss averaged over the data-parallel ranks (on the device), so that every rank
        judges the same value; this rank's loss outside a job. Summed over the whole job: under
        PP only the last stage's ranks hold a loss (the others add 0)."""
        if self.mesh is None:
            return loss
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        return mean / self.dp

    def _count_nonfinite(self, nonfinite: torch.Tensor) -> None:
        """In place (a captured step's counters are the tensors the graph writes)."""
        self.skipped_steps += nonfinite
        self.nonfinite_streak.add_(1).mul_(nonfinite)
        self.longest_streak.copy_(torch.maximum(self.longest_streak, self.nonfinite_streak))

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
            "schedule_steps": self.schedule_steps,
            "cpu_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if self.device.type == "cuda" else None,
            "first_loss": self.first_loss,
            "skipped_steps": self.skipped_steps.cpu(),
            "nonfinite_streak": self.nonfinite_streak.cpu(),
            "longest_streak": self.longest_streak.cpu(),
            "spike_skipped_steps": self.spike_skipped_steps.cpu(),
            "spikes": None if self.spikes is None else self.spikes.state_dict(),
        }
        torch.save(extra, path / self._trainer_file)

    @property
    def _trainer_file(self) -> str:
        """Step, scheduler, RNG and run state: one file, or one per rank in a job."""
        return f"trainer_rank{self.rank}.pt" if self.mesh else "trainer.pt"

    def _resume(self) -> Committed | None:
        """The newest checkpoint that verifies and loads, loaded (one of a finished run is
        returned unloaded); each one that does not load is reported with the reason and the
        next one tried. None where none verifies; :class:`CheckpointLoadError` where some
        verify and none loads (a failed read may have written part of the program's state)."""
        tried = []
        for candidate in self.store.verified():
            if candidate.step >= self.cfg.steps:
                return candidate
            problem = self._load_checkpoint(candidate)
            if problem is None:
                return candidate
            self._say(f"skipping checkpoint {candidate.path}: it does not load ({problem})")
            tried.append(candidate.path.name)
        if tried:
            raise CheckpointLoadError(
                f"--resume: no checkpoint in {self.store.root} loads into this program "
                f"({', '.join(tried)}: the reasons are above; written by another model, plan "
                "or moec version?): resume with the run's own settings, or start a new run "
                "(another --out, or --force without --resume, which replaces them)"
            )
        return None

    def _load_checkpoint(self, committed: Committed) -> str | None:
        """Read ``committed`` into the program, optimizer and run state; None, or why it
        failed (the same on every rank). Its files are read without running code
        (:mod:`moec.runtime.safe_read`); the run state is read first, so a trainer file that
        fails changes nothing."""
        path = committed.path
        own = path / self._trainer_file
        extra, problem = self._attempt(
            lambda: _run_state(own if own.is_file() else _any_trainer_file(path), committed)
        )
        if problem is None:
            _, problem = self._attempt(
                lambda: self._apply_checkpoint(committed, extra, own.is_file())
            )
        return problem

    def _attempt(self, action: Callable[[], Any]) -> tuple[Any, str | None]:
        """``action()``'s value and None, or None and why it raised (whatever it raised: DCP's
        ``CheckpointException`` is a ``BaseException``), agreed over the job's ranks."""
        try:
            value, problem = action(), None
        except (Exception, CheckpointException) as exc:
            value, problem = None, safe_read.failure_reason(exc)
        return value, self.store.agree(problem)

    def _apply_checkpoint(self, committed: Committed, extra: dict[str, Any], own: bool) -> None:
        """Read the program's and optimizer's state (DCP), then set the run state ``extra``
        (``own``: this rank's, with its random streams)."""
        path = committed.path
        checkpoint.load(self.compiled, self.optimizer, path, self.mesh)
        self.step = extra["step"]
        self.scheduler.load_state_dict(extra["scheduler"])
        self.schedule_steps = extra.get("schedule_steps", self.cfg.steps)  # older: unrecorded
        if own:
            torch.set_rng_state(extra["cpu_rng"])
            if extra["cuda_rng"] is not None:
                torch.cuda.set_rng_state_all(extra["cuda_rng"])
        else:  # written by a job of another size: this rank had no random streams there
            self._say(
                f"{path} was written at another data/expert-parallel layout: parameters and "
                "optimizer state are resharded; random streams restart from the seed"
            )
            torch.manual_seed(self.cfg.seed + 7919 * self.rank + self.step)
        first = extra.get("first_loss")  # a device scalar in older checkpoints
        self.first_loss = None if first is None else float(first)
        for name in ("skipped_steps", "nonfinite_streak", "longest_streak", "spike_skipped_steps"):
            if name in extra:
                getattr(self, name).copy_(extra[name])
        if self.spikes is not None and extra.get("spikes") is not None:
            self.spikes.load_state_dict(extra["spikes"])

    # --- the run directory ---------------------------------------------------------------------

    def _prepare_out(self) -> Committed | None:
        """Load the checkpoint to resume from (if any), then record the run's identity (a new
        run over checkpoints with ``force``: remove them); return that checkpoint. A resume
        that loads nothing leaves ``run.json`` as it was."""
        cfg = self.cfg
        resume_from = self._resume() if cfg.resume else None
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

    def _continue_schedule(self) -> None:
        """After a resume: keep the learning-rate schedule the run planned (over
        ``schedule_steps``) or, with ``replan_schedule``, plan it over this call's ``steps`` from
        the resumed step; where the two differ, say which and what it does to the rate."""
        cfg, planned, step = self.cfg, self.schedule_steps, self.step
        if planned == cfg.steps:
            return
        kept = lr_factor(cfg, planned)
        self._lr_factor = lr_factor(cfg) if cfg.replan_schedule else kept
        if cfg.replan_schedule:
            self.schedule_steps = cfg.steps
        # the rate of the next step (0-based ``step``), as LambdaLR computes it
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
            group["lr"] = base * self._lr_factor(step)
        base = self.scheduler.base_lrs[0]
        if cfg.replan_schedule:
            self._say(
                f"{flag_of('replan_schedule')}: the learning-rate schedule, planned over "
                f"{planned} steps, is re-planned over {cfg.steps}: the rate of step {step + 1} "
                f"goes from {base * kept(step):.3g} to {base * self._lr_factor(step):.3g}"
            )
            return
        if cfg.steps > planned:
            what = (
                f"extends the run past the {planned} steps its learning-rate schedule was "
                f"planned over: the schedule is kept, so steps {max(step, planned) + 1}-"
                f"{cfg.steps} train at its final rate {base * kept(planned):.3g}"
            )
        else:
            what = (
                f"stops the run before the end of the {planned} steps its learning-rate "
                "schedule was planned over: the schedule is kept, so its decay is not finished "
                f"(the rate of step {cfg.steps}: {base * kept(cfg.steps - 1):.3g})"
            )
        self._say(
            f"{flag_of('steps')} = {cfg.steps} {what}; {flag_of('replan_schedule')} re-plans "
            f"the schedule over {cfg.steps} steps instead"
        )

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
        """The records of ``path`` up to this step (a resumed run rewrites the file with
        these: without the steps after its checkpoint, and without a line cut short by a
        crash)."""
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
        return kept

    def _say(self, message: str) -> None:
        if self.rank != 0:
            return
        if self.console is not None:  # one line, never wrapped (logs are searched by line)
            self.console.print(message, markup=False, highlight=False, soft_wrap=True)
        else:
            print(message, file=sys.stderr)

    # --- the loop ------------------------------------------------------------------------------

    def run(self, progress=None) -> TrainResult:
        """Train to ``cfg.steps``, holding the run folder's lock (:mod:`moec.train.run_lock`)
        from before anything is written until the end, an error's end included. The folder's
        checks run again under the lock: another run may have used it since this trainer was
        built."""
        lock = self._on_rank_0(lambda: lock_run_dir(self.out, self._say))
        try:
            run_identity.check_run_dir(
                self.out, self.identity, resume=self.cfg.resume, force=self.cfg.force
            )
            return self._run(progress)
        finally:
            if lock is not None:
                lock.release()

    def _on_rank_0(self, lock: Callable[[], RunLock | None]) -> RunLock | None:
        """``lock()`` on rank 0 (the job's run-folder lock: :mod:`moec.train.run_lock`); its
        result there, None on the other ranks. Where it raises :class:`RunLockError`, every
        rank raises it (none is left waiting in a collective)."""
        held, refusal = None, None
        if self.rank == 0:
            try:
                held = lock()
            except RunLockError as exc:
                refusal = str(exc)
        if self.mesh is not None:
            shared = [refusal]
            dist.broadcast_object_list(shared, src=0, device=self.device)
            refusal = shared[0]
        if refusal is not None:
            raise RunLockError(refusal)
        return held

    def _run(self, progress=None) -> TrainResult:
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
            self._say(f"resumed from step {self.step} ({resume_from.path})")
            self._continue_schedule()
        self._check_space()
        writer = self.rank == 0  # in a job, rank 0 writes the logs, summary and plots
        log_path = self.out / ("metrics.jsonl" if writer else f"metrics_rank{self.rank}.jsonl")
        history = self._metrics_history(log_path) if resume_from is not None else []
        loop = TrainingLoop(self, history)
        written: list[Path] = []
        try:
            with run_files.open_log(
                log_path, "".join(json.dumps(r) + "\n" for r in history)
            ) as log:
                loop.run(log, progress, written)
        except MoecError as exc:
            error = (
                self._keep_steps_before(exc, loop.start_step) if isinstance(exc, DataError) else exc
            )
            if writer:  # the run's results survive its error
                summary = loop.summary(error=str(error))
                run_files.write_text(self.out / "summary.json", json.dumps(summary, indent=2))
            if error is exc:
                raise
            raise error from exc
        finally:
            self.batches.close()
        summary = loop.summary()
        written.insert(0, log_path)
        if writer:
            run_files.write_text(self.out / "summary.json", json.dumps(summary, indent=2))
            written.insert(1, self.out / "summary.json")
        routing = history[-1]["routing"] if history else {}  # the last step's, a log point
        if cfg.plots and writer:
            from moec.plots import write_plots

            written += write_plots(self.out, history, routing, summary, self.device)
        return TrainResult(loop.losses, summary, self.compiled, self.out, written, routing=routing)

    def _keep_steps_before(self, exc: DataError, start: int) -> DataError:
        """``exc`` (raised when step ``self.step`` read its batch, so every step before it is
        done) saying what was kept: those steps committed as a checkpoint, for a ``--resume``
        once the data is fixed, unless ``checkpoint_every`` is 0, this call trained no step
        since ``start`` or the run is a job (the other ranks wait in the step's collectives,
        so no checkpoint can be written)."""
        step = self.step
        saved = next((c for c in self.store.committed() if c.step == step), None)
        kept = "no step was trained in this call"
        if saved is None and step > start:
            if not self.cfg.checkpoint_every:
                kept = f"no checkpoint was written ({flag_of('checkpoint_every')} = 0)"
            elif self.mesh is not None:
                kept = "no checkpoint was written (the job's other ranks wait in the step)"
            else:
                try:
                    saved = self.store.commit(step, self._write_checkpoint)
                except CheckpointWriteError as write_error:
                    kept = f"its steps could not be saved ({write_error})"
        if saved is not None:
            kept = f"its {step} steps are in {saved.path}: fix the data, then --resume"
        return type(exc)(f"{exc}. The run stopped at step {step}; {kept}")

    def _recorded_summary(self) -> dict[str, Any]:
        path = self.out / "summary.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    # --- log points (the loop's; under PP a collective over each pipeline group) --------------

    def logged(self, values: torch.Tensor) -> list[float]:
        """``values`` (this step's losses and the run's counters) read on the host, under PP
        those of the pipeline's last stage (broadcast over the pipeline group from the rank
        holding it): rank 0 logs the losses of its data-parallel rank."""
        if self.pipeline is not None:
            group = self.pp_mesh.pp_group
            last = self.pipeline.split.info[-1].rank
            dist.broadcast(values, src=dist.get_global_rank(group, last), group=group)
        return values.tolist()

    def routing_stats(self) -> dict[str, dict[str, Any]]:
        """:meth:`~moec.runtime.compiled.CompiledModel.routing_stats` of every MoE block, in
        the program's order: under PP gathered from the pipeline group (each rank holds its
        stages' blocks)."""
        stats = self.compiled.routing_stats()
        if self.pipeline is None:
            return stats
        parts: list[Any] = [None] * self.pp_mesh.pp
        dist.all_gather_object(parts, stats, group=self.pp_mesh.pp_group)
        merged = {path: block for part in parts for path, block in part.items()}
        return {m.path: merged[m.path] for m in self.compiled.moe_layers if m.path in merged}


def model_vocab(model: torch.nn.Module) -> int:
    """The vocabulary the model declares (``cfg.vocab_size`` or ``config.vocab_size``), else
    256 (byte tokens)."""
    for holder in ("cfg", "config"):
        vocab = getattr(getattr(model, holder, None), "vocab_size", None)
        if isinstance(vocab, int):
            return vocab
    return 256


def make_batches(cfg: TrainConfig, vocab: int, seed: int, batch_size) -> Batches:
    """The run's batches: ``data`` (:class:`moec.corpus.TokenCorpus`), else the offline text or
    synthetic tokens (:class:`moec.data.TextBatches`)."""
    if cfg.data is None:
        return TextBatches(batch_size, cfg.seq_len, seed, cfg.synthetic, vocab)
    return TokenCorpus(
        parse_spec(cfg.data, cfg.data_dtype),
        batch_size,
        cfg.seq_len,
        vocab,
        seed,
        tokenizer=cfg.tokenizer,
        text_column=cfg.text_column,
    )


def data_identity(cfg: TrainConfig, data: Batches) -> dict[str, Any]:
    """What the run identity adds about the data: the corpus and the batch-size warmup."""
    extra: dict[str, Any] = {}
    if isinstance(data, TokenCorpus):
        extra["source"] = "corpus"
        extra["corpus"] = data.describe()
    if cfg.batch_warmup:
        extra["batch_warmup"] = [list(pair) for pair in cfg.batch_warmup]
    return extra


def clip_job_gradients(
    compiled: torch.nn.Module,
    mesh: MoEMesh | PipelineMesh | None,
    max_norm: float,
    optimizer: Any,
    device: torch.device,
) -> torch.Tensor:
    """Clip the gradients of ``compiled``'s parameters (this rank's: its experts, its FSDP
    shards, its pipeline stages) so that the norm over every gradient of the job is at most
    ``max_norm``, and return that norm (on the device, the same on every rank: squares summed
    over the EP, FSDP shard, data-parallel expert shard and pipeline groups, see
    :func:`~moec.runtime.distributed.global_grad_norm`). ``optimizer`` takes the factor where
    it can (:func:`~moec.runtime.distributed.clip_gradients_`)."""
    pipelined = isinstance(mesh, PipelineMesh)
    groups = mesh.moe if pipelined else mesh
    dense, expert = dist_parameter_groups(compiled)
    norm = global_grad_norm(
        dense,
        expert,
        device,
        groups.ep_group if groups else None,
        mesh.pp_group if pipelined else None,
        dense_group=groups.dense_shard_group if groups else None,
        expert_shard_group=groups.dp_group if groups else None,
    )
    clip_gradients_(dense + expert, norm, max_norm, optimizer)
    return norm


def join_job(plan: Plan) -> MoEMesh | PipelineMesh | None:
    """Join the torchrun job of ``plan`` (``dp x pp`` processes) and build its mesh: the
    (pp, edp, ep) pipeline mesh when ``parallel.pp > 1``, else the (edp, ep) mesh when the plan
    is data/expert parallel; None for one process."""
    p = plan.parallel
    if p.pp > 1:
        join_plan_job(plan)
        return build_pipeline_mesh(plan)
    if p.dp == 1 and p.ep == 1:
        return None
    return init_from_env(plan)


def _run_state(path: Path, committed: Committed) -> dict[str, Any]:
    """The run state in the trainer file ``path`` (tensors, numbers and containers only),
    checked to be of ``committed``'s step."""
    extra = safe_read.load_plain(path)
    step = extra.get("step") if isinstance(extra, dict) else None
    if step != committed.step:
        raise ValueError(f"{path} holds the state of step {step!r}, not {committed.step}")
    return extra


def _any_trainer_file(path: Path) -> Path:
    """The step's run state written by a job of another size (every rank's copy of the step,
    schedule and counters is the same)."""
    for name in ("trainer.pt", "trainer_rank0.pt"):
        if (path / name).is_file():
            return path / name
    raise FileNotFoundError(f"no trainer.pt or trainer_rank0.pt in {path}")
