"""Small user-facing helpers and result types (Hugging Face names)."""

from __future__ import annotations

import os
import random
from typing import Any, NamedTuple

import numpy as np
import torch

# One EvalPrediction for the whole package: the evaluation loop's (iterates over present fields).
from trainer_runtime.features.evaluation import EvalPrediction

__all__ = [
    "EvalPrediction",
    "PredictionOutput",
    "TrainOutput",
    "enable_full_determinism",
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
