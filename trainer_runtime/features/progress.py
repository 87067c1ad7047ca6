"""Progress bars (tqdm) for training and evaluation, and the ``disable_tqdm`` decision."""

from __future__ import annotations

import logging
from collections.abc import Sized
from typing import Any, TextIO

from tqdm.auto import tqdm

from trainer_runtime.callbacks import PrinterCallback, TrainerCallback
from trainer_runtime.state import TrainerControl, TrainerState

__all__ = ["ProgressCallback", "progress_callback", "resolve_disable_tqdm"]


def resolve_disable_tqdm(disable_tqdm: bool | None, effective_log_level: int) -> bool:
    """An explicit value wins. Unset: bars are hidden only when the log level of the main process
    is quieter than warning (error, critical), as in the Hugging Face Trainer."""
    if disable_tqdm is not None:
        return bool(disable_tqdm)
    return effective_log_level > logging.WARNING


def progress_callback(disable_tqdm: bool) -> type[TrainerCallback]:
    """The callback class that reports progress: bars, or printed log lines without them."""
    return PrinterCallback if disable_tqdm else ProgressCallback


class ProgressCallback(TrainerCallback):
    """A bar over the optimizer steps, one over evaluation batches, logs written above the bar.

    Only the world process zero draws. ``file`` defaults to stderr (tqdm's default).
    """

    def __init__(self, file: TextIO | None = None, max_str_len: int = 100) -> None:
        self.file = file
        self.max_str_len = max_str_len
        self.training_bar: Any = None
        self.prediction_bar: Any = None
        self.current_step = 0

    def on_train_begin(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        if state.is_world_process_zero:
            self.training_bar = tqdm(
                total=state.max_steps, initial=state.global_step, dynamic_ncols=True, file=self.file
            )
        self.current_step = state.global_step

    def on_step_end(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        if state.is_world_process_zero and self.training_bar is not None:
            self.training_bar.update(state.global_step - self.current_step)
        self.current_step = state.global_step

    def on_prediction_step(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        loader = kw.get("eval_dataloader")
        if not state.is_world_process_zero:
            return
        if self.prediction_bar is None:
            total = len(loader) if isinstance(loader, Sized) else None
            self.prediction_bar = tqdm(
                total=total,
                leave=self.training_bar is None,
                dynamic_ncols=True,
                file=self.file,
                desc="eval",
            )
        self.prediction_bar.update(1)

    def _close_prediction_bar(self, state: TrainerState) -> None:
        if state.is_world_process_zero and self.prediction_bar is not None:
            self.prediction_bar.close()
        self.prediction_bar = None

    def on_evaluate(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        self._close_prediction_bar(state)

    def on_predict(self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        self._close_prediction_bar(state)

    def on_log(self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        if not state.is_world_process_zero or self.training_bar is None:
            return
        shown: dict[str, Any] = {}
        for key, value in (kw.get("logs") or {}).items():
            if key == "total_flos":
                continue
            if key == "epoch" and isinstance(value, float):
                value = round(value, 2)
            text = str(value)
            shown[key] = value if len(text) <= self.max_str_len else f"[{len(text)} chars]"
        self.training_bar.write(str(shown), file=self.file)

    def on_train_end(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        if state.is_world_process_zero and self.training_bar is not None:
            self.training_bar.close()
        self.training_bar = None
