"""The resume of a rank-shared (DDP) checkpoint: each rank reads its share, the ranks exchange it.

A DDP save splits the replicated model and optimizer state across the ranks by bytes (shares.py).
Reading every shard back on every rank would cost N x the bytes per node (host memory and, from an
object store, downloads). Instead:

* :func:`reading_owners` gives every shard file one reading rank (pure): at the world size of the
  save, the rank that wrote it (shard ``i`` of a group whose every rank wrote a shard is rank
  ``i - 1``), so each rank reads exactly the share it wrote (``total / N`` plus at most the
  largest tensor); at another world size, whole files split by bytes (largest first, to the least
  loaded rank: ``total / N`` plus at most the largest file).
* Each rank reads its files whole into host buffers through the storage seam (counted by
  :mod:`read_stats`) and checks them against the manifest as they arrive.
* One all-gather carries every rank's outcome and the names, dtypes and shapes of its tensors:
  when a rank failed (a checksum mismatch, a file that cannot be read), every rank raises before
  any exchange (the caller's fallback then settles the verdict across the ranks).
* The tensors are then broadcast from their reading rank one at a time, in name order: model
  tensors straight into the parameter (or buffer) they belong to, optimizer tensors into the
  tensor the optimizer will keep. No rank holds more than its own share plus one tensor in flight
  (beyond the state it keeps).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer_runtime.checkpoint.digest import new_hasher
from trainer_runtime.checkpoint.hf_format import WEIGHTS_INDEX_NAME, is_peft_model
from trainer_runtime.checkpoint.io import OPTIMIZER_META_KEY, optimizer_state_from_tensors
from trainer_runtime.checkpoint.model_state import (
    MODEL_NAME,
    MODEL_STEM,
    OPTIMIZER_INDEX_NAME,
    OPTIMIZER_NAME,
    OPTIMIZER_STEM,
    SCHEDULER_NAME,
    load_model_state,
)
from trainer_runtime.checkpoint.safetensors_stream import header_of, tensors_from_buffer
from trainer_runtime.checkpoint.shares import _SHARD, plan_shares
from trainer_runtime.errors import CheckpointCorruptError, ResumeError, StorageError

__all__ = ["SharedGroup", "SharedResume", "exchange_shares", "load_shared", "reading_owners"]


def reading_owners(
    weight_maps: Sequence[Mapping[str, str]],
    sizes: Mapping[str, int],
    saved_world: int | None,
    world: int,
) -> dict[str, int]:
    """The rank that reads each shard file of the groups' weight maps (tensor -> file); pure.

    ``sizes``: each file's bytes (the manifest's). At the save's world size, when every group has
    one shard per rank, each rank reads what it wrote; otherwise whole files are split by bytes.
    """
    files = sorted({str(f) for wm in weight_maps for f in wm.values()})
    if saved_world == world:
        owners: dict[str, int] = {}
        for name in files:
            match = _SHARD.match(name)
            if match is None or int(match.group("count")) != world:
                break
            owners[name] = int(match.group("index")) - 1
        else:
            return owners
    shares, _ = plan_shares([(f, int(sizes.get(f, 0))) for f in files], world)
    return {f: rank for rank, names in enumerate(shares) for f in names}


class SharedGroup:
    """One shared group to resume: its index's weight map (tensor -> file)."""

    def __init__(self, stem: str, weight_map: Mapping[str, str]) -> None:
        self.stem = stem
        self.weight_map = {str(k): str(v) for k, v in weight_map.items()}


def _read_file(reader: Any, name: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A whole shard into one host buffer through the storage seam (counted), its checksum
    computed from the blocks as they arrive; CheckpointCorruptError on a mismatch."""
    expected = reader._expected(name)
    hasher = new_hasher(expected[0]) if expected else None
    try:
        size = reader._sizes.get(name)
        if size is None:
            size = reader.storage.size(name)
        buf = torch.empty(size, dtype=torch.uint8)
        reader.storage.read_into(name, memoryview(buf.numpy()), hasher.update if hasher else None)
    except StorageError as exc:
        raise ResumeError(f"cannot read {name} of {reader.path}: {exc}") from exc
    if hasher is not None and expected is not None:
        actual = hasher.hexdigest()
        if actual != expected[1]:
            raise reader._corrupt(name, expected[0], actual, expected[1])
    try:
        header, base = header_of(memoryview(buf.numpy()))
        tensors = tensors_from_buffer(buf, header, base)
    except Exception as exc:  # a header that does not parse
        raise ResumeError(f"cannot read {name} of {reader.path}: {exc}") from exc
    return tensors, dict(header.get("__metadata__") or {})


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a uint8 view of the same storage (0-d and empty too)."""
    if tensor.numel() == 0:
        return tensor
    return tensor.reshape(-1).view(torch.uint8)


def _device() -> torch.device:
    # NCCL broadcasts CUDA tensors only; gloo CPU tensors.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def exchange_shares(
    reader: Any,
    groups: Sequence[SharedGroup],
    *,
    model: nn.Module | None,
    model_stem: str,
    saved_world: int | None,
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, str]]:
    """Read this rank's share of ``groups`` and exchange the tensors (a collective: every rank
    calls it with the same groups). The group ``model_stem`` is loaded into ``model`` (strictly,
    tied entries as :func:`load_model_state` fills them) and returned empty; the others are
    returned as ``{stem: {tensor: tensor}}`` (on the process group's device). Also returns the
    model shards' safetensors metadata."""
    rank, world = dist.get_rank(), dist.get_world_size()
    owners = reading_owners([g.weight_map for g in groups], reader._sizes, saved_world, world)
    mine: dict[str, torch.Tensor] = {}
    meta: dict[str, str] = {}
    error: BaseException | None = None
    try:
        for name in sorted(f for f, r in owners.items() if r == rank):
            tensors, file_meta = _read_file(reader, name)
            mine.update({f"{name}\0{k}": v for k, v in tensors.items()})
            meta.update(file_meta)
    except Exception as exc:
        error = exc
    listing = {k: (str(t.dtype), tuple(t.shape)) for k, t in mine.items()}
    report = (
        None if error is None else (isinstance(error, CheckpointCorruptError), str(error)),
        listing,
        meta,
    )
    reports: list[Any] = [None] * world
    dist.all_gather_object(reports, report)
    failed = [(r, rep[0]) for r, rep in enumerate(reports) if rep[0] is not None]
    if failed:
        if error is not None:
            raise error
        r, (_, message) = failed[0]
        raise ResumeError(f"rank {r} could not read its share of {reader.path}: {message}")
    shapes: dict[str, tuple[int, str, tuple[int, ...]]] = {}
    for r, (_, their, their_meta) in enumerate(reports):
        for k, (dtype, shape) in their.items():
            shapes[k] = (r, dtype, shape)
        meta.update(their_meta)
    device = _device()
    own = model.state_dict() if model is not None else {}
    out: dict[str, dict[str, torch.Tensor]] = {}
    for group in groups:
        received: dict[str, torch.Tensor] = {}
        for tensor_name in sorted(group.weight_map):
            key = f"{group.weight_map[tensor_name]}\0{tensor_name}"
            if key not in shapes:
                raise ResumeError(
                    f"{reader.path}: tensor {tensor_name!r} of the {group.stem} index is not in "
                    f"its shard {group.weight_map[tensor_name]}"
                )
            src, dtype_name, shape = shapes[key]
            dtype = getattr(torch, dtype_name.removeprefix("torch."))
            dest = own.get(tensor_name) if group.stem == model_stem else None
            direct = (
                dest is not None
                and dest.dtype == dtype
                and tuple(dest.shape) == shape
                and dest.device == device
                and dest.is_contiguous()
            )
            with torch.no_grad():
                if direct:
                    assert dest is not None
                    target = dest
                    if rank == src:
                        target.copy_(mine.pop(key))
                elif rank == src:
                    target = mine.pop(key)
                    if target.device != device:
                        target = target.to(device)
                else:
                    target = torch.empty(shape, dtype=dtype, device=device)
                # as bytes: bit-exact whatever the dtype, also ones a backend does not reduce
                # (gloo and bfloat16 or float8)
                dist.broadcast(_as_bytes(target), src=src)
                if dest is not None and not direct and tuple(dest.shape) == shape:
                    dest.copy_(target)  # another dtype or device: cast into the parameter
                    target = dest
            if target.dim() == 0 and target.device.type != "cpu":
                target = target.cpu()  # scalars (Adam's step) stay on the host, as read
            received[tensor_name] = target
        if group.stem == model_stem and model is not None:
            try:
                # entries already hold their values (copies into themselves); this checks the
                # names strictly and fills tied entries the writer dropped
                load_model_state(model, received, meta)
            except RuntimeError as exc:
                raise ResumeError(
                    f"the weights in {reader.path} do not fit this model "
                    f"({type(model).__name__}): {exc}"
                ) from exc
            out[group.stem] = {}
        else:
            out[group.stem] = received
    return out, meta


class SharedResume:
    """What :func:`load_shared` restored: whether the model is loaded, and the optimizer's
    state_dict (None: not in the shared groups)."""

    def __init__(self, model_loaded: bool, optimizer: dict[str, Any] | None) -> None:
        self.model_loaded = model_loaded
        self.optimizer = optimizer


def load_shared(reader: Any, model: nn.Module, saved_world: int | None) -> SharedResume | None:
    """Under data parallelism (a process group of more than one rank): the model and optimizer
    groups a rank-shared save wrote (indexes of shards), each rank reading its share and the ranks
    exchanging the tensors (:func:`exchange_shares`). None when the checkpoint holds no such group
    (whole files: read as before). The optimizer group is read only when a scheduler is saved
    beside it (the caller loads the optimizer only then). Every rank decides the same from the
    manifest."""
    groups: list[SharedGroup] = []
    model_shared = (
        not is_peft_model(model) and not reader.has(MODEL_NAME) and reader.has(WEIGHTS_INDEX_NAME)
    )
    if model_shared:
        index = reader.load_json(WEIGHTS_INDEX_NAME)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, Mapping):
            raise ResumeError(f"{reader.path}/{WEIGHTS_INDEX_NAME} has no weight_map")
        groups.append(SharedGroup(MODEL_STEM, weight_map))
    optimizer_meta: str | None = None
    if (
        not reader.has(OPTIMIZER_NAME)
        and reader.has(OPTIMIZER_INDEX_NAME)
        and reader.has(SCHEDULER_NAME)
    ):
        index = reader.load_json(OPTIMIZER_INDEX_NAME)
        where = f"{reader.path}/{OPTIMIZER_INDEX_NAME}"
        meta = index.get(OPTIMIZER_META_KEY) if isinstance(index, dict) else None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(meta, str) or not isinstance(weight_map, Mapping):
            raise ResumeError(f"{where} has no {OPTIMIZER_META_KEY}: not an index of ours")
        optimizer_meta = meta
        groups.append(SharedGroup(OPTIMIZER_STEM, weight_map))
    if not groups:
        return None
    out, _ = exchange_shares(
        reader,
        groups,
        model=model if model_shared else None,
        model_stem=MODEL_STEM,
        saved_world=saved_world,
    )
    optimizer = (
        optimizer_state_from_tensors(out[OPTIMIZER_STEM], optimizer_meta)
        if optimizer_meta is not None
        else None
    )
    return SharedResume(model_shared, optimizer)
