"""Stop training when the monitored metric stops improving (``EarlyStoppingCallback``).

After each evaluation, the metric ``metric_for_best_model`` (with or without ``eval_``) is compared
with ``state.best_metric``: it counts as an improvement when it is better in the direction of
``greater_is_better`` by more than ``early_stopping_threshold``. After ``early_stopping_patience``
evaluations in a row without improvement, ``control.should_training_stop`` is set.

The Trainer updates ``state.best_metric`` after the callbacks' ``on_evaluate`` (as Hugging Face
does), so the callback compares with the best *before* this evaluation.
"""

from __future__ import annotations

import logging
from typing import Any

from trainer_runtime.callbacks import TrainerCallback
from trainer_runtime.errors import ConfigurationError
from trainer_runtime.features.best import default_greater_is_better, is_better, metric_key
from trainer_runtime.state import TrainerControl, TrainerState

__all__ = ["EarlyStoppingCallback"]

logger = logging.getLogger(__name__)


class EarlyStoppingCallback(TrainerCallback):
    def __init__(self, early_stopping_patience: int = 1, early_stopping_threshold: float = 0.0):
        if early_stopping_patience < 1:
            raise ConfigurationError(
                f"early_stopping_patience={early_stopping_patience!r} must be >= 1 (evaluations "
                "without improvement before stopping)"
            )
        if early_stopping_threshold < 0:
            raise ConfigurationError(
                f"early_stopping_threshold={early_stopping_threshold!r} must be >= 0"
            )
        self.early_stopping_patience = early_stopping_patience
        self.early_stopping_threshold = early_stopping_threshold
        self.early_stopping_patience_counter = 0

    def on_train_begin(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        if not getattr(args, "load_best_model_at_end", False):
            logger.warning(
                "EarlyStoppingCallback without load_best_model_at_end=True: training stops early "
                "but the best weights are not loaded at the end"
            )
        if not getattr(args, "metric_for_best_model", None):
            raise ConfigurationError(
                "EarlyStoppingCallback needs metric_for_best_model (e.g. 'loss' or 'accuracy')"
            )
        if getattr(args, "eval_strategy", "no") == "no":
            raise ConfigurationError(
                "EarlyStoppingCallback needs evaluations: set eval_strategy to 'steps' or 'epoch'"
            )

    def _improved(self, args: Any, state: TrainerState, value: float) -> bool:
        greater = getattr(args, "greater_is_better", None)
        if greater is None:
            greater = default_greater_is_better(args.metric_for_best_model)
        if state.best_metric is None:
            return True
        return (
            is_better(value, state.best_metric, greater)
            and abs(value - state.best_metric) > self.early_stopping_threshold
        )

    def on_evaluate(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        metrics = kw.get("metrics") or {}
        key = metric_key(args.metric_for_best_model)
        value = metrics.get(key)
        if value is None:
            logger.warning(
                "early stopping needs %r in the evaluation metrics, which have %s: no decision "
                "for this evaluation",
                key,
                sorted(metrics),
            )
            return
        if self._improved(args, state, float(value)):
            self.early_stopping_patience_counter = 0
        else:
            self.early_stopping_patience_counter += 1
        if self.early_stopping_patience_counter >= self.early_stopping_patience:
            control.should_training_stop = True

    # Saved in trainer_state.json under stateful_callbacks, restored on resume.
    def state(self) -> dict[str, Any]:
        return {
            "args": {
                "early_stopping_patience": self.early_stopping_patience,
                "early_stopping_threshold": self.early_stopping_threshold,
            },
            "attributes": {"early_stopping_patience_counter": self.early_stopping_patience_counter},
        }

    @classmethod
    def from_state(cls, saved: dict[str, Any]) -> EarlyStoppingCallback:
        cb = cls(**saved.get("args", {}))
        for name, value in saved.get("attributes", {}).items():
            setattr(cb, name, value)
        return cb
