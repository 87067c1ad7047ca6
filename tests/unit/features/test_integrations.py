from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainer_runtime.errors import ConfigurationError
from trainer_runtime.features.trackers import (
    IMPLEMENTED_INTEGRATIONS,
    TensorBoardCallback,
    default_tensorboard_dir,
    is_integration_available,
    normalize_report_to,
    reporting_callbacks,
    resolve_report_to,
    rewrite_logs,
)
from trainer_runtime.state import TrainerControl, TrainerState
from trainer_runtime.training_args import TrainingArguments


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, []),
        ("none", []),
        ([], []),
        (["none"], []),
        ("tensorboard", ["tensorboard"]),
        (["wandb", "tensorboard", "wandb"], ["wandb", "tensorboard"]),
        ("all", ["all"]),
        (["tensorboard", "all"], ["all"]),
    ],
)
def test_normalize_report_to(value, expected):
    assert normalize_report_to(value) == expected


@pytest.mark.parametrize(
    ("value", "match"), [("tensorbord", "unknown integration"), (["comet_ml"], "no 'comet_ml'")]
)
def test_normalize_report_to_rejects(value, match):
    with pytest.raises(ConfigurationError, match=match):
        normalize_report_to(value)


def test_all_means_installed_integrations():
    enabled, skipped = resolve_report_to("all")
    assert "tensorboard" in enabled  # a dev dependency
    assert enabled == [n for n in IMPLEMENTED_INTEGRATIONS if is_integration_available(n)]
    assert skipped == []


def test_missing_integration_is_skipped_with_a_clear_message(caplog):
    missing = [n for n in ("wandb", "mlflow", "trackio") if not is_integration_available(n)]
    if not missing:
        pytest.skip("every tracker package is installed here")
    with caplog.at_level(logging.WARNING, logger="trainer_runtime.features.trackers"):
        callbacks = reporting_callbacks(["tensorboard", missing[0]])
    assert [type(c).__name__ for c in callbacks] == ["TensorBoardCallback"]
    assert f"report_to includes {missing[0]!r}" in caplog.text
    assert "not installed" in caplog.text


@pytest.mark.parametrize(
    ("logs", "expected"),
    [
        ({"loss": 1.0, "learning_rate": 0.1}, {"train/loss": 1.0, "train/learning_rate": 0.1}),
        ({"eval_loss": 2.0, "test_acc": 0.5}, {"eval/loss": 2.0, "test/acc": 0.5}),
        ({"note": "x", "flag": True, "epoch": 1}, {"train/epoch": 1}),
    ],
)
def test_rewrite_logs(logs, expected):
    assert rewrite_logs(logs) == expected


def test_tensorboard_event_files_read_back(tmp_path: Path):
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none")
    state, control = TrainerState(), TrainerControl()
    cb = TensorBoardCallback(log_dir=str(tmp_path / "tb"))
    cb.on_train_begin(args, state, control)
    for step, loss in [(1, 2.5), (2, 2.0), (3, 1.25)]:
        state.global_step = step
        cb.on_log(args, state, control, logs={"loss": loss, "learning_rate": 0.01 * step})
    cb.on_log(args, state, control, logs={"eval_loss": 1.5, "eval_runtime": 0.1})
    cb.on_train_end(args, state, control)
    assert cb.writer is None

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = acc.Tags()
    assert {"train/loss", "train/learning_rate", "eval/loss", "eval/runtime"} <= set(
        tags["scalars"]
    )
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 2.5), (2, 2.0), (3, 1.25)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/loss")] == [(3, 1.5)]
    assert "args/text_summary" in tags["tensors"]


def test_tensorboard_only_on_world_process_zero(tmp_path: Path):
    cb = TensorBoardCallback(log_dir=str(tmp_path / "tb"))
    state = TrainerState(is_world_process_zero=False)
    args = SimpleNamespace(output_dir=str(tmp_path))
    cb.on_train_begin(args, state, TrainerControl())
    cb.on_log(args, state, TrainerControl(), logs={"loss": 1.0})
    assert cb.writer is None and not (tmp_path / "tb").exists()


def test_default_tensorboard_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    args = SimpleNamespace(output_dir=str(tmp_path), run_name="exp-1")
    assert default_tensorboard_dir(args) == str(tmp_path / "runs" / "exp-1")
    unnamed = default_tensorboard_dir(SimpleNamespace(output_dir=f"file://{tmp_path}"))
    assert unnamed.startswith(str(tmp_path / "runs") + "/")
    with pytest.raises(ConfigurationError, match="TENSORBOARD_LOGGING_DIR"):
        default_tensorboard_dir(SimpleNamespace(output_dir="s3://bucket/run"))
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "elsewhere"))
    assert default_tensorboard_dir(SimpleNamespace(output_dir="s3://bucket/run")) == str(
        tmp_path / "elsewhere"
    )
