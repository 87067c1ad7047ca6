"""The model's files in transformers' formats, and transformers.Trainer's resume files.

What a checkpoint (and ``save_model``) holds for the model depends on its kind:

* a ``peft.PeftModel``: what PEFT's ``save_pretrained`` writes (``adapter_config.json``,
  ``adapter_model.safetensors``, its model card), i.e. the adapter only, as transformers.Trainer
  saves it; the frozen base model is never written;
* a ``transformers.PreTrainedModel``: ``model.safetensors`` with transformers' tensor names and
  tied-weight handling (the tied duplicates dropped as ``save_pretrained`` drops them, recorded
  as aliases in the file's metadata for our own resume), ``config.json`` and, for generative
  models, ``generation_config.json``: ``from_pretrained`` opens the directory;
* any other ``nn.Module``: ``model.safetensors`` with the state_dict (tied entries stored once).

The processing class's files (``processing_class.save_pretrained``) go next to the model in every
case. All files are returned as bytes: the caller writes them through the checkpoint writer or
the storage seam, so they are fsynced and listed in the manifest like every other file.

transformers.Trainer writes its optimizer, scheduler and RNG state as pickles (``optimizer.pt``,
``scheduler.pt``, ``rng_state.pth``); we read them (with ``weights_only``) to resume its
checkpoints, and :func:`export_transformers_state` writes them next to ours on request.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import load as st_load
from torch import nn

from trainer_runtime.checkpoint.model_state import (
    ALIASES_KEY,
    MODEL_NAME,
    SCHEDULER_NAME,
    load_model_state,
    model_state_tensors,
    storage_key,
)
from trainer_runtime.checkpoint.safetensors_stream import TensorFile
from trainer_runtime.checkpoint.shares import index_name, load_indexed
from trainer_runtime.errors import CheckpointError, ResumeError

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "CONFIG_NAME",
    "HF_OPTIMIZER_NAME",
    "HF_SCHEDULER_NAME",
    "WEIGHTS_INDEX_NAME",
    "export_transformers_state",
    "has_model_files",
    "hf_rng_file_name",
    "in_place_targets",
    "is_peft_model",
    "is_pretrained_model",
    "load_hf_rng_state",
    "load_model_files",
    "model_file_entries",
    "model_files",
    "model_weights",
    "side_files",
    "torch_load",
]

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
WEIGHTS_INDEX_NAME = index_name("model")
HF_OPTIMIZER_NAME = "optimizer.pt"
HF_SCHEDULER_NAME = "scheduler.pt"

# (filename, bytes) pairs, written in order
Files = list[tuple[str, bytes]]
# the same, with the weights still tensors: written as they are serialised (safetensors_stream)
Entries = list[tuple[str, bytes | TensorFile]]


def hf_rng_file_name(rank: int, world_size: int) -> str:
    """transformers.Trainer's RNG file of ``rank``."""
    return "rng_state.pth" if world_size == 1 else f"rng_state_{rank}.pth"


def is_peft_model(model: nn.Module) -> bool:
    """A ``peft.PeftModel`` (only possible once peft is imported: no import here)."""
    peft = sys.modules.get("peft")
    classes = tuple(
        c for c in (getattr(peft, "PeftModel", None), getattr(peft, "PeftMixedModel", None)) if c
    )
    return bool(classes) and isinstance(model, classes)


def is_pretrained_model(model: nn.Module) -> bool:
    """A ``transformers.PreTrainedModel`` (only possible once transformers is imported)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    cls = getattr(modeling, "PreTrainedModel", None)
    return cls is not None and isinstance(model, cls)


# -- writing ------------------------------------------------------------------------------------
def model_files(
    model: nn.Module,
    processing_class: Any = None,
    *,
    gathered: dict[str, torch.Tensor] | None = None,
) -> Files:
    """The files that hold ``model`` (see the module docstring) and the processing class, as
    bytes (:func:`model_file_entries` keeps the weights as tensors, for streaming writers).

    ``gathered``: the full state_dict already gathered (FSDP); the model's own otherwise.
    """
    return [
        (name, data.to_bytes() if isinstance(data, TensorFile) else data)
        for name, data in model_file_entries(model, processing_class, gathered=gathered)
    ]


def model_file_entries(
    model: nn.Module,
    processing_class: Any = None,
    *,
    gathered: dict[str, torch.Tensor] | None = None,
) -> Entries:
    """:func:`model_files` with ``model.safetensors`` as a :class:`TensorFile`: the tensors
    are the model's own (on their device), serialised only as the file is written."""
    weights = model_weights(model, gathered=gathered)
    if weights is None:  # PEFT: the adapter, as its save_pretrained writes it
        files = _saved_files(lambda d: model.save_pretrained(d))  # type: ignore[operator]
        if not any(name.split("/")[-1] == ADAPTER_WEIGHTS_NAME for name, _ in files):
            raise CheckpointError(
                f"PEFT's save_pretrained wrote no {ADAPTER_WEIGHTS_NAME} (files: "
                f"{sorted(n for n, _ in files)}): cannot checkpoint this adapter"
            )
        return [*files, *processing_files(processing_class)]
    return [(MODEL_NAME, weights), *side_files(model, processing_class)]


def model_weights(
    model: nn.Module, *, gathered: dict[str, torch.Tensor] | None = None
) -> TensorFile | None:
    """The tensors of ``model.safetensors`` (transformers' names, tied duplicates dropped and
    recorded as aliases), still on their device; None for a PEFT model, whose checkpoint is
    its adapter as PEFT writes it. ``gathered``: see :func:`model_files`."""
    if is_peft_model(model):
        return None
    if is_pretrained_model(model):
        return _pretrained_weights(model, gathered)
    if gathered is not None:
        return TensorFile(gathered)
    tensors, meta = model_state_tensors(model, to_cpu=False)
    return TensorFile(tensors, meta or None)


def side_files(model: nn.Module, processing_class: Any = None) -> Files:
    """Everything but the weights: a PreTrainedModel's configs and the processing class's files
    (FSDP writes the weights itself)."""
    files = _saved_files(lambda d: _save_configs(model, d)) if is_pretrained_model(model) else []
    return files + processing_files(processing_class)


def processing_files(processing_class: Any) -> Files:
    """What ``processing_class.save_pretrained`` writes (tokenizer, processor); none without one."""
    save = getattr(processing_class, "save_pretrained", None)
    if not callable(save):
        return []
    return _saved_files(lambda d: save(d))


def _saved_files(save: Callable[[str], Any]) -> Files:
    """Run a ``save_pretrained``-style function into a private temporary directory and return
    what it wrote. Used for the small files only (configs, tokenizer, adapter): the bytes then
    go through our writer, which fsyncs them and lists them in the manifest."""
    with tempfile.TemporaryDirectory(prefix="preemptible-save-") as tmp:
        save(tmp)
        out: Files = []
        for root, _, names in os.walk(tmp):
            for name in sorted(names):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, tmp).replace(os.sep, "/")
                with open(path, "rb") as fh:
                    out.append((rel, fh.read()))
    return sorted(out)


def _save_configs(model: nn.Module, directory: str) -> None:
    """config.json (and generation_config.json) as ``save_pretrained`` writes them."""
    config = model.config  # type: ignore[attr-defined]
    # save_pretrained records the dtype and the architecture in the config (on the model's own
    # config object); from_pretrained of the Auto classes needs both.
    config.dtype = str(model.dtype).split(".")[1]  # type: ignore[attr-defined]
    config.architectures = [type(model).__name__.removeprefix("FSDP")]
    config.save_pretrained(directory)
    if model.can_generate() and getattr(model, "generation_config", None) is not None:  # type: ignore[operator]
        model.generation_config.save_pretrained(directory)  # type: ignore[attr-defined, union-attr]


def _pretrained_weights(model: nn.Module, gathered: dict[str, torch.Tensor] | None) -> TensorFile:
    """model.safetensors as ``save_pretrained`` writes it (one file, not sharded)."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = dict(gathered) if gathered is not None else dict(model.state_dict())
    for key in getattr(model, "_keys_to_ignore_on_save", None) or []:
        state.pop(key, None)
    full = dict(state)
    kept = remove_tied_weights_from_state_dict(state, model)
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # older transformers: no weight conversions
        pass
    else:
        kept = revert_weight_conversion(model, kept)
    # The dropped duplicates, for our resume (transformers ties them again on load).
    by_storage = {storage_key(t): n for n, t in kept.items() if isinstance(t, torch.Tensor)}
    aliases = {
        name: by_storage[storage_key(t)]
        for name, t in full.items()
        if name not in kept and isinstance(t, torch.Tensor) and storage_key(t) in by_storage
    }
    # Copied off the device one tensor at a time, as the file is written.
    tensors = {n: t.detach() for n, t in kept.items()}
    meta = {"format": "pt"}
    if aliases:
        meta[ALIASES_KEY] = json.dumps(aliases, sort_keys=True)
    return TensorFile(tensors, meta)


# -- reading ------------------------------------------------------------------------------------
Read = Callable[[str], bytes]
Has = Callable[[str], bool]
LoadTensors = Callable[[str], tuple[dict[str, torch.Tensor], dict[str, str]]]


def has_model_files(model: nn.Module, has: Has) -> bool:
    if is_peft_model(model):
        return has(ADAPTER_WEIGHTS_NAME)
    return has(MODEL_NAME) or has(WEIGHTS_INDEX_NAME)


def in_place_targets(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The model's state_dict to read a checkpoint straight into, or None: only when every
    tensor is in host memory. A model on an accelerator keeps the memory-mapped load (its file's
    tensors would otherwise take fresh host memory before being copied to the device)."""
    state = dict(model.state_dict())
    return state if all(t.device.type == "cpu" for t in state.values()) else None


def load_model_files(
    model: nn.Module,
    read: Read,
    has: Has,
    where: str,
    *,
    load: LoadTensors | None = None,
) -> None:
    """Load the weights a checkpoint of ours or of transformers.Trainer holds into ``model``.

    PEFT: the adapter (the base model stays as built). Otherwise ``model.safetensors`` (or the
    shards of ``model.safetensors.index.json``); tied entries a writer dropped are taken from the
    tensor they share storage with, so nothing may be missing or unexpected.

    ``load``: returns a safetensors file's (tensors, metadata) without reading it into bytes
    first (e.g. :meth:`CheckpointReader.load_tensors_and_metadata`). One that takes an ``into``
    keyword gets the model's state_dict and reads each tensor straight into the parameter or
    buffer it fits (one sequential pass; the load then copies nothing); any other is called with
    the file name only and its tensors are copied into the model.
    """
    if is_peft_model(model):
        _load_adapter(model, read, has, where)
        return

    # A loader that can read straight into the model's tensors (CheckpointReader's, local) gets
    # them: no fresh memory, and load_state_dict's copies become no-ops (same data).
    into = None
    if load is not None and "into" in inspect.signature(load).parameters:
        into = in_place_targets(model)

    def tensors_of(name: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        if load is not None:
            return load(name, into=into) if into is not None else load(name)  # type: ignore[call-arg]
        data = read(name)
        return dict(st_load(data)), _metadata(data)

    if has(MODEL_NAME):
        tensors, meta = tensors_of(MODEL_NAME)
    elif has(WEIGHTS_INDEX_NAME):
        # transformers' shards, or ours (a save shared by the ranks, shares.py)
        index = json.loads(read(WEIGHTS_INDEX_NAME))
        tensors, meta = load_indexed(index, tensors_of, f"{where}/{WEIGHTS_INDEX_NAME}")
    else:
        raise ResumeError(
            f"cannot load the model from {where}: it has no {MODEL_NAME} nor {WEIGHTS_INDEX_NAME} "
            "(pickled weights, pytorch_model.bin, are not read: convert them to safetensors)"
        )
    try:
        load_model_state(model, tensors, meta)
    except RuntimeError as exc:
        raise ResumeError(
            f"the weights in {where} do not fit this model ({type(model).__name__}): {exc}"
        ) from exc


def _load_adapter(model: nn.Module, read: Read, has: Has, where: str) -> None:
    if not has(ADAPTER_WEIGHTS_NAME):
        raise ResumeError(
            f"cannot load the PEFT adapter from {where}: it has no {ADAPTER_WEIGHTS_NAME} (was it "
            "written for a model without adapters? resume it with the same PEFT setup)"
        )
    from peft import set_peft_model_state_dict

    adapter = getattr(model, "active_adapter", "default")
    state = dict(st_load(read(ADAPTER_WEIGHTS_NAME)))
    result = set_peft_model_state_dict(model, state, adapter_name=adapter)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise ResumeError(
            f"the adapter in {where} does not fit this PEFT model: unexpected keys "
            f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} (same base model, "
            "target_modules and rank?)"
        )


def _metadata(data: bytes) -> dict[str, str]:
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    return dict(header.get("__metadata__") or {})


def torch_load(data: bytes, where: str) -> Any:
    """Unpickle one of transformers.Trainer's ``.pt`` / ``.pth`` files with ``weights_only``
    (tensors, containers, numbers and the numpy types of an RNG state; no code is run)."""
    import io

    import numpy as np

    core = getattr(np, "_core", None) or np.core
    allowed = [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ResumeError(f"cannot read {where}: {type(exc).__name__}: {exc}") from exc


def load_hf_rng_state(state: dict[str, Any]) -> None:
    """Restore the generators from transformers.Trainer's RNG dict (python, numpy, cpu, cuda)."""
    import random

    import numpy as np

    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "cpu" in state:
        torch.random.set_rng_state(state["cpu"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if isinstance(cuda, list | tuple):
            if len(cuda) == torch.cuda.device_count():
                torch.cuda.random.set_rng_state_all(cuda)
            else:
                logger.warning("the checkpoint's CUDA RNG states do not match the devices: skipped")
        else:
            torch.cuda.random.set_rng_state(cuda)


# -- ours -> transformers ---------------------------------------------------------------------
def export_transformers_state(
    path: str, storage_options: dict[str, Any] | None = None
) -> list[str]:
    """Write transformers.Trainer's ``optimizer.pt``, ``scheduler.pt`` and ``rng_state*.pth``
    into our complete checkpoint ``path``, converted from our safetensors/JSON files, so that
    ``transformers.Trainer.train(resume_from_checkpoint=path)`` also restores the optimizer,
    the schedule and the generators. Returns the names written.

    Each file is written whole under a temporary name and renamed into place (local disks), so an
    interrupted export leaves no half file; the manifest is unchanged (files it does not list do
    not affect completeness).
    """
    import io

    from trainer_runtime.checkpoint.io import CheckpointReader
    from trainer_runtime.checkpoint.rng import rng_state_for_transformers

    reader = CheckpointReader(path, storage_options)
    listed = {e["path"] for e in (reader.info.manifest or {}).get("files", [])}
    if not reader.info.manifest:
        raise CheckpointError(f"{path} has no manifest.json: it is not a checkpoint of ours")
    out: Files = []
    optimizer = reader.load_optimizer() if SCHEDULER_NAME in listed else None
    if optimizer is not None:
        reader.wait_verified()
        for name, obj in (
            (HF_OPTIMIZER_NAME, optimizer),
            (HF_SCHEDULER_NAME, reader.load_json(SCHEDULER_NAME)),
        ):
            buf = io.BytesIO()
            torch.save(obj, buf)
            out.append((name, buf.getvalue()))
    else:
        logger.warning("%s has no optimizer/scheduler state (save_only_model?)", path)
    world = int(reader.info.manifest.get("world_size") or 1)
    for rank in range(world):
        ours = "rng_state.safetensors" if world == 1 else f"rng_state_{rank}.safetensors"
        if ours not in listed:
            continue
        state = rng_state_for_transformers(
            reader.load_tensors(ours), reader.load_metadata(ours), distributed=world > 1
        )
        buf = io.BytesIO()
        torch.save(state, buf)
        out.append((hf_rng_file_name(rank, world), buf.getvalue()))
    for name, data in out:
        reader.storage.atomic_write_bytes(name, data)
    return [name for name, _ in out]
