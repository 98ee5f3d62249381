"""``TrainConfig``: a training run's settings, validated with errors that name the field and its
``moec train`` flag; the device, the warmup-stable-decay learning-rate schedule and the
batch-size warmup (:func:`lr_factor`, :func:`rank_batch_size`).

Each field is declared once, with its default and its help (:func:`moec.flags.option`);
:func:`add_flags` makes ``moec train``'s flags from them (:mod:`moec.flags`: ``--batch-size``
sets ``batch_size``, a field that defaults to True is turned off by ``--no-...``) and
:func:`from_flags` reads them back, so a flag's default is its field's. This module imports no
torch at import time (``moec train --help`` reads it).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import moec.flags as flags
from moec.errors import MoecError
from moec.flags import option
from moec.train.routing_health import COLLAPSE_POLICIES, LASTING, PATIENCE

if typing.TYPE_CHECKING:
    import torch

    from moec.plan import ParallelPlan

CHECKPOINT_ERROR_POLICIES = ("stop", "continue")
NO_DECAY_KINDS = ("embeddings", "norms", "biases", "lm_head")
"""What ``TrainConfig.no_decay`` (``--no-decay``) may name: embedding tables, norm scales (the
other 1-D parameters), biases (of linears), the LM head's weight (the linear whose logits the
loss reads)."""
FRESH_INIT = "fresh"
"""``TrainConfig.init_from`` (``--init-from``) for freshly initialized dense tensors."""
DATA_DTYPES = ("uint16", "uint32")

SECTIONS = {
    "data": "your own tokens (see moec.corpus)",
    "eval": "held-out evaluation (see moec.train.evaluation)",
    "trainer": "trainer",
}
"""The sections of ``moec train --help`` a field's flag may be listed in (besides the first)."""


DEFAULT_BATCH_SIZE = 8
"""``TrainConfig.batch_size`` where neither it nor the plan's ``parallel.microbatch_size`` is
given."""


class TrainConfigError(MoecError):
    """A TrainConfig field (a ``moec train`` flag) out of its accepted range."""


@dataclasses.dataclass
class TrainConfig:
    """A training run's settings; each field's help says what it does (``moec train --help``)."""

    steps: int = option(
        100,
        "the run's last step; the learning-rate schedule is planned over it when the run starts "
        "and kept by a --resume with other --steps (see --replan-schedule)",
    )
    batch_size: int | None = option(
        None,
        "sequences per optimizer step on each data-parallel rank (split into "
        "plan.parallel.microbatches); default: the plan's parallel.microbatches x "
        f"parallel.microbatch_size where it fixes one, else {DEFAULT_BATCH_SIZE}",
    )
    seq_len: int = option(128, "tokens per sequence")
    lr: float = option(
        3e-3,
        "peak learning rate of the warmup-stable-decay schedule (set for the small demo models; "
        "the benchmarks train at 1e-4: at high rates the router can collapse onto few experts)",
        section="trainer",
    )
    min_lr_ratio: float = option(
        0.1, "final learning rate of the decay phase, as a fraction of --lr", section="trainer"
    )
    warmup_steps: int = option(20, "linear learning-rate warmup steps", section="trainer")
    decay_fraction: float = option(
        0.2,
        "share of the steps spent in the final linear decay of the learning rate",
        section="trainer",
    )
    weight_decay: float = option(
        0.1, "AdamW weight decay (of the parameters --no-decay leaves)", section="trainer"
    )
    betas: tuple[float, float] | str = option(
        (0.9, 0.95), "AdamW's beta1,beta2", section="trainer", metavar="B1,B2"
    )
    grad_clip: float = option(1.0, "gradients are clipped to this global norm", section="trainer")
    log_every: int = option(10, "steps between log points (progress, metrics.jsonl)")
    checkpoint_every: int = option(0, "steps between checkpoints; 0: only at the end")
    keep_checkpoints: int = option(3, "committed checkpoints kept on disk (the newest ones)")
    on_checkpoint_error: str = option(
        "stop",
        "a checkpoint that cannot be written (or is predicted not to fit): stop the run after "
        "writing its summary, or report it and continue",
        choices=CHECKPOINT_ERROR_POLICIES,
    )
    max_nonfinite_steps: int = option(
        5, "consecutive steps with a non-finite loss or gradient norm (skipped) that stop the run"
    )
    on_router_collapse: str = option(
        "warn",
        f"an MoE block routing most tokens to a few experts for {PATIENCE} log points and "
        f"{LASTING} steps in a row, past twice the warmup (moec.train.routing_health): warn once "
        "per block, stop the run (after writing its summary), or ignore it",
        choices=COLLAPSE_POLICIES,
    )
    warmup_log_steps: int = option(
        2, "first steps left out of the steady-state timing (capture, first allocations)"
    )
    out: str = option("runs/train", "run directory", metavar="DIR")
    seed: int = option(0, "seeds the model, data and routing")
    device: str = option(
        "auto", "auto (CUDA where available), cpu, cuda or cuda:N", metavar="DEVICE"
    )
    synthetic: bool = option(False, "random tokens instead of text")
    resume: bool = option(False, "continue this run from its newest checkpoint")
    replan_schedule: bool = option(
        False,
        "on a --resume with other --steps than the run planned: re-plan the learning-rate "
        "schedule over the new --steps (the rate moves to where the new schedule is at the "
        "resumed step); without it the planned schedule is kept: steps past its end train at "
        "its final rate, and a run stopped before its end has not finished its decay",
    )
    force: bool = option(
        False,
        "resume a run whose settings differ, or start a new run over another run's "
        "checkpoints (which it removes)",
    )
    plots: bool = option(
        True, "write the run's PNG plots (where matplotlib is installed); --no-plots: none"
    )
    memory_limit_gib: float | None = option(
        None,
        "refuse a plan whose predicted per-rank memory (moec.analysis.rank_memory) exceeds "
        "this many GiB, before any parameter is allocated; default: the GPU's memory on CUDA, "
        "no check on the CPU",
        metavar="GIB",
    )
    init_from: str | None = option(
        None,
        "a dense checkpoint of the model (save_pretrained folder, .safetensors or torch state "
        "dict file) to upcycle from, or 'fresh' (a folder of that name: ./fresh) for dense "
        "tensors freshly drawn from --seed module by module, the same at every layout "
        "(moec.runtime.materialize.FreshInit); the model is then built on the meta device and "
        "each rank builds only its part",
        metavar="PATH|fresh",
    )
    data: str | None = option(
        None,
        "your own tokens: PATH[:WEIGHT],... of token files (.bin, .npy; globs and folders) or "
        "datasets save_to_disk folders, or a .json/.yaml data spec (moec.corpus); default: the "
        "offline text (or --synthetic)",
        section="data",
        metavar="SPEC",
    )
    data_dtype: str = option(
        "uint16",
        "token ids of raw .bin (and header-less .npy) files",
        section="data",
        choices=DATA_DTYPES,
    )
    tokenizer: str | None = option(
        None,
        "a transformers tokenizer (name or folder) for datasets folders in --data",
        section="data",
        metavar="NAME_OR_PATH",
    )
    text_column: str = option(
        "text", "the documents' column in datasets folders", section="data", metavar="NAME"
    )
    prefetch: int = option(
        2,
        "batches loaded ahead by a background thread (pinned on CUDA); 0: in the step",
        section="data",
    )
    batch_warmup: tuple[tuple[int, int], ...] | str = option(
        (),
        "batch-size warmup: global batch sizes (over all data-parallel ranks) from the given "
        "steps, e.g. 8:0,16:100,32:300; the last must be --batch-size x data-parallel ranks; "
        "the learning rate scales by sqrt(batch / first batch); default: --batch-size "
        "throughout",
        section="trainer",
        metavar="B:STEP,...",
    )
    spike_sigma: float = option(
        0.0,
        "skip a step whose loss or gradient norm exceeds the mean of the last --spike-window "
        "steps by more than this many standard deviations (skip-step AdamW; 6 is usual); 0: off",
        section="trainer",
    )
    spike_window: int = option(
        128, "steps whose losses and gradient norms the spike statistics cover", section="trainer"
    )
    spike_min_steps: int = option(
        64,
        "steps recorded before a spike can be skipped (the statistics need a history)",
        section="trainer",
    )
    z_loss: float = option(
        0.0,
        "LM-head z-loss coefficient (e.g. 1e-4): z_loss x mean(logsumexp(logits)^2) is added to "
        "the loss; it reads the logits, so the fused_loss pass leaves the head unfused; 0: off",
        section="trainer",
    )
    no_decay: tuple[str, ...] | str = option(
        ("embeddings", "norms", "biases"),
        f"parameters trained without weight decay: any of {','.join(NO_DECAY_KINDS)}",
        section="trainer",
        metavar="KINDS",
    )
    eval_every: int = option(
        0,
        "evaluate on held-out data every N steps and at the run's last step, in eval mode, the "
        "LM loss without router losses (eval_loss in metrics.jsonl, summary.json, loss.png; "
        "each is also a log point); 0: off",
        section="eval",
    )
    eval_batches: int = option(
        8,
        "fixed held-out batches of --batch-size sequences one evaluation reads, shared out over "
        "the data-parallel ranks",
        section="eval",
    )
    eval_data: str | None = option(
        None,
        "held-out tokens, as --data (a moec data build folder: its eval split); default: the "
        "training data's held-out split (a built corpus's eval split, the offline text's last "
        "5%), none for --synthetic or other --data",
        section="eval",
        metavar="SPEC",
    )
    profile: str | None = option(
        None,
        "profile steps START..START+STEPS-1 (moec.runtime.profiling): a torch.profiler trace "
        "(Perfetto) and NVTX ranges by block and op (nsys --capture-range=cudaProfilerApi) into "
        "OUT/profile",
        metavar="START:STEPS",
    )

    def __post_init__(self) -> None:
        if self.batch_size is not None:
            _check_at_least("batch_size", self.batch_size, 1)
        at_least = {
            "steps": 1,
            "seq_len": 2,
            "log_every": 1,
            "checkpoint_every": 0,
            "keep_checkpoints": 1,
            "max_nonfinite_steps": 1,
            "warmup_log_steps": 0,
            "warmup_steps": 0,
            "eval_every": 0,
            "eval_batches": 1,
        }
        for name, minimum in at_least.items():
            _check_at_least(name, getattr(self, name), minimum)
        if self.on_checkpoint_error not in CHECKPOINT_ERROR_POLICIES:
            raise TrainConfigError(
                f"{flag_of('on_checkpoint_error')} = {self.on_checkpoint_error!r}: must be one of "
                f"{', '.join(CHECKPOINT_ERROR_POLICIES)}"
            )
        if self.on_router_collapse not in COLLAPSE_POLICIES:
            raise TrainConfigError(
                f"{flag_of('on_router_collapse')} = {self.on_router_collapse!r}: must be one of "
                f"{', '.join(COLLAPSE_POLICIES)}"
            )
        resolve_device(self.device)
        if self.profile:
            from moec.runtime.profiling import ProfileWindow

            ProfileWindow.parse(self.profile).check(self.steps)
        self._check_data_and_trainer()

    def _check_data_and_trainer(self) -> None:
        if self.data is not None and self.synthetic:
            raise TrainConfigError(
                f"{flag_of('data')} and {flag_of('synthetic')}: give one of them"
            )
        if self.data_dtype not in DATA_DTYPES:
            raise TrainConfigError(
                f"{flag_of('data_dtype')} = {self.data_dtype!r}: must be uint16 or uint32"
            )
        for name in ("prefetch", "spike_min_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise TrainConfigError(f"{flag_of(name)} = {value!r}: must be an integer >= 0")
        if not isinstance(self.spike_window, int) or self.spike_window < 2:
            raise TrainConfigError(
                f"{flag_of('spike_window')} = {self.spike_window!r}: must be an integer >= 2"
            )
        for name in ("spike_sigma", "z_loss", "weight_decay"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise TrainConfigError(f"{flag_of(name)} = {value!r}: must be a number >= 0")
        if not isinstance(self.lr, (int, float)) or not math.isfinite(self.lr) or self.lr <= 0:
            raise TrainConfigError(f"{flag_of('lr')} = {self.lr!r}: must be a number > 0")
        if not isinstance(self.grad_clip, (int, float)) or not self.grad_clip > 0:
            raise TrainConfigError(
                f"{flag_of('grad_clip')} = {self.grad_clip!r}: must be a number > 0"
            )
        self.betas = _parse_betas(self.betas)
        for name in ("min_lr_ratio", "decay_fraction"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise TrainConfigError(f"{flag_of(name)} = {value!r}: must be in [0, 1]")
        if isinstance(self.no_decay, str):
            self.no_decay = tuple(k.strip() for k in self.no_decay.split(",") if k.strip())
        unknown = [k for k in self.no_decay if k not in NO_DECAY_KINDS]
        if unknown:
            raise TrainConfigError(
                f"{flag_of('no_decay')} = {','.join(self.no_decay)!r}: {', '.join(unknown)} "
                f"unknown; accepted: {', '.join(NO_DECAY_KINDS)} (comma-separated)"
            )
        self.no_decay = tuple(self.no_decay)
        self.batch_warmup = parse_batch_warmup(self.batch_warmup)
        if self.eval_data is not None and not self.eval_every:
            raise TrainConfigError(
                f"{flag_of('eval_data')} = {self.eval_data!r} is read at eval points only: set "
                f"{flag_of('eval_every')} (e.g. 100)"
            )


def _check_at_least(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or value < minimum:
        raise TrainConfigError(f"{flag_of(name)} = {value!r}: must be an integer >= {minimum}")


def batch_per_rank(batch_size: int | None, parallel: ParallelPlan) -> int:
    """Sequences per optimizer step on each data-parallel rank, ``parallel.microbatches``
    microbatches of ``parallel.microbatch_size``: ``batch_size`` (``--batch-size``) where
    given, else the plan's (microbatches x microbatch_size), else :data:`DEFAULT_BATCH_SIZE`.
    A given size must split into the microbatches and, where the plan fixes the microbatch
    size (``moec plan auto`` priced memory and time at it), be that size's batch
    (:class:`TrainConfigError` naming both fields and the size accepted)."""
    micro, size = parallel.microbatches, parallel.microbatch_size
    if batch_size is None:
        return DEFAULT_BATCH_SIZE if size is None else micro * size
    if size is not None and batch_size != micro * size:
        raise TrainConfigError(
            f"{flag_of('batch_size')} = {batch_size} contradicts the plan's "
            f"parallel.microbatch_size = {size} x parallel.microbatches = {micro}: give "
            f"--batch-size {micro * size} or none (the plan's), or set "
            "parallel.microbatch_size to null in the plan"
        )
    if batch_size % micro:
        raise TrainConfigError(
            f"{flag_of('batch_size')} = {batch_size}: must be divisible by "
            f"parallel.microbatches = {micro}"
        )
    return batch_size


def flag(field: str) -> str:
    """The ``moec train`` flag that sets the TrainConfig field ``field``: ``--no-plots`` for a
    field that defaults to True, else ``--`` and the name with dashes (:func:`moec.flags.flag`)."""
    return flags.flag(TrainConfig, field)


def flag_of(field: str) -> str:
    """A TrainConfig field with the ``moec train`` flag that sets it, for error messages."""
    return f"TrainConfig.{field} ({flag(field)})"


def add_flags(
    parser: argparse.ArgumentParser,
    fields: Iterable[str] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """Add to ``parser`` the flag of each TrainConfig field (``fields``; None: every one), in
    the field's help section (:data:`SECTIONS`), its default the field's (or
    ``defaults[name]``, for ``moec demo``'s recipe) (:func:`moec.flags.add_flags`). A field
    that also takes a string (``--no-decay``, ``--batch-warmup``, ``--betas``) is given as one,
    which TrainConfig parses."""
    flags.add_flags(parser, TrainConfig, fields, defaults, SECTIONS)


def from_flags(args: argparse.Namespace, **fixed: Any) -> TrainConfig:
    """The TrainConfig of the flags :func:`add_flags` added to ``args``'s parser, over the
    fields ``fixed`` (those the command has no flag for)."""
    return flags.from_flags(TrainConfig, args, **fixed)


def _parse_betas(betas: tuple[float, float] | str) -> tuple[float, float]:
    """``"0.9,0.95"`` or (0.9, 0.95) as a pair of floats in [0, 1)."""
    where = f"{flag_of('betas')} = {betas!r}"
    parts = betas.split(",") if isinstance(betas, str) else list(betas)
    try:
        pair = tuple(float(b) for b in parts)
    except (TypeError, ValueError):
        raise TrainConfigError(f"{where}: must be two numbers B1,B2 (e.g. 0.9,0.95)") from None
    if len(pair) != 2 or not all(0 <= b < 1 for b in pair):
        raise TrainConfigError(f"{where}: must be two numbers B1,B2 in [0, 1) (e.g. 0.9,0.95)")
    return pair


def resolve_device(name: str) -> torch.device:
    """``auto`` (CUDA where available), ``cpu``, ``cuda`` or ``cuda:N``; a device this machine
    does not have is a :class:`TrainConfigError`."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise TrainConfigError(
            f"{flag_of('device')} = {name!r}: not a device name; use auto, cpu or cuda"
        ) from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrainConfigError(
            f"{flag_of('device')} = {name!r}: CUDA is not available on this machine; use "
            "--device cpu (or auto)"
        )
    if device.type not in ("cpu", "cuda"):
        raise TrainConfigError(f"{flag_of('device')} = {name!r}: use auto, cpu or cuda")
    return device


def wsd_schedule(cfg: TrainConfig, steps: int | None = None) -> Callable[[int], float]:
    """The warmup-stable-decay factor at each step, planned over ``steps`` (default
    ``cfg.steps``): linear warmup over ``warmup_steps``, 1, then a linear decay to
    ``min_lr_ratio`` over the last ``decay_fraction`` of the steps; ``min_lr_ratio`` after."""
    steps = cfg.steps if steps is None else steps
    decay_steps = max(1, int(steps * cfg.decay_fraction))
    decay_start = steps - decay_steps

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if step < decay_start:
            return 1.0
        progress = (step - decay_start) / decay_steps
        return 1.0 - (1.0 - cfg.min_lr_ratio) * min(progress, 1.0)

    return factor


def parse_batch_warmup(schedule: str | tuple | list) -> tuple[tuple[int, int], ...]:
    """``"8:0,16:100"`` or ((8, 0), (16, 100)) as ((batch, from_step), ...), checked: the first
    from step 0, steps and batches increasing."""
    where = f"{flag_of('batch_warmup')} = {schedule!r}"
    if isinstance(schedule, str):
        pairs = []
        for entry in filter(None, (e.strip() for e in schedule.split(","))):
            batch, sep, step = entry.partition(":")
            try:
                pairs.append((int(batch), int(step)))
            except ValueError:
                raise TrainConfigError(
                    f"{where}: {entry!r} is not BATCH:FROM_STEP (e.g. 8:0,16:100,32:300)"
                ) from None
            if not sep:
                raise TrainConfigError(f"{where}: {entry!r} is not BATCH:FROM_STEP")
    else:
        pairs = [tuple(p) for p in schedule]
    if not pairs:
        return ()
    if not all(len(p) == 2 and all(isinstance(v, int) for v in p) for p in pairs):
        raise TrainConfigError(f"{where}: must be (batch, from_step) integer pairs")
    if pairs[0][1] != 0:
        raise TrainConfigError(f"{where}: the first batch size must start at step 0")
    for (b0, s0), (b1, s1) in zip(pairs, pairs[1:]):
        if not (s1 > s0 and b1 > b0):
            raise TrainConfigError(
                f"{where}: batch sizes and their steps must increase ({b0}:{s0} then {b1}:{s1})"
            )
    if pairs[0][0] < 1:
        raise TrainConfigError(f"{where}: batch sizes must be >= 1")
    return tuple(pairs)


def global_batch_at(cfg: TrainConfig, step: int, dp: int) -> int:
    """Sequences in optimizer step ``step`` over all ``dp`` data-parallel ranks."""
    size = cfg.batch_size * dp
    for batch, start in cfg.batch_warmup:
        if step >= start:
            size = batch
    return size


def rank_batch_size(cfg: TrainConfig, dp: int) -> int | Callable[[int], int]:
    """The batch each of ``dp`` data-parallel ranks reads: ``batch_size``, or a function of the
    step under batch-size warmup."""
    if not cfg.batch_warmup:
        return cfg.batch_size
    return lambda step: global_batch_at(cfg, step, dp) // dp


def check_batch_warmup(cfg: TrainConfig, microbatches: int, dp: int) -> None:
    """Every warmup batch splits into ``microbatches`` on each of ``dp`` ranks, and the last is
    the run's batch (``batch_size`` per rank)."""
    if not cfg.batch_warmup:
        return
    where = f"{flag_of('batch_warmup')} = {_format_warmup(cfg.batch_warmup)!r}"
    for batch, _ in cfg.batch_warmup:
        if batch % (microbatches * dp):
            raise TrainConfigError(
                f"{where}: batch {batch} is not divisible by parallel.microbatches x "
                f"data-parallel ranks = {microbatches} x {dp}; use multiples of "
                f"{microbatches * dp}"
            )
    last = cfg.batch_warmup[-1][0]
    if last != cfg.batch_size * dp:
        raise TrainConfigError(
            f"{where}: the last batch ({last}) must be the run's global batch, "
            f"{flag_of('batch_size')} x data-parallel ranks = {cfg.batch_size} x {dp} = "
            f"{cfg.batch_size * dp}"
        )


def _format_warmup(schedule: tuple[tuple[int, int], ...]) -> str:
    return ",".join(f"{b}:{s}" for b, s in schedule)


def lr_factor(cfg: TrainConfig, steps: int | None = None) -> Callable[[int], float]:
    """The learning rate's factor at each step: the WSD schedule planned over ``steps``
    (default ``cfg.steps``), times sqrt(batch / first batch) under batch-size warmup (``lr`` is
    the first batch's rate)."""
    wsd = wsd_schedule(cfg, steps)
    if not cfg.batch_warmup:
        return wsd
    base = cfg.batch_warmup[0][0]

    def factor(step: int) -> float:
        return wsd(step) * math.sqrt(global_batch_at(cfg, step, 1) / base)

    return factor
