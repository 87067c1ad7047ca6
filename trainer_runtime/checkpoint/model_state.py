"""The model's tensors in a checkpoint: file names and the state_dict <-> safetensors mapping.

Shared by the Trainer and its mixins (features, FSDP), which import it from here rather than from
``trainer_runtime.trainer`` so that no module imports the Trainer back.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

__all__ = [
    "ALIASES_KEY",
    "MODEL_NAME",
    "MODEL_STEM",
    "OPTIMIZER_INDEX_NAME",
    "OPTIMIZER_NAME",
    "OPTIMIZER_STEM",
    "SCHEDULER_NAME",
    "TRAINING_ARGS_NAME",
    "load_model_state",
    "model_state_tensors",
    "rng_file_name",
    "storage_key",
]

# Checkpoint file names (Hugging Face names where they exist; safetensors/JSON instead of pickles).
MODEL_NAME = "model.safetensors"
OPTIMIZER_NAME = "optimizer.safetensors"
# A save shared by the ranks (shares.py): <stem>-0000i-of-0000n.safetensors + <stem> index
MODEL_STEM = "model"
OPTIMIZER_STEM = "optimizer"
OPTIMIZER_INDEX_NAME = "optimizer.safetensors.index.json"
SCHEDULER_NAME = "scheduler.json"
TRAINING_ARGS_NAME = "training_args.json"
# safetensors metadata key: state_dict entries dropped as tied duplicates -> the entry kept
ALIASES_KEY = "preemptible.aliases"


def rng_file_name(rank: int, world_size: int) -> str:
    return "rng_state.safetensors" if world_size == 1 else f"rng_state_{rank}.safetensors"


def storage_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Equal for two state_dict entries that are the same tensor (tied weights)."""
    return (
        tensor.device,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )


def model_state_tensors(
    model: nn.Module, *, to_cpu: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The state_dict as CPU tensors (``to_cpu=False``: on their device, for a streaming writer
    that copies one at a time), tied (storage-sharing) entries stored once.

    safetensors refuses shared storage; the dropped names are kept in the metadata as aliases.
    """
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name, tensor in model.state_dict().items():
        key = storage_key(tensor)
        if tensor.numel() > 0 and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = tensor.detach().to("cpu").contiguous() if to_cpu else tensor.detach()
    return tensors, {ALIASES_KEY: json.dumps(aliases)} if aliases else {}


def load_model_state(
    model: nn.Module, tensors: dict[str, torch.Tensor], meta: dict[str, str]
) -> None:
    """Load ``tensors`` strictly; tied entries the writer dropped are filled from the entry kept.

    Our files name the dropped entries in their metadata; a file written by transformers'
    ``save_pretrained`` does not, so an entry still missing is taken from the loaded entry it
    shares storage with in ``model`` (it is the same tensor), and entries the model declares as
    not saved (``_keys_to_ignore_on_save``) keep their current value.
    """
    state = dict(tensors)
    for alias, target in json.loads(meta.get(ALIASES_KEY, "{}")).items():
        if target in state:
            state[alias] = state[target]
    own = model.state_dict()
    missing = [name for name in own if name not in state]
    if missing:
        loaded = {storage_key(t): n for n, t in own.items() if n in state}
        ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or [])
        for name in missing:
            source = loaded.get(storage_key(own[name]))
            if source is not None:
                state[name] = state[source]
            elif name in ignored:
                state[name] = own[name]
    model.load_state_dict(state, strict=True)
