"""FSDP (fully_shard) models: sharded checkpoints through torch.distributed.checkpoint (DCP), under
the same commit rules as every other checkpoint.

Save protocol (every rank calls :func:`save_sharded` at the same step)::

    coordinator: checkpoint-<step>/ + sentinel (fsynced), barrier       (CheckpointWriter.begin)
    every rank : its DCP shard files __<rank>_<i>.distcp (fsynced by DCP), rank 0 also .metadata
    every rank : records its files (size + checksum, read back from storage)
    rank 0     : extra JSON files (trainer_state.json, ...)
    coordinator: manifest.json (the commit point), removes the sentinel (CheckpointWriter.commit)

So a rank killed in the middle leaves a checkpoint without manifest, which every reader treats as
incomplete, exactly like a DDP checkpoint. :func:`load_sharded` opens the checkpoint through
:class:`CheckpointReader` (refusing incomplete ones) before DCP reads a byte; DCP re-shards on load,
so a sharded checkpoint can be loaded by a different number of ranks.

Scope: FSDP2 (``torch.distributed.fsdp.fully_shard``) on CPU with gloo and on CUDA with NCCL.
Options that only make sense on GPUs are validated up front by :func:`check_fsdp_config` and
refused with a clear error on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from trainer_runtime.checkpoint.digest import file_record
from trainer_runtime.checkpoint.io import CheckpointReader, CheckpointWriter
from trainer_runtime.checkpoint.layout import CheckpointInfo
from trainer_runtime.distributed import collectives
from trainer_runtime.errors import CheckpointError, ConfigurationError, ResumeError

__all__ = [
    "DCP_METADATA_NAME",
    "SHARDED_FORMAT",
    "FsdpConfig",
    "ShardedCheckpointWriter",
    "check_fsdp_config",
    "full_state_tensors",
    "load_sharded",
    "save_sharded",
    "shard_model",
    "sharded_manifest",
    "wrap_targets",
    "write_shards",
]

SHARDED_FORMAT = "fsdp-dcp/1"
DCP_METADATA_NAME = ".metadata"
_MANIFEST_KEY = "sharding"


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


class ShardedCheckpointWriter(CheckpointWriter):
    """A CheckpointWriter that also records files DCP wrote on its own."""

    def record_written(self, filename: str) -> None:
        """Add a file already on storage to this rank's record (size and checksum read back)."""
        self._require_open()
        if filename in self._files:
            raise CheckpointError(f"{filename} recorded twice for {self.path}")
        # DCP wrote (and fsynced) the file; record it the way write_bytes records its own.
        size, digest = self.root.hash_file(self._rel(filename))
        self._files[filename] = file_record(filename, size, digest)


def _local_path(url: str) -> str | None:
    if "://" not in url:
        return url
    if url.startswith("file://"):
        return url.removeprefix("file://")
    return None


def _writer_for(path: str) -> Any:
    import torch.distributed.checkpoint as dcp

    local = _local_path(path)
    if local is not None:
        return dcp.FileSystemWriter(local, sync_files=True)
    from torch.distributed.checkpoint.fsspec_filesystem import FsspecWriter

    return FsspecWriter(path, sync_files=True)


def _reader_for(path: str) -> Any:
    import torch.distributed.checkpoint as dcp

    local = _local_path(path)
    if local is not None:
        return dcp.FileSystemReader(local)
    from torch.distributed.checkpoint.fsspec_filesystem import FsspecReader

    return FsspecReader(path)


def _own_files(listing: dict[str, int], rank: int) -> list[str]:
    own = [n for n in listing if n.startswith(f"__{rank}_") and n.endswith(".distcp")]
    if rank == 0 and DCP_METADATA_NAME in listing:
        own.append(DCP_METADATA_NAME)
    return sorted(own)


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

    ``write_extra(writer)`` runs on every rank after the shards are written and before the
    commit, to add files of its own (per-rank RNG state, the gathered model, trainer state).
    """
    rank, world = collectives.rank(), collectives.world_size()
    writer = ShardedCheckpointWriter(
        output_dir,
        step,
        rank=rank,
        world_size=world,
        attempt=attempt,
        barrier=collectives.barrier,
        storage_options=storage_options,
    )
    writer.begin()
    manifest = write_shards(writer, model, optimizer)
    if rank == 0:
        for name, obj in (json_files or {}).items():
            writer.write_json(name, obj)
    if write_extra is not None:
        write_extra(writer)
    return writer.commit(manifest)


def write_shards(
    writer: ShardedCheckpointWriter,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Write this rank's DCP shards of ``model`` (and ``optimizer``) into the begun checkpoint of
    ``writer`` and record them; every rank calls it. Returns the manifest entry to pass to
    ``writer.commit`` (it marks the checkpoint as sharded)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    else:
        state = {"model": get_state_dict(model, [])[0]}
    # DCP gathers every rank's write result and raises on all ranks when one failed, so an error
    # here leaves every rank without a commit: the sentinel stays, the checkpoint is incomplete.
    dcp.save(state, storage_writer=_writer_for(writer.path))
    for name in _own_files(writer.root.listdir(writer.name), writer.rank):
        writer.record_written(name)
    return {
        _MANIFEST_KEY: {
            "format": SHARDED_FORMAT,
            "metadata": DCP_METADATA_NAME,
            "optimizer": optimizer is not None,
        }
    }


def sharded_manifest(info: CheckpointInfo) -> dict[str, Any] | None:
    """The sharding entry of a checkpoint's manifest; None for a checkpoint that is not sharded."""
    entry = (info.manifest or {}).get(_MANIFEST_KEY)
    return dict(entry) if isinstance(entry, dict) else None


def load_sharded(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load a complete sharded checkpoint into ``model`` (and ``optimizer``) on every rank.

    Returns the checkpoint's JSON files (name -> object). Raises ResumeError when the checkpoint
    is incomplete or not a sharded one.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    reader = CheckpointReader(path, storage_options=storage_options)
    sharding = (reader.info.manifest or {}).get(_MANIFEST_KEY) or {}
    if sharding.get("format") != SHARDED_FORMAT:
        raise ResumeError(
            f"{path} is not a sharded (FSDP) checkpoint (manifest {_MANIFEST_KEY!r}: "
            f"{sharding or 'absent'}); load it with the Trainer's regular resume"
        )
    if optimizer is not None and sharding.get("optimizer") is False:
        raise ResumeError(
            f"{path} holds no optimizer shards (saved with save_only_model); load it without "
            "an optimizer"
        )
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    else:
        state = {"model": get_state_dict(model, [])[0]}
    dcp.load(state, storage_reader=_reader_for(reader.info.path))
    if optimizer is not None:
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
    else:
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
    files = {e["path"] for e in (reader.info.manifest or {}).get("files", [])}
    return {n: reader.load_json(n) for n in sorted(files) if n.endswith(".json")}
