"""``TrainConfig``: a training run's settings, validated with errors that name the field and its
``moec train`` flag; the device, the warmup-stable-decay learning-rate schedule and the
batch-size warmup (:func:`lr_factor`, :func:`rank_batch_size`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from moec.errors import MoecError
from moec.runtime.profiling import ProfileWindow
from moec.train.routing_health import COLLAPSE_POLICIES

CHECKPOINT_ERROR_POLICIES = ("stop", "continue")
NO_DECAY_KINDS = ("embeddings", "norms", "biases", "lm_head")
"""What ``TrainConfig.no_decay`` (``--no-decay``) may name: embedding tables, norm scales (the
other 1-D parameters), biases (of linears), the LM head's weight (the linear whose logits the
loss reads)."""
FRESH_INIT = "fresh"
"""``TrainConfig.init_from`` (``--init-from``) for freshly initialized dense tensors."""


class TrainConfigError(MoecError):
    """A TrainConfig field (a ``moec train`` flag) out of its accepted range."""


@dataclasses.dataclass
class TrainConfig:
    steps: int = 200
    """The run's last step. The learning-rate schedule is planned over it when the run starts
    and kept by a resume with other ``steps`` (see ``replan_schedule``)."""
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
    on_router_collapse: str = "warn"
    """An MoE block whose router falls onto a few experts for several log points in a row
    (:mod:`moec.train.routing_health`): ``warn`` says so once per block, ``stop`` ends the run
    (after writing its summary), ``ignore`` says nothing."""
    warmup_log_steps: int = 2
    """Steps excluded from steady-state timing (capture, first-iteration allocations)."""
    out: str = "runs/train"
    seed: int = 0
    device: str = "auto"
    synthetic: bool = False
    resume: bool = False
    replan_schedule: bool = False
    """On a resume whose ``steps`` differ from the run's plan: re-plan the learning-rate schedule
    over the new ``steps`` (the rate moves to where the new schedule is at the resumed step).
    Without it the planned schedule is kept: steps past its end train at its final rate, and a
    run stopped before its end has not finished its decay."""
    force: bool = False
    """Resume a run whose identity differs, or start a new run over another run's checkpoints
    (which it removes)."""
    plots: bool = True
    memory_limit_gib: float | None = None
    """Refuse a plan whose predicted per-rank memory (:mod:`moec.analysis.rank_memory`) exceeds
    this, before any parameter is allocated from a checkpoint; None: the GPU's memory on CUDA,
    no check on the CPU."""
    init_from: str | None = None
    """A dense checkpoint of the model (a ``save_pretrained`` safetensors directory, a
    ``.safetensors`` file or a torch state dict file) to initialize the program from, or
    ``"fresh"`` (a checkpoint directory of that name: ``./fresh``) for freshly initialized
    dense tensors drawn from ``seed`` one module at a time, the same at every layout
    (:class:`moec.runtime.materialize.FreshInit`): the model is then given on the meta device
    and each rank builds only its part (:mod:`moec.runtime.materialize`)."""

    data: str | None = None
    """Your own tokens (``--data``): ``PATH[:WEIGHT],...`` of token files (``.bin``/``.npy``,
    globs, folders) or ``datasets`` save_to_disk folders, or a ``.json``/``.yaml`` data spec
    (:mod:`moec.corpus`); None: the offline text (or ``synthetic``)."""
    data_dtype: str = "uint16"
    """The ids of raw token files (``.bin``, header-less ``.npy``): uint16 or uint32."""
    tokenizer: str | None = None
    """A ``transformers`` tokenizer (name or folder) for ``datasets`` folders in ``data``."""
    text_column: str = "text"
    """The column of a ``datasets`` folder that holds the documents."""
    prefetch: int = 2
    """Batches loaded ahead by a background thread (pinned on CUDA); 0: in the step."""
    batch_warmup: tuple[tuple[int, int], ...] | str = ()
    """Batch-size warmup: (global batch, from step) pairs, or ``"8:0,16:100,32:300"``: batch 8
    (sequences over all data-parallel ranks) from step 0, 16 from step 100, ... The last must
    be ``batch_size`` x data-parallel ranks; the learning rate is scaled by
    sqrt(batch / first batch). Empty: ``batch_size`` throughout."""
    spike_sigma: float = 0.0
    """Skip a step whose loss or gradient norm exceeds the mean of the last ``spike_window``
    steps by more than this many standard deviations (skip-step AdamW; 6 is a usual value);
    0: off."""
    spike_window: int = 128
    """Steps whose losses and gradient norms the spike statistics cover."""
    spike_min_steps: int = 64
    """Steps recorded before a spike can be skipped (the statistics need a history)."""
    z_loss: float = 0.0
    """LM-head z-loss coefficient: ``z_loss * mean(logsumexp(logits) ** 2)`` is added to the
    loss; 0: off. It reads the logits, so the ``fused_loss`` pass leaves the head unfused."""
    no_decay: tuple[str, ...] | str = ("embeddings", "norms", "biases")
    """Parameters trained without weight decay: any of embeddings, norms, biases, lm_head (a
    tuple, or ``"embeddings,norms,lm_head"``)."""

    eval_every: int = 0
    """Evaluate on held-out data every this many steps and at the run's last step
    (:mod:`moec.train.evaluation`; each is also a log point); 0: off."""
    eval_batches: int = 8
    """The fixed held-out batches of ``batch_size`` sequences one evaluation reads, shared out
    over the data-parallel ranks."""
    eval_data: str | None = None
    """Held-out tokens, a ``data`` SPEC (a built corpus folder means its eval split); None: the
    held-out split of the training data where it has one (the eval split of a corpus ``moec
    data build`` wrote, the offline text's last 5%), else no evaluation."""

    profile: str | None = None
    """``START:STEPS``: profile steps START..START+STEPS-1 (:mod:`moec.runtime.profiling`): a
    torch.profiler trace and NVTX ranges by block and op, written to ``out/profile``."""

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
            "warmup_steps": 0,
            "eval_every": 0,
            "eval_batches": 1,
        }
        for name, minimum in at_least.items():
            value = getattr(self, name)
            if not isinstance(value, int) or value < minimum:
                raise TrainConfigError(
                    f"{flag_of(name)} = {value!r}: must be an integer >= {minimum}"
                )
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
            ProfileWindow.parse(self.profile).check(self.steps)
        self._check_data_and_trainer()

    def _check_data_and_trainer(self) -> None:
        if self.data is not None and self.synthetic:
            raise TrainConfigError(
                f"{flag_of('data')} and {flag_of('synthetic')}: give one of them"
            )
        if self.data_dtype not in ("uint16", "uint32"):
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


_CLI_FIELDS = frozenset(
    "steps batch_size seq_len log_every checkpoint_every keep_checkpoints on_checkpoint_error "
    "on_router_collapse "
    "device seed init_from max_nonfinite_steps memory_limit_gib profile data data_dtype tokenizer "
    "text_column prefetch batch_warmup spike_sigma spike_window spike_min_steps z_loss "
    "no_decay lr warmup_steps weight_decay out replan_schedule eval_every eval_batches "
    "eval_data".split()
)
"""TrainConfig fields that ``moec train`` sets from a flag of the same name."""


def flag_of(field: str) -> str:
    """A TrainConfig field, with the ``moec train`` flag that sets it where there is one."""
    flag = f" (--{field.replace('_', '-')})" if field in _CLI_FIELDS else ""
    return f"TrainConfig.{field}{flag}"


def resolve_device(name: str) -> torch.device:
    """``auto`` (CUDA where available), ``cpu``, ``cuda`` or ``cuda:N``; a device this machine
    does not have is a :class:`TrainConfigError`."""
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
