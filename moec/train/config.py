"""``TrainConfig``: a training run's settings, validated with errors that name the field and its
``moec train`` flag; the device and the warmup-stable-decay learning-rate schedule."""

from __future__ import annotations

import dataclasses

import torch

from moec.errors import MoecError

CHECKPOINT_ERROR_POLICIES = ("stop", "continue")
FRESH_INIT = "fresh"
"""``TrainConfig.init_from`` (``--init-from``) for freshly initialized dense tensors."""


class TrainConfigError(MoecError):
    """A TrainConfig field (a ``moec train`` flag) out of its accepted range."""


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
                    f"{flag_of(name)} = {value!r}: must be an integer >= {minimum}"
                )
        if self.on_checkpoint_error not in CHECKPOINT_ERROR_POLICIES:
            raise TrainConfigError(
                f"{flag_of('on_checkpoint_error')} = {self.on_checkpoint_error!r}: must be one of "
                f"{', '.join(CHECKPOINT_ERROR_POLICIES)}"
            )
        resolve_device(self.device)


_CLI_FIELDS = frozenset(
    "steps batch_size seq_len log_every checkpoint_every keep_checkpoints on_checkpoint_error "
    "device seed init_from max_nonfinite_steps memory_limit_gib".split()
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
