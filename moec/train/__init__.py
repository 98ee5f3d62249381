"""Training a compiled model: ``moec.train.train(model, plan, config)``, ``moec train``,
``moec demo``.

By subject: :mod:`~moec.train.config` (the settings), :mod:`~moec.train.objective` (the loss and
the optimizer's groups), :mod:`~moec.train.trainer` (one optimizer step, checkpoints, resume),
:mod:`~moec.train.loop` (log points, metrics, summary, the non-finite stop),
:mod:`~moec.train.evaluation` (held-out evaluation),
:mod:`~moec.train.timing` (step time apart from checkpoint writes), :mod:`~moec.train.run_lock`
(one run per run folder), :mod:`~moec.train.summary` (the end-of-run summary),
:mod:`~moec.train.cli` (the entry points).
"""

from moec.train.cli import DEMO_PLAN, cli_demo, cli_train, demo_model, train
from moec.train.config import TrainConfig, TrainConfigError, resolve_device, wsd_schedule
from moec.train.loop import NonFiniteError, TrainResult
from moec.train.objective import LanguageModelWithLoss, language_model_loss, parameter_groups
from moec.train.run_lock import RunLockError
from moec.train.trainer import CheckpointLoadError, MemoryPlanError, Trainer

__all__ = [
    "DEMO_PLAN",
    "CheckpointLoadError",
    "LanguageModelWithLoss",
    "MemoryPlanError",
    "NonFiniteError",
    "RunLockError",
    "TrainConfig",
    "TrainConfigError",
    "TrainResult",
    "Trainer",
    "cli_demo",
    "cli_train",
    "demo_model",
    "language_model_loss",
    "parameter_groups",
    "resolve_device",
    "train",
    "wsd_schedule",
]
