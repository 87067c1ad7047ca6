from __future__ import annotations

import io
import logging
from types import SimpleNamespace

import pytest

from trainer_runtime.callbacks import PrinterCallback
from trainer_runtime.features.progress import (
    ProgressCallback,
    progress_callback,
    resolve_disable_tqdm,
)
from trainer_runtime.state import TrainerControl, TrainerState


@pytest.mark.parametrize(
    ("value", "level", "expected"),
    [
        (None, logging.WARNING, False),
        (None, logging.INFO, False),
        (None, logging.ERROR, True),
        (None, logging.CRITICAL, True),
        (True, logging.INFO, True),
        (False, logging.ERROR, False),
    ],
)
def test_resolve_disable_tqdm(value, level, expected):
    assert resolve_disable_tqdm(value, level) is expected


def test_progress_callback_choice():
    assert progress_callback(False) is ProgressCallback
    assert progress_callback(True) is PrinterCallback


def test_progress_bars_and_logs():
    out = io.StringIO()
    cb = ProgressCallback(file=out)
    args = SimpleNamespace()
    state, control = TrainerState(max_steps=3), TrainerControl()
    cb.on_train_begin(args, state, control)
    for step in (1, 2, 3):
        state.global_step = step
        cb.on_step_end(args, state, control)
    cb.on_log(args, state, control, logs={"loss": 0.5, "epoch": 1.23456, "total_flos": 9.0})
    loader = [0, 1]
    for _ in loader:
        cb.on_prediction_step(args, state, control, eval_dataloader=loader)
    assert cb.prediction_bar.n == 2 and cb.prediction_bar.total == 2
    cb.on_evaluate(args, state, control, metrics={})
    assert cb.prediction_bar is None
    assert cb.training_bar.n == 3
    cb.on_train_end(args, state, control)
    text = out.getvalue()
    assert "3/3" in text
    assert "{'loss': 0.5, 'epoch': 1.23}" in text
    assert "total_flos" not in text


def test_progress_resumed_run_starts_at_global_step():
    out = io.StringIO()
    cb = ProgressCallback(file=out)
    state = TrainerState(max_steps=10, global_step=4)
    cb.on_train_begin(SimpleNamespace(), state, TrainerControl())
    state.global_step = 5
    cb.on_step_end(SimpleNamespace(), state, TrainerControl())
    assert cb.training_bar.n == 5
    cb.on_train_end(SimpleNamespace(), state, TrainerControl())


def test_no_bars_off_rank_zero():
    out = io.StringIO()
    cb = ProgressCallback(file=out)
    state = TrainerState(max_steps=3, is_world_process_zero=False)
    cb.on_train_begin(SimpleNamespace(), state, TrainerControl())
    cb.on_prediction_step(SimpleNamespace(), state, TrainerControl())
    cb.on_log(SimpleNamespace(), state, TrainerControl(), logs={"loss": 1.0})
    cb.on_train_end(SimpleNamespace(), state, TrainerControl())
    assert out.getvalue() == ""
