"""The data pipeline: resumable and length-aware samplers, padding collator, column removal,
batch dispatch, NEFTune, the data arguments of ``TrainingArguments`` and DataLoader workers that
a forwarded SIGTERM does not kill."""

from __future__ import annotations

from trainer_runtime._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "default_data_collator": "defaults",
        "default_collator_for": "defaults",
        "DataCollatorWithPadding": "collators",
        "ResumableBatchSampler": "samplers",
        "LengthGroupedBatchSampler": "length_sampling",
        "BatchRebalanceBatchSampler": "length_sampling",
        "PaddingCollator": "collators",
        "RemoveColumnsCollator": "columns",
        "enable_neftune": "neftune",
        "activate_neftune": "neftune",
        "deactivate_neftune": "neftune",
        "DataArguments": "arguments",
        "shielded_worker_init_fn": "worker_signals",
        "shield_dataloader": "worker_signals",
    },
)
