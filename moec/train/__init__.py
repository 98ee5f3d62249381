"""Training a compiled model: ``moec.train.train(model, plan, config)``, ``moec train``,
``moec demo``.

By subject: :mod:`~moec.train.config` (the settings), :mod:`~moec.train.objective` (the loss and
the optimizer's groups), :mod:`~moec.train.trainer` (one optimizer step, checkpoints, resume),
:mod:`~moec.train.loop` (log points, metrics, summary, the non-finite stop),
:mod:`~moec.train.evaluation` (held-out evaluation),
:mod:`~moec.train.timing` (step time apart from checkpoint writes), :mod:`~moec.train.run_lock`
(one run per run folder), :mod:`~moec.train.summary` (the end-of-run summary),
:mod:`~moec.train.cli` (the entry points).

The names below are imported on first use (:mod:`moec.lazy`): ``moec train --help`` reads
:class:`~moec.train.config.TrainConfig` without importing torch.
"""

from moec.lazy import lazy_exports

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

__getattr__, __dir__ = lazy_exports(
    globals(),
    {
        **dict.fromkeys(
            ("DEMO_PLAN", "cli_demo", "cli_train", "demo_model", "train"), "moec.train.cli"
        ),
        **dict.fromkeys(
            ("TrainConfig", "TrainConfigError", "resolve_device", "wsd_schedule"),
            "moec.train.config",
        ),
        **dict.fromkeys(("NonFiniteError", "TrainResult"), "moec.train.loop"),
        **dict.fromkeys(
            ("LanguageModelWithLoss", "language_model_loss", "parameter_groups"),
            "moec.train.objective",
        ),
        "RunLockError": "moec.train.run_lock",
        **dict.fromkeys(
            ("CheckpointLoadError", "MemoryPlanError", "Trainer"), "moec.train.trainer"
        ),
    },
)
