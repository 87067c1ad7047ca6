"""preemptible trainer runtime: a Hugging Face style Trainer that survives preemption.

The public names are loaded lazily so that torch-free modules (``trainer_runtime.checkpoints``,
``trainer_runtime.grace``, ``trainer_runtime.protocol``) can be imported by the operator without
importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> module that defines it (filled in as modules land)
_EXPORTS: dict[str, str] = {
    # errors, checkpoints, storage, grace (torch-free)
    "TrainerRuntimeError": "errors",
    "ConfigurationError": "errors",
    "CheckpointError": "errors",
    "StorageError": "errors",
    "ResumeError": "errors",
    "Storage": "storage",
    "CheckpointInfo": "checkpoints",
    "CheckpointStore": "checkpoints",
    "is_complete": "checkpoints",
    "rotation_victims": "checkpoints",
    "grace_seconds": "grace",
    "GracePolicy": "grace",
    "GraceRecommendation": "grace",
    "recommend_grace": "grace",
    # checkpoint I/O (torch + safetensors)
    "CheckpointWriter": "checkpoint_io",
    "CheckpointReader": "checkpoint_io",
    "optimizer_state_to_tensors": "checkpoint_io",
    "optimizer_state_from_tensors": "checkpoint_io",
    "rotate_checkpoints": "checkpoint_io",
    # trainer core
    "Trainer": "trainer",
    "TrainingArguments": "training_args",
    "TrainerState": "state",
    "TrainerControl": "state",
    "TrainerCallback": "callbacks",
    "CallbackHandler": "callbacks",
    "DefaultFlowCallback": "callbacks",
    "PrinterCallback": "callbacks",
    # EvalPrediction iterates over present fields only (preds, labels = eval_pred) and has losses
    "EvalPrediction": "evaluation",
    # trainer features (evaluation, best model, trackers, progress, early stopping)
    "EvalLoopOutput": "evaluation",
    "FeatureArguments": "eval_args",
    "EarlyStoppingCallback": "early_stopping",
    "ProgressCallback": "progress",
    "TensorBoardCallback": "integrations",
    "WandbCallback": "integrations",
    "MLflowCallback": "integrations",
    "TrackioCallback": "integrations",
    "LabelSmoother": "losses",
    "TrainOutput": "trainer_utils",
    "set_seed": "trainer_utils",
    "default_data_collator": "data",
    "SigtermLatch": "signals",
    # data pipeline: length-based samplers, padding, NEFTune, column removal, dataloader args
    "LengthGroupedBatchSampler": "length_sampling",
    "BatchRebalanceBatchSampler": "length_sampling",
    "PaddingCollator": "collators",
    "RemoveColumnsCollator": "columns",
    "enable_neftune": "neftune",
    "activate_neftune": "neftune",
    "deactivate_neftune": "neftune",
    "DataArguments": "data_args",
    # distributed: DDP arguments, torchrun launcher, FSDP sharded checkpoints
    "DdpArguments": "ddp_args",
    "AcceleratorConfig": "ddp_args",
    "FsdpConfig": "fsdp",
    "shard_model": "fsdp",
    "save_sharded": "fsdp",
    "load_sharded": "fsdp",
    "FsdpArguments": "fsdp_args",
    "FsdpConfigArguments": "fsdp_args",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer_runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(f"trainer_runtime.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
