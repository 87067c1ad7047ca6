"""Builders shared by the unit tiers."""

from __future__ import annotations

from typing import Any

from trainer_runtime.callbacks import TrainerCallback

__all__ = ["StopAt"]


class StopAt(TrainerCallback):
    """Save and stop at ``step``: an interruption without a signal."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.step:
            control.should_save = True
            control.should_training_stop = True
