"""Checkpoints: the fsspec storage seam, the layout and completeness rule, rotation, the writer and
reader (sentinel, fsync, manifest last), per-node copies, resharding of the data position and RNG
state, the model's files in transformers' formats (hf_format), safetensors files written as they are
serialised (safetensors_stream) and periodic checkpoints written in the background (background).
``storage`` and ``layout`` are torch-free (the operator imports them)."""

from __future__ import annotations

from trainer_runtime._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "Storage": "storage",
        "CheckpointInfo": "layout",
        "CheckpointStore": "layout",
        "is_complete": "layout",
        "rotation_victims": "layout",
        "CheckpointWriter": "io",
        "CheckpointReader": "io",
        "optimizer_state_to_tensors": "io",
        "optimizer_state_from_tensors": "io",
        "rotate_checkpoints": "io",
        "capture_rng_state": "rng",
        "restore_rng_state": "rng",
        "load_model_state": "model_state",
        "model_state_tensors": "model_state",
        "MODEL_NAME": "model_state",
        "RUNTIME_STATE_NAME": "layout",
        "export_transformers_state": "hf_format",
        "load_model_files": "hf_format",
        "model_files": "hf_format",
        "model_file_entries": "hf_format",
        "TensorFile": "safetensors_stream",
        "write_safetensors": "safetensors_stream",
        "BackgroundSave": "background",
        "PinnedStaging": "pinned",
    },
)
