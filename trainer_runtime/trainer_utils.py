"""Small user-facing helpers and result types (Hugging Face names)."""

from __future__ import annotations

import os
import random
from typing import Any, NamedTuple

import numpy as np
import torch

from trainer_runtime.checkpoint.layout import CheckpointStore

# One EvalPrediction for the whole package: the evaluation loop's (iterates over present fields).
from trainer_runtime.features.evaluation import EvalPrediction

__all__ = [
    "EvalPrediction",
    "PredictionOutput",
    "TrainOutput",
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
