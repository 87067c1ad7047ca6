"""FSDP (fully_shard) models: sharded checkpoints every rank writes at once, under the same commit
rules as every other checkpoint.

Save protocol (every rank calls :func:`save_sharded`, or the Trainer's save, at the same step)::

    coordinator: checkpoint-<step>/ + sentinel (fsynced), barrier       (CheckpointWriter.begin)
    every rank : fsdp-state-<rank+1>-of-<N>.safetensors: its pieces of every sharded tensor,
                 written from the local shards as they are serialised, checksummed as written
    rank 0     : also the replicated tensors (optimizer steps, buffers), the optimizer's
                 structure (in its file's metadata) and the JSON files (trainer_state.json, ...)
    coordinator: manifest.json (the commit point), removes the sentinel (CheckpointWriter.commit)

Nothing is gathered: no rank ever holds more than its own shards, and each writes about
``total / N`` bytes. A file's safetensors metadata records where each of its pieces sits in its
global tensor (offsets and global shape, from the DTensor's chunk), so :func:`load_sharded`
rebuilds any other sharding: each rank reads, from every file, the slices that overlap its new
piece (memory-mapped on local storage), and checks a share of the files' checksums, the ranks
agreeing before the state is used. A rank killed in the middle leaves a checkpoint without
manifest, which every reader treats as incomplete, exactly like a DDP checkpoint.

Checkpoints of earlier versions (``fsdp-dcp/1``, written by torch.distributed.checkpoint) still
load through DCP.

Scope: FSDP2 (``torch.distributed.fsdp.fully_shard``) on CPU with gloo and on CUDA with NCCL.
Options that only make sense on GPUs are validated up front by :func:`check_fsdp_config` and
refused with a clear error on CPU.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from trainer_runtime.checkpoint import shares
from trainer_runtime.checkpoint.io import (
    OPTIMIZER_META_KEY,
    CheckpointReader,
    CheckpointWriter,
    optimizer_state_from_tensors,
    optimizer_state_to_tensors,
)
from trainer_runtime.checkpoint.layout import CheckpointInfo
from trainer_runtime.checkpoint.safetensors_stream import TensorFile
from trainer_runtime.distributed import collectives
from trainer_runtime.errors import CheckpointError, ConfigurationError, ResumeError

__all__ = [
    "SHARDED_FORMAT",
    "FsdpConfig",
    "check_fsdp_config",
    "consolidated_model",
    "full_state_tensors",
    "load_sharded",
    "local_state_file",
    "save_sharded",
    "shard_file_name",
    "shard_model",
    "sharded_manifest",
    "sharded_manifest_entry",
    "wrap_targets",
]

SHARDED_FORMAT = "fsdp-shards/1"
# Checkpoints of earlier versions (torch.distributed.checkpoint files): still loaded.
_DCP_FORMAT = "fsdp-dcp/1"
_MANIFEST_KEY = "sharding"
SHARD_STEM = "fsdp-state"
# safetensors metadata: where each piece of a file sits in its global tensor
_LAYOUT_KEY = "preemptible.fsdp"
_MODEL_PREFIX = "model."


@dataclass(frozen=True)
class FsdpConfig:
    """How a model is sharded.

    ``reshard_after_forward``: free the gathered parameters after forward (ZeRO-3) or keep them
    until backward (ZeRO-2 style). ``cpu_offload`` and ``mixed_precision`` need CUDA devices.

    ``wrap`` picks the submodules that become FSDP units of their own (the root always is one):
    ``children`` every direct child owning parameters; ``transformer`` every module whose class
    name is in ``layer_classes`` (default: the model's ``_no_split_modules``); ``size`` every
    module holding at least ``min_num_params`` parameters not already in a unit; ``none`` only
    the root. ``sync_module_states`` broadcasts rank 0's parameters and buffers before sharding;
    ``activation_checkpointing`` recomputes each unit's activations in backward.
    """

    reshard_after_forward: bool = True
    cpu_offload: bool = False
    mixed_precision: Literal["bf16", "fp16"] | None = None
    wrap: Literal["children", "transformer", "size", "none"] = "children"
    layer_classes: tuple[str, ...] = ()
    min_num_params: int = 0
    sync_module_states: bool = False
    activation_checkpointing: bool = False


def check_fsdp_config(
    config: FsdpConfig, *, world_size: int, cuda: bool, backend: str | None
) -> None:
    """Refuse configurations this machine cannot run, naming the option and the fix."""
    if world_size < 2:
        raise ConfigurationError(
            f"FSDP with world_size={world_size}: sharding needs at least 2 ranks; launch more "
            "processes (torchrun / trainer-runtime launch) or train without FSDP"
        )
    if backend == "nccl" and not cuda:
        raise ConfigurationError(
            "FSDP on backend 'nccl' without CUDA devices: use backend 'gloo' on CPU"
        )
    if config.cpu_offload and not cuda:
        raise ConfigurationError(
            "FsdpConfig.cpu_offload=True needs CUDA devices (it offloads GPU parameters to host "
            "memory); on CPU the parameters already live in host memory: set cpu_offload=False"
        )
    if config.mixed_precision is not None and not cuda:
        raise ConfigurationError(
            f"FsdpConfig.mixed_precision={config.mixed_precision!r} needs CUDA devices in this "
            "runtime (reduced-precision collectives are not validated on gloo): set "
            "mixed_precision=None on CPU"
        )
    if config.mixed_precision not in (None, "bf16", "fp16"):
        raise ConfigurationError(
            f"FsdpConfig.mixed_precision={config.mixed_precision!r}: use 'bf16', 'fp16' or None"
        )


def wrap_targets(model: nn.Module, config: FsdpConfig) -> list[nn.Module]:
    """The submodules (not the root) that become FSDP units, innermost first."""
    if config.wrap == "none":
        return []
    if config.wrap == "children":
        return [c for c in model.children() if any(True for _ in c.parameters())]
    if config.wrap == "transformer":
        names = set(config.layer_classes or getattr(model, "_no_split_modules", None) or ())
        if not names:
            raise ConfigurationError(
                f"TRANSFORMER_BASED_WRAP on {type(model).__name__}: no layer classes to wrap; "
                "set fsdp_config.transformer_layer_cls_to_wrap to the class names of its "
                "blocks, or use min_num_params (SIZE_BASED_WRAP)"
            )
        found = [m for m in model.modules() if m is not model and type(m).__name__ in names]
        if not found:
            present = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigurationError(
                f"fsdp_config.transformer_layer_cls_to_wrap={sorted(names)}: no such module in "
                f"{type(model).__name__} (it has {present}); name classes the model contains"
            )
        return found
    if config.min_num_params <= 0:
        raise ConfigurationError("SIZE_BASED_WRAP needs fsdp_config.min_num_params > 0")
    targets: list[nn.Module] = []

    def visit(module: nn.Module) -> int:
        # Post-order: a module is wrapped when the parameters not yet in a unit are enough.
        free = sum(visit(child) for child in module.children())
        free += sum(p.numel() for p in module.parameters(recurse=False))
        if module is not model and free >= config.min_num_params:
            targets.append(module)
            return 0
        return free

    visit(model)
    return targets


def _sync_module_states(model: nn.Module) -> None:
    """Rank 0's parameters and buffers on every rank (what DDP does when it wraps a model)."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)


def shard_model(model: nn.Module, config: FsdpConfig | None = None) -> nn.Module:
    """Apply ``fully_shard`` to the units ``config.wrap`` selects, then to the root."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    config = config or FsdpConfig()
    cuda = any(p.is_cuda for p in model.parameters())
    check_fsdp_config(
        config,
        world_size=collectives.world_size(),
        cuda=cuda,
        backend=dist.get_backend() if dist.is_initialized() else None,
    )
    kwargs: dict[str, Any] = {"reshard_after_forward": config.reshard_after_forward}
    if config.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    if config.mixed_precision is not None:
        dtype = torch.bfloat16 if config.mixed_precision == "bf16" else torch.float16
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    targets = wrap_targets(model, config)
    if config.sync_module_states and dist.is_initialized():
        _sync_module_states(model)
    if config.activation_checkpointing:
        if not targets:
            raise ConfigurationError(
                "activation_checkpointing=True needs wrapped units (auto wrap), not only the root"
            )
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing,
        )

        chosen = {id(m) for m in targets}
        apply_activation_checkpointing(model, check_fn=lambda m: id(m) in chosen)
    for unit in targets:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model


def full_state_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The gathered (unsharded) model state on rank 0, as contiguous CPU tensors; {} elsewhere.

    A collective: every rank must call it.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    return {k: v.detach().contiguous() for k, v in state.items()}


# -- sharded checkpoints ------------------------------------------------------------------------
def shard_file_name(rank: int, world_size: int) -> str:
    """The file of ``rank``'s pieces of the state."""
    return shares.shard_file_name(SHARD_STEM, rank + 1, world_size)


def _chunk(t: torch.Tensor) -> tuple[list[int], list[int]]:
    """(offsets, sizes) of this rank's piece of DTensor ``t`` in the global tensor."""
    chunks = t.__create_chunk_list__()  # type: ignore[attr-defined]
    if len(chunks) != 1:
        raise CheckpointError(f"a DTensor with {len(chunks)} local chunks cannot be saved")
    return list(chunks[0].offsets), list(chunks[0].sizes)


def _owns_replica(t: torch.Tensor) -> bool:
    """Whether this rank writes DTensor ``t``'s piece: on a mesh dimension where the tensor is
    replicated only the first coordinate does (under fully_shard, every rank writes its own)."""
    from torch.distributed.tensor import Replicate

    mesh = t.device_mesh  # type: ignore[attr-defined]
    return all(
        mesh.get_local_rank(dim) == 0
        for dim, placement in enumerate(t.placements)  # type: ignore[attr-defined]
        if isinstance(placement, Replicate)
    )


def _state_dicts(
    model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The model's and the optimizer's state dicts keyed by parameter names, with sharded
    parameters and moments as DTensors (nothing gathered). Creates an empty optimizer's state."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return dict(get_model_state_dict(model)), None
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return dict(model_sd), dict(optim_sd)


def _flatten(
    model_sd: dict[str, Any], optim_sd: dict[str, Any] | None
) -> tuple[dict[str, torch.Tensor], str | None]:
    """Every tensor of both state dicts under one key (``model.<name>``, and the optimizer's
    keys of :func:`optimizer_state_to_tensors`), and the optimizer's structure."""
    flat = {
        f"{_MODEL_PREFIX}{name}": t for name, t in model_sd.items() if isinstance(t, torch.Tensor)
    }
    meta = None
    if optim_sd is not None:
        tensors, meta = optimizer_state_to_tensors(optim_sd)
        flat.update(tensors)
    return flat, meta


def local_state_file(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, rank: int, world_size: int
) -> tuple[str, TensorFile]:
    """This rank's file of a sharded checkpoint: its pieces of every sharded tensor (no gather,
    no copy: views of the local shards, written as they are serialised) and, on rank 0, the
    replicated tensors (optimizer steps, buffers) and the optimizer's structure. The safetensors
    metadata records where each piece sits in its global tensor."""
    from torch.distributed.tensor import DTensor

    flat, optimizer_meta = _flatten(*_state_dicts(model, optimizer))
    tensors: dict[str, torch.Tensor] = {}
    pieces: dict[str, dict[str, list[int]]] = {}
    for key, t in flat.items():
        if isinstance(t, DTensor):
            if not _owns_replica(t):
                continue
            offsets, _ = _chunk(t)
            tensors[key] = t.to_local().detach()
            pieces[key] = {"offsets": offsets, "shape": list(t.shape)}
        elif rank == 0:
            tensors[key] = t.detach()
    layout = {"format": SHARDED_FORMAT, "rank": rank, "world_size": world_size, "pieces": pieces}
    metadata = {_LAYOUT_KEY: json.dumps(layout, separators=(",", ":"), sort_keys=True)}
    if rank == 0 and optimizer_meta is not None:
        metadata[OPTIMIZER_META_KEY] = optimizer_meta
    return shard_file_name(rank, world_size), TensorFile(tensors, metadata)


def sharded_manifest_entry(world_size: int, *, optimizer: bool) -> dict[str, Any]:
    """The manifest entry that marks a checkpoint as sharded (pass it to ``writer.commit``)."""
    return {
        _MANIFEST_KEY: {
            "format": SHARDED_FORMAT,
            "world_size": world_size,
            "files": [shard_file_name(r, world_size) for r in range(world_size)],
            "optimizer": optimizer,
        }
    }


def save_sharded(
    output_dir: str,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    json_files: dict[str, Any] | None = None,
    attempt: int | None = None,
    storage_options: dict[str, Any] | None = None,
    write_extra: Callable[[CheckpointWriter], None] | None = None,
) -> CheckpointInfo:
    """Write ``checkpoint-<step>`` of a sharded model (and optimizer) from every rank.

    Every rank writes its own file of pieces at the same time (checksummed as written); rank 0
    also writes ``json_files``. ``write_extra(writer)`` runs on every rank before the commit, to
    add files of its own (per-rank RNG state, trainer state).
    """
    rank, world = collectives.rank(), collectives.world_size()
    writer = CheckpointWriter(
        output_dir,
        step,
        rank=rank,
        world_size=world,
        attempt=attempt,
        barrier=collectives.barrier,
        storage_options=storage_options,
    )
    writer.begin()
    name, data = local_state_file(model, optimizer, rank, world)
    writer.write_entry(name, data)
    if rank == 0:
        for filename, obj in (json_files or {}).items():
            writer.write_json(filename, obj)
    if write_extra is not None:
        write_extra(writer)
    return writer.commit(sharded_manifest_entry(world, optimizer=optimizer is not None))


def sharded_manifest(info: CheckpointInfo) -> dict[str, Any] | None:
    """The sharding entry of a checkpoint's manifest; None for a checkpoint that is not sharded."""
    entry = (info.manifest or {}).get(_MANIFEST_KEY)
    return dict(entry) if isinstance(entry, dict) else None


class _Pieces:
    """The pieces every rank saved, found through the files' headers; read slice by slice."""

    def __init__(self, reader: CheckpointReader, files: list[str]) -> None:
        self.reader = reader
        self.where: dict[str, list[tuple[str, list[int], list[int]]]] = {}
        self.replicated: dict[str, str] = {}
        self.optimizer_meta: str | None = None
        self._open: dict[str, Any] = {}
        self._loaded: dict[str, dict[str, torch.Tensor]] = {}
        for name in files:
            metadata = reader.load_metadata(name)
            layout = json.loads(metadata.get(_LAYOUT_KEY) or "{}")
            if layout.get("format") != SHARDED_FORMAT:
                raise ResumeError(f"{name} of {reader.path} is not a file of {SHARDED_FORMAT}")
            pieces = layout.get("pieces") or {}
            for key, entry in pieces.items():
                self.where.setdefault(key, []).append(
                    (name, list(entry["offsets"]), list(entry["shape"]))
                )
            for key in self._keys(name):
                if key not in pieces:
                    self.replicated.setdefault(key, name)
            if OPTIMIZER_META_KEY in metadata:
                self.optimizer_meta = metadata[OPTIMIZER_META_KEY]

    def _keys(self, name: str) -> list[str]:
        path = self.reader._local_path(name)
        if path is not None:
            from safetensors import safe_open

            handle = self._open.get(name)
            if handle is None:
                handle = self._open[name] = safe_open(path, framework="pt")
            return list(handle.keys())
        return list(self._whole(name))

    def _whole(self, name: str) -> dict[str, torch.Tensor]:
        """A remote file, downloaded once (object stores: no slicing without ranged reads)."""
        if name not in self._loaded:
            self._loaded[name] = self.reader.load_tensors_and_metadata(name)[0]
        return self._loaded[name]

    def _slice(self, name: str, key: str, lo: list[int], hi: list[int]) -> torch.Tensor:
        index = tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))
        if name in self._open:
            return self._open[name].get_slice(key)[index]
        return self._whole(name)[key][index]

    def fill(self, key: str, target: torch.Tensor) -> None:
        """Copy the saved values of ``key`` into ``target`` (a DTensor: its local piece)."""
        from torch.distributed.tensor import DTensor

        if not isinstance(target, DTensor):
            name = self.replicated.get(key)
            if name is None:
                raise ResumeError(f"{self.reader.path} holds no {key!r}")
            with torch.no_grad():
                target.copy_(self._slice(name, key, [0] * target.dim(), list(target.shape)))
            return
        saved = self.where.get(key)
        if not saved:
            raise ResumeError(f"{self.reader.path} holds no sharded {key!r}")
        offsets, sizes = _chunk(target)
        if list(saved[0][2]) != list(target.shape):
            raise ResumeError(
                f"{key!r} in {self.reader.path} has shape {saved[0][2]}, this model "
                f"{list(target.shape)}: resume with the model it was saved from"
            )
        local = target.to_local()
        covered = 0
        with torch.no_grad():
            for name, start, _ in saved:
                piece_shape = self._piece_shape(name, key)
                lo = [max(a, b) for a, b in zip(start, offsets, strict=True)]
                hi = [
                    min(a + n, b + m)
                    for a, n, b, m in zip(start, piece_shape, offsets, sizes, strict=True)
                ]
                if any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)):
                    continue
                src = self._slice(
                    name,
                    key,
                    [a - s for a, s in zip(lo, start, strict=True)],
                    [h - s for h, s in zip(hi, start, strict=True)],
                )
                dst = local[
                    tuple(slice(a - o, h - o) for a, h, o in zip(lo, hi, offsets, strict=True))
                ]
                dst.copy_(src)
                covered += src.numel()
        if covered != local.numel():
            raise ResumeError(
                f"{key!r}: the pieces in {self.reader.path} cover {covered} of this rank's "
                f"{local.numel()} values of its piece (global shape {list(target.shape)})"
            )

    def whole(self, name: str, key: str) -> torch.Tensor:
        """The piece of ``key`` in file ``name``, whole."""
        if name in self._open:
            return self._open[name].get_tensor(key)
        return self._whole(name)[key]

    def _piece_shape(self, name: str, key: str) -> list[int]:
        if name in self._open:
            return list(self._open[name].get_slice(key).get_shape())
        return list(self._whole(name)[key].shape)

    def close(self) -> None:
        self._open.clear()
        self._loaded.clear()


def consolidated_model(
    path: str, storage_options: dict[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    """The whole model state of a complete sharded checkpoint as plain CPU tensors, rebuilt
    from every rank's pieces in one process (no process group: for inspection, comparison and
    export; it holds the whole model in memory). Checksums are checked."""
    reader = CheckpointReader(path, storage_options=storage_options)
    sharding = sharded_manifest(reader.info) or {}
    if sharding.get("format") != SHARDED_FORMAT:
        raise ResumeError(f"{path} is not a {SHARDED_FORMAT} checkpoint: {sharding or 'absent'}")
    files = [str(f) for f in sharding.get("files") or []]
    for name in files:
        reader.verify_in_background(name)
    pieces = _Pieces(reader, files)
    out: dict[str, torch.Tensor] = {}
    try:
        for key, name in pieces.replicated.items():
            if key.startswith(_MODEL_PREFIX):
                out[key.removeprefix(_MODEL_PREFIX)] = pieces.whole(name, key)
        for key, saved in pieces.where.items():
            if not key.startswith(_MODEL_PREFIX):
                continue
            first = saved[0][0]
            full = torch.empty(saved[0][2], dtype=pieces.whole(first, key).dtype)
            for name, start, _ in saved:
                part = pieces.whole(name, key)
                index = tuple(slice(a, a + n) for a, n in zip(start, part.shape, strict=True))
                full[index] = part
            out[key.removeprefix(_MODEL_PREFIX)] = full
    finally:
        pieces.close()
    reader.wait_verified()
    return out


def load_sharded(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load a complete sharded checkpoint into ``model`` (and ``optimizer``) on every rank, at
    any number of ranks (each reads the slices of the saved pieces that overlap its own).

    Returns the checkpoint's JSON files (name -> object). Raises ResumeError when the checkpoint
    is incomplete, not a sharded one, or a file does not match its checksum (each file is
    checked by one rank; the ranks agree before any state is used).
    """
    reader = CheckpointReader(path, storage_options=storage_options)
    sharding = sharded_manifest(reader.info) or {}
    if sharding.get("format") == _DCP_FORMAT:
        _load_dcp(reader, model, optimizer)
    elif sharding.get("format") == SHARDED_FORMAT:
        _load_pieces(reader, sharding, model, optimizer)
    else:
        raise ResumeError(
            f"{path} is not a sharded (FSDP) checkpoint (manifest {_MANIFEST_KEY!r}: "
            f"{sharding or 'absent'}); load it with the Trainer's regular resume"
        )
    files = {e["path"] for e in (reader.info.manifest or {}).get("files", [])}
    return {n: reader.load_json(n) for n in sorted(files) if n.endswith(".json")}


def _check_optimizer(reader: CheckpointReader, sharding: dict[str, Any], optimizer: Any) -> None:
    if optimizer is not None and sharding.get("optimizer") is False:
        raise ResumeError(
            f"{reader.path} holds no optimizer shards (saved with save_only_model); load it "
            "without an optimizer"
        )


def _load_pieces(
    reader: CheckpointReader,
    sharding: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    _check_optimizer(reader, sharding, optimizer)
    files = [str(f) for f in sharding.get("files") or []]
    rank, world = collectives.rank(), collectives.world_size()
    for i, name in enumerate(files):
        if i % world == rank:  # every file checked once, by one rank
            reader.verify_in_background(name)
    pieces = _Pieces(reader, files)
    try:
        model_sd, optim_sd = _state_dicts(model, optimizer)
        targets, _ = _flatten(model_sd, optim_sd)
        for key, target in targets.items():
            pieces.fill(key, target)
        if optim_sd is not None:
            if pieces.optimizer_meta is None:
                raise ResumeError(f"{reader.path} holds no optimizer structure")
            optim_sd = optimizer_state_from_tensors(targets, pieces.optimizer_meta)
    finally:
        pieces.close()
    error: ResumeError | None = None
    try:
        reader.wait_verified()
    except ResumeError as exc:
        error = exc
    if collectives.agree_to_stop(error is not None):
        raise error or ResumeError(f"{reader.path}: a file failed its checksum on another rank")
    if optim_sd is not None:
        assert optimizer is not None
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    else:
        set_state_dict(model, [], model_state_dict=model_sd, optim_state_dict={})


def _load_dcp(
    reader: CheckpointReader, model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> None:
    """A checkpoint of an earlier version, written by torch.distributed.checkpoint (DCP)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    _check_optimizer(reader, sharded_manifest(reader.info) or {}, optimizer)
    model_sd, optim_sd = _state_dicts(model, optimizer)
    state: dict[str, Any] = {"model": model_sd}
    if optim_sd is not None:
        state["optim"] = optim_sd
    dcp.load(state, storage_reader=_dcp_reader_for(reader.info.path))
    if optimizer is not None:
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
    else:
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})


def _dcp_reader_for(path: str) -> Any:
    import torch.distributed.checkpoint as dcp

    if "://" not in path or path.startswith("file://"):
        return dcp.FileSystemReader(path.removeprefix("file://"))
    from torch.distributed.checkpoint.fsspec_filesystem import FsspecReader

    return FsspecReader(path)
