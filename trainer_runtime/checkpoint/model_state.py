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
    "MODEL_NAME",
    "OPTIMIZER_NAME",
    "SCHEDULER_NAME",
    "TRAINING_ARGS_NAME",
    "load_model_state",
    "model_state_tensors",
    "rng_file_name",
]

# Checkpoint file names (Hugging Face names where they exist; safetensors/JSON instead of pickles).
MODEL_NAME = "model.safetensors"
OPTIMIZER_NAME = "optimizer.safetensors"
SCHEDULER_NAME = "scheduler.json"
TRAINING_ARGS_NAME = "training_args.json"
_ALIASES_KEY = "preemptible.aliases"


def rng_file_name(rank: int, world_size: int) -> str:
    return "rng_state.safetensors" if world_size == 1 else f"rng_state_{rank}.safetensors"


def model_state_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The state_dict as CPU tensors, tied (storage-sharing) entries stored once.

    safetensors refuses shared storage; the dropped names are kept in the metadata as aliases.
    """
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name, tensor in model.state_dict().items():
        key = (
            tensor.device,
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
        )
        if tensor.numel() > 0 and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = tensor.detach().to("cpu").contiguous()
    return tensors, {_ALIASES_KEY: json.dumps(aliases)} if aliases else {}


def load_model_state(
    model: nn.Module, tensors: dict[str, torch.Tensor], meta: dict[str, str]
) -> None:
    state = dict(tensors)
    for alias, target in json.loads(meta.get(_ALIASES_KEY, "{}")).items():
        state[alias] = state[target]
    model.load_state_dict(state, strict=True)
