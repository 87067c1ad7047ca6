"""Trackers whose packages are optional: these run only where the package is installed.

wandb runs offline (no network, no account) and MLflow against a local file store.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer_runtime.state import TrainerControl, TrainerState
from trainer_runtime.training_args import TrainingArguments


def _drive(cb, args) -> None:
    state, control = TrainerState(), TrainerControl()
    cb.on_train_begin(args, state, control)
    for step, loss in [(1, 2.0), (2, 1.5)]:
        state.global_step = step
        cb.on_log(args, state, control, logs={"loss": loss, "eval_loss": loss + 1})


def test_wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    wandb = pytest.importorskip("wandb")
    from trainer_runtime.features.trackers import WandbCallback

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    args = TrainingArguments(output_dir=str(tmp_path / "out"))
    args.__dict__["run_name"] = "g-wandb"  # core arguments may not have the field yet
    args.__dict__["project"] = "g-project"
    cb = WandbCallback()
    _drive(cb, args)
    run = wandb.run
    assert run is not None and run.name == "g-wandb" and run.project == "g-project"
    assert run.summary["train/loss"] == 1.5 and run.summary["eval/loss"] == 2.5
    cb.on_train_end(args, TrainerState(), TrainerControl())
    assert wandb.run is None
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))


def test_mlflow_file_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    mlflow = pytest.importorskip("mlflow")
    from trainer_runtime.features.trackers import MLflowCallback

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # no database needed for the test
    args = TrainingArguments(output_dir=str(tmp_path / "out"))
    args.__dict__["run_name"] = "g-mlflow"
    cb = MLflowCallback()
    _drive(cb, args)
    cb.on_train_end(args, TrainerState(), TrainerControl())
    assert mlflow.active_run() is None
    client = mlflow.tracking.MlflowClient()
    run = client.get_run(cb.run_id)
    assert run.info.run_name == "g-mlflow"
    history = client.get_metric_history(cb.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(1, 2.0), (2, 1.5)]
    assert run.data.params["output_dir"] == str(tmp_path / "out")
