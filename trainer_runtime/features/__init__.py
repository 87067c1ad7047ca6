"""Trainer features: evaluation and prediction loop, best checkpoint, early stopping, trackers,
logging, progress, losses, precision and optimizers, with their arguments."""

from __future__ import annotations

from trainer_runtime._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "EvalPrediction": "evaluation",
        "EvalLoopOutput": "evaluation",
        "FeatureArguments": "arguments",
        "EarlyStoppingCallback": "early_stopping",
        "ProgressCallback": "progress",
        "TensorBoardCallback": "trackers",
        "WandbCallback": "trackers",
        "MLflowCallback": "trackers",
        "TrackioCallback": "trackers",
        "LabelSmoother": "losses",
    },
)
