"""Small user-facing helpers and result types (Hugging Face names)."""

from __future__ import annotations

import copy
import os
import random
from enum import StrEnum
from typing import Any, NamedTuple

import numpy as np
import torch

from trainer_runtime.checkpoint.layout import CheckpointStore

# One EvalPrediction for the whole package: the evaluation loop's (iterates over present fields).
from trainer_runtime.features.evaluation import EvalPrediction

__all__ = [
    "BestRun",
    "EvalPrediction",
    "HPSearchBackend",
    "PredictionOutput",
    "TrainOutput",
    "default_compute_objective",
    "default_hp_space_optuna",
    "enable_full_determinism",
    "get_last_checkpoint",
    "set_seed",
]


class PredictionOutput(NamedTuple):
    predictions: Any
    label_ids: Any
    metrics: dict[str, float] | None


class TrainOutput(NamedTuple):
    """What ``Trainer.train`` returns."""

    global_step: int
    training_loss: float
    metrics: dict[str, float]


def get_last_checkpoint(folder: str | os.PathLike[str]) -> str | None:
    """The newest *complete* ``checkpoint-<step>`` directory under ``folder``, or None.

    transformers' function of this name returns the highest-numbered directory even when its save
    was cut short (a preempted save leaves one behind); this one applies the completeness rule of
    ``checkpoint.layout`` and skips such directories, so that the examples' "resume from the last
    checkpoint" block never resumes from a partial write. ``folder`` may be an fsspec URL.
    """
    text = os.fspath(folder)
    store = CheckpointStore(text)
    if not store.storage.isdir(""):
        raise FileNotFoundError(f"get_last_checkpoint: {text!r} is not a directory")
    info = store.latest_complete()
    if info is None:
        return None
    return info.path if "://" in text else os.path.join(text, info.name)


class BestRun(NamedTuple):
    """The best trial of ``Trainer.hyperparameter_search``: its id (its checkpoints are under
    ``<output_dir>/run-<run_id>``), its objective (a list for several directions) and the
    hyperparameters it used."""

    run_id: str
    objective: float | list[float]
    hyperparameters: dict[str, Any]
    run_summary: Any | None = None


class HPSearchBackend(StrEnum):
    """Hyperparameter search backends known to transformers (this runtime runs ``optuna``)."""

    OPTUNA = "optuna"
    RAY = "ray"
    WANDB = "wandb"


def default_compute_objective(metrics: dict[str, float]) -> float:
    """The objective of a trial without ``compute_objective``: ``eval_loss`` when evaluation
    reports nothing else, else the sum of the other metrics (epoch and speed metrics left out)."""
    rest = copy.deepcopy(metrics)
    loss = rest.pop("eval_loss", None)
    rest.pop("epoch", None)
    for key in [k for k in rest if k.endswith("_runtime") or k.endswith("_per_second")]:
        rest.pop(key)
    if not rest:
        return loss  # type: ignore[return-value]
    return sum(rest.values())


def default_hp_space_optuna(trial: Any) -> dict[str, float]:
    """The search space used when ``hyperparameter_search`` gets no ``hp_space`` (transformers'
    default ranges)."""
    return {
        "learning_rate": trial.suggest_float("learning_rate", 1e-6, 1e-4, log=True),
        "num_train_epochs": trial.suggest_int("num_train_epochs", 1, 5),
        "seed": trial.suggest_int("seed", 1, 40),
        "per_device_train_batch_size": trial.suggest_categorical(
            "per_device_train_batch_size", [4, 8, 16, 32, 64]
        ),
    }


def set_seed(seed: int, deterministic: bool = False) -> None:
    """Seed python, numpy and torch (all devices); optionally force deterministic kernels."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if deterministic:
        enable_full_determinism()


def enable_full_determinism() -> None:
    """Deterministic algorithms everywhere (slower; some ops then raise instead of racing)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    if torch.backends.cudnn.is_available():
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
