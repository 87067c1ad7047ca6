"""preemptible trainer runtime: a Hugging Face style Trainer that survives preemption.

Sub-packages by domain: ``checkpoint`` (storage seam, layout and completeness, writer and reader,
per-node copies, resharding, RNG), ``data`` (samplers, collators, columns, NEFTune, the data
arguments), ``distributed`` (collectives, DDP and FSDP arguments, FSDP, the torchrun launcher) and
``features`` (evaluation, best model, early stopping, trackers, logging, progress, losses,
precision, optimizers). The Trainer, its arguments, state, callbacks, signals, timings, the grace
rule and the operator contract (``protocol``) stay at the top.

Public names load lazily, so the torch-free modules the operator imports (``errors``, ``grace``,
``protocol``, ``checkpoint.storage``, ``checkpoint.layout``) never pull in torch.
"""

from __future__ import annotations

from trainer_runtime._lazy import lazy_exports

# public name -> module that defines it (filled in as modules land)
_EXPORTS: dict[str, str] = {
    # errors, checkpoints, storage, grace (torch-free)
    "TrainerRuntimeError": "errors",
    "ConfigurationError": "errors",
    "CheckpointError": "errors",
    "StorageError": "errors",
    "ResumeError": "errors",
    "CheckpointCorruptError": "errors",
    "Storage": "checkpoint.storage",
    "CheckpointInfo": "checkpoint.layout",
    "CheckpointStore": "checkpoint.layout",
    "is_complete": "checkpoint.layout",
    "rotation_victims": "checkpoint.layout",
    "grace_seconds": "grace",
    "GracePolicy": "grace",
    "GraceRecommendation": "grace",
    "recommend_grace": "grace",
    # checkpoint I/O (torch + safetensors)
    "CheckpointWriter": "checkpoint.io",
    "CheckpointReader": "checkpoint.io",
    "optimizer_state_to_tensors": "checkpoint.io",
    "optimizer_state_from_tensors": "checkpoint.io",
    "rotate_checkpoints": "checkpoint.io",
    # trainer core
    "Trainer": "trainer",
    "TrainingArguments": "training_args",
    # sequence-to-sequence: evaluate/predict through model.generate
    "Seq2SeqTrainer": "seq2seq",
    "Seq2SeqTrainingArguments": "training_args_seq2seq",
    "TrainerState": "state",
    "TrainerControl": "state",
    "TrainerCallback": "callbacks",
    "CallbackHandler": "callbacks",
    "DefaultFlowCallback": "callbacks",
    "PrinterCallback": "callbacks",
    # EvalPrediction iterates over present fields only (preds, labels = eval_pred) and has losses
    "EvalPrediction": "features.evaluation",
    # trainer features (evaluation, best model, trackers, progress, early stopping)
    "EvalLoopOutput": "features.evaluation",
    "FeatureArguments": "features.arguments",
    "EarlyStoppingCallback": "features.early_stopping",
    "ProgressCallback": "features.progress",
    "TensorBoardCallback": "features.trackers",
    "WandbCallback": "features.trackers",
    "MLflowCallback": "features.trackers",
    "TrackioCallback": "features.trackers",
    "LabelSmoother": "features.losses",
    "TrainOutput": "trainer_utils",
    "set_seed": "trainer_utils",
    "get_last_checkpoint": "trainer_utils",
    "BestRun": "trainer_utils",
    "HPSearchBackend": "trainer_utils",
    "default_compute_objective": "trainer_utils",
    "default_hp_space_optuna": "trainer_utils",
    "default_data_collator": "data.defaults",
    "SigtermLatch": "signals",
    # data pipeline: length-based samplers, padding, NEFTune, column removal, dataloader args
    "LengthGroupedBatchSampler": "data.length_sampling",
    "BatchRebalanceBatchSampler": "data.length_sampling",
    "PaddingCollator": "data.collators",
    "DataCollatorWithPadding": "data.collators",
    "RemoveColumnsCollator": "data.columns",
    "enable_neftune": "data.neftune",
    "activate_neftune": "data.neftune",
    "deactivate_neftune": "data.neftune",
    "DataArguments": "data.arguments",
    # distributed: DDP arguments, torchrun launcher, FSDP sharded checkpoints
    "DdpArguments": "distributed.ddp_args",
    "AcceleratorConfig": "distributed.ddp_args",
    "FsdpConfig": "distributed.fsdp",
    "shard_model": "distributed.fsdp",
    "save_sharded": "distributed.fsdp",
    "load_sharded": "distributed.fsdp",
    "FsdpArguments": "distributed.fsdp_args",
    "FsdpConfigArguments": "distributed.fsdp_args",
    # jobs written for the stock transformers.Trainer / TRL (trainer_runtime.hf)
    "PreemptibleCallback": "hf.callback",
    "attach_preemptible": "hf.callback",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
