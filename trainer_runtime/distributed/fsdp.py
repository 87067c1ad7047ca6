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
rebuilds any other sharding: each rank reads every file's header alone (ranged reads), then only
the byte ranges of the pieces that overlap its new piece, straight into it where it can (no
whole-file buffer; local disk and object stores alike, counted by ``read_stats``); each file's
checksum is computed by one rank from the same pass (:func:`verifier_of`), the ranks agreeing
before the state is used. Pieces that do not cover a tensor make the checkpoint corrupt
(CheckpointCorruptError: the resume falls back). The optimizer state is rebuilt from what the
checkpoint holds (parameters without state get none), and a save before the first step
fabricates none. A rank killed in the middle leaves a checkpoint without
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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from trainer_runtime.checkpoint import shares
from trainer_runtime.checkpoint.digest import new_hasher
from trainer_runtime.checkpoint.io import (
    OPTIMIZER_META_KEY,
    CheckpointReader,
    CheckpointWriter,
    optimizer_state_from_tensors,
    optimizer_state_to_tensors,
)
from trainer_runtime.checkpoint.layout import CheckpointInfo
from trainer_runtime.checkpoint.safetensors_stream import (
    CHUNK_BYTES,
    TensorEntry,
    TensorFile,
    read_header_range,
    tensor_entries,
)
from trainer_runtime.distributed import collectives
from trainer_runtime.errors import (
    CheckpointCorruptError,
    CheckpointError,
    ConfigurationError,
    ResumeError,
    StorageError,
)

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
    "uncovered",
    "verifier_of",
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
# prefixes activation checkpointing and torch.compile add to parameter names
_CKPT_WRAPPED = "_checkpoint_wrapped_module."
_COMPILED = "_orig_mod."
# resume: ranges below this are read several at once (object stores: a round trip each), and
# merged with their neighbours instead of read straight into their destination
_SMALL_READ = 1 << 20
_PARALLEL_READS = 8


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


def _param_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its name in the model's state dict (wrappers' prefixes removed, as
    torch.distributed.checkpoint.state_dict names them)."""
    return {
        id(p): name.replace(_CKPT_WRAPPED, "").replace(_COMPILED, "")
        for name, p in model.named_parameters()
    }


def _optimizer_ids(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    """The optimizer's parameters in the order its ``state_dict()`` numbers them."""
    seen: dict[int, torch.nn.Parameter] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            seen.setdefault(id(p), p)
    return list(seen.values())


def _unstepped_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """The state dict of an optimizer that has not stepped yet (no state), keyed by parameter
    names like get_state_dict's, built without the fake step get_state_dict takes to create
    state (which would make Adam's ``step`` 1 on the live optimizer and allocate moments)."""
    names = _param_names(model)
    order = {id(p): i for i, p in enumerate(_optimizer_ids(optimizer))}
    by_index = {i: names[pid] for pid, i in order.items() if pid in names}
    sd = optimizer.state_dict()
    groups = []
    for group in sd["param_groups"]:
        groups.append({**group, "params": [by_index[i] for i in group["params"]]})
    return {"state": {}, "param_groups": groups}


def _state_dicts(
    model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The model's and the optimizer's state dicts keyed by parameter names, with sharded
    parameters and moments as DTensors (nothing gathered). An optimizer without state (before
    its first step) gives an empty state: nothing is fabricated, the live optimizer untouched."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return dict(get_model_state_dict(model)), None
    if not optimizer.state:
        return dict(get_model_state_dict(model)), _unstepped_optimizer_state(model, optimizer)
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


def uncovered(lo: int, hi: int, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``[lo, hi)`` that no ``[start, end)`` of ``spans`` covers, in order (pure)."""
    gaps: list[tuple[int, int]] = []
    at = lo
    for start, end in sorted(spans):
        if end <= at:
            continue
        if start >= hi:
            break
        if start > at:
            gaps.append((at, start))
        at = max(at, end)
    if at < hi:
        gaps.append((at, hi))
    return gaps


def _hand_out(batch: list[_Read], raw: memoryview) -> None:
    """Give each read of ``batch`` its bytes of ``raw`` (read from ``batch[0].begin`` on)."""
    base = batch[0].begin
    for r in batch:
        part = raw[r.begin - base : r.end - base]
        if r.dest is not None:
            r.dest[:] = part
        elif r.finish is not None:
            r.finish(part)


def _batches(reads: list[_Read]) -> list[list[_Read]]:
    """Reads (in file order) grouped into one ranged read each: adjacent ones together up to
    CHUNK_BYTES, except that a read straight into a destination of _SMALL_READ or more stays
    alone (no copy through scratch)."""
    out: list[list[_Read]] = []
    for r in reads:
        alone = r.dest is not None and r.end - r.begin >= _SMALL_READ
        last = out[-1] if out else None
        if (
            last is not None
            and not alone
            and not (last[-1].dest is not None and last[-1].end - last[-1].begin >= _SMALL_READ)
            and last[-1].end == r.begin
            and r.end - last[0].begin <= CHUNK_BYTES
        ):
            last.append(r)
        else:
            out.append([r])
    return out


def verifier_of(index: int, files: int, world: int) -> int:
    """The rank that checks file ``index`` of ``files`` against its checksum (reading it whole):
    the one whose piece starts where the file's does, so at the saving world size every rank
    checks the one file it reads anyway, and no file is read twice for its checksum (pure)."""
    return index * world // files


@dataclass
class _Read:
    """One ranged read of a file: straight into ``dest`` (a contiguous destination's bytes), or
    into scratch memory that ``finish`` copies from (None: read only for the checksum)."""

    begin: int
    end: int
    dest: memoryview | None = None
    finish: Callable[[memoryview], None] | None = None


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's memory as bytes (no copy)."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


class _Pieces:
    """The pieces every rank saved, found through the files' headers alone (ranged reads of the
    length and the JSON), then read range by range: only the bytes of the pieces that overlap
    this rank's destination, each straight into the destination's memory where it is a
    contiguous CPU tensor, else through a scratch block of at most :data:`CHUNK_BYTES`. Every
    read goes through the storage seam (counted: :mod:`read_stats`)."""

    def __init__(self, reader: CheckpointReader, files: list[str]) -> None:
        self.reader = reader
        self.storage = reader.storage
        self.entries: dict[str, dict[str, TensorEntry]] = {}
        self.where: dict[str, list[tuple[str, list[int], list[int]]]] = {}
        self.replicated: dict[str, str] = {}
        self.optimizer_meta: str | None = None
        self._reads: dict[str, list[_Read]] = {}
        self._scratch: torch.Tensor | None = None
        # each file's header bytes as read (the checksum pass hashes them, not reads them again)
        self._heads: dict[str, bytes] = {}
        for name in files:
            head: list[bytes] = []

            def read(offset: int, dest: memoryview, name: str = name, head: list = head) -> None:
                self.storage.read_range(name, offset, dest)
                head.append(bytes(dest))

            try:
                header, base = read_header_range(read)
                self._heads[name] = b"".join(head)
                entries = tensor_entries(header, base)
            except StorageError as exc:
                raise ResumeError(f"cannot read {name} of {reader.path}: {exc}") from exc
            except CheckpointError as exc:
                raise CheckpointCorruptError(f"{name} of {reader.path}: {exc}") from exc
            self.entries[name] = entries
            metadata = header.get("__metadata__") or {}
            try:
                layout = json.loads(metadata.get(_LAYOUT_KEY) or "{}")
            except ValueError as exc:
                raise CheckpointCorruptError(
                    f"{name} of {reader.path}: its {_LAYOUT_KEY} metadata is not JSON: {exc}"
                ) from exc
            if layout.get("format") != SHARDED_FORMAT:
                raise ResumeError(f"{name} of {reader.path} is not a file of {SHARDED_FORMAT}")
            pieces = layout.get("pieces") or {}
            for key, entry in pieces.items():
                if key not in entries or len(entry["offsets"]) != len(entries[key].shape):
                    raise CheckpointCorruptError(
                        f"{name} of {reader.path}: its layout lists a piece of {key!r} that "
                        "the file does not hold as described"
                    )
                self.where.setdefault(key, []).append(
                    (name, list(entry["offsets"]), list(entry["shape"]))
                )
            for key in entries:
                if key not in pieces:
                    self.replicated.setdefault(key, name)
            if OPTIMIZER_META_KEY in metadata:
                self.optimizer_meta = metadata[OPTIMIZER_META_KEY]

    def entry(self, key: str) -> TensorEntry:
        """The header entry of ``key``: its replicated copy, or its first saved piece."""
        name = self.replicated.get(key) or self.where[key][0][0]
        return self.entries[name][key]

    # -- planning --------------------------------------------------------------------------
    def plan(self, key: str, target: torch.Tensor) -> None:
        """Plan the reads that fill ``target`` (a DTensor: its local piece) with the saved
        values of ``key``. CheckpointCorruptError, naming the tensor and the missing rows,
        when the saved pieces do not cover the piece exactly."""
        from torch.distributed.tensor import DTensor

        if not isinstance(target, DTensor):
            name = self.replicated.get(key)
            if name is None:
                raise ResumeError(f"{self.reader.path} holds no {key!r}")
            entry = self.entries[name][key]
            if tuple(target.shape) != entry.shape:
                raise ResumeError(
                    f"{key!r} in {self.reader.path} has shape {list(entry.shape)}, this model "
                    f"{list(target.shape)}: resume with the model it was saved from"
                )
            self._plan_box(name, entry, [0] * target.dim(), list(entry.shape), target.detach())
            return
        saved = self.where.get(key)
        if not saved:
            raise ResumeError(f"{self.reader.path} holds no sharded {key!r}")
        if list(saved[0][2]) != list(target.shape):
            raise ResumeError(
                f"{key!r} in {self.reader.path} has shape {saved[0][2]}, this model "
                f"{list(target.shape)}: resume with the model it was saved from"
            )
        offsets, sizes = _chunk(target)
        local = target.to_local().detach()
        covered = 0
        spans: list[tuple[int, int]] = []
        for name, start, _ in saved:
            entry = self.entries[name][key]
            if entry.shape and entry.shape[1:] == tuple(target.shape[1:]):
                spans.append((start[0], start[0] + entry.shape[0]))
            lo = [max(a, b) for a, b in zip(start, offsets, strict=True)]
            hi = [
                min(a + n, b + m)
                for a, n, b, m in zip(start, entry.shape, offsets, sizes, strict=True)
            ]
            if any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)):
                continue
            dst = local[tuple(slice(a - o, h - o) for a, h, o in zip(lo, hi, offsets, strict=True))]
            self._plan_box(
                name,
                entry,
                [a - s for a, s in zip(lo, start, strict=True)],
                [h - s for h, s in zip(hi, start, strict=True)],
                dst,
            )
            covered += dst.numel()
        if covered != local.numel():
            what = f"values {covered} of {local.numel()}"
            if local.dim() and sizes[0]:
                gaps = uncovered(offsets[0], offsets[0] + sizes[0], spans)
                if gaps:
                    what = "rows " + ", ".join(f"{a}:{b}" for a, b in gaps)
            raise CheckpointCorruptError(
                f"{self.reader.path} is corrupt: its pieces of {key!r} (global shape "
                f"{list(target.shape)}) do not cover {what} of this rank's piece (rows "
                f"{offsets[0] if offsets else 0}:{(offsets[0] + sizes[0]) if offsets else 0})"
            )

    def _plan_box(
        self, name: str, entry: TensorEntry, lo: list[int], hi: list[int], dst: torch.Tensor
    ) -> None:
        """Reads of the box ``[lo, hi)`` of the saved piece ``entry`` into ``dst``: whole rows
        (dim 0) at a time, at most CHUNK_BYTES each."""
        reads = self._reads.setdefault(name, [])
        if not entry.shape:  # a scalar (an optimizer's step)
            reads.append(self._read(entry.begin, entry.end, entry, dst, []))
            return
        row_bytes = entry.itemsize
        for n in entry.shape[1:]:
            row_bytes *= n
        if row_bytes == 0 or dst.numel() == 0:
            return
        trailing = [slice(a, b) for a, b in zip(lo[1:], hi[1:], strict=True)]
        rows = max(1, CHUNK_BYTES // row_bytes)
        for r0 in range(lo[0], hi[0], rows):
            r1 = min(r0 + rows, hi[0])
            part = dst[r0 - lo[0] : r1 - lo[0]]
            reads.append(
                self._read(
                    entry.begin + r0 * row_bytes,
                    entry.begin + r1 * row_bytes,
                    entry,
                    part,
                    trailing,
                    rows=r1 - r0,
                )
            )

    @staticmethod
    def _read(
        begin: int,
        end: int,
        entry: TensorEntry,
        part: torch.Tensor,
        trailing: list[slice],
        rows: int | None = None,
    ) -> _Read:
        whole_rows = all(
            s.start == 0 and s.stop == n for s, n in zip(trailing, entry.shape[1:], strict=True)
        )
        if (
            whole_rows
            and part.device.type == "cpu"
            and part.dtype == entry.dtype
            and part.is_contiguous()
        ):
            return _Read(begin, end, dest=_bytes_of(part))
        shape = (rows, *entry.shape[1:]) if rows is not None else entry.shape

        def finish(raw: memoryview) -> None:
            src = torch.frombuffer(raw, dtype=torch.uint8).view(entry.dtype).reshape(shape)
            with torch.no_grad():
                part.copy_(src[(slice(None), *trailing)] if trailing else src)

        return _Read(begin, end, finish=finish)

    # -- reading ---------------------------------------------------------------------------
    def read(self, name: str, *, verify: bool) -> None:
        """Do the planned reads of file ``name`` in file order. ``verify``: read the bytes in
        between too (into scratch) and check the whole file against the manifest's checksum,
        computed from the bytes as they arrive (:meth:`CheckpointReader.wait_verified`
        reports it): the file is read once, for the state and its checksum together."""
        reads = sorted(self._reads.pop(name, []), key=lambda r: r.begin)
        expected = self.reader._expected(name) if verify else None
        hasher = new_hasher(expected[0]) if expected else None
        if hasher is not None:
            size = self.reader._sizes.get(name)
            if size is None:
                size = self.storage.size(name)
            head = self._heads[name]
            hasher.update(head)
            reads = self._with_gaps(reads, size, len(head))
        on_block = hasher.update if hasher is not None else None
        batches = _batches(reads)
        try:
            if hasher is None:
                # small ranges (a step counter, a bias) in parallel: on an object store each
                # is a round trip; the large ones one after the other, through one scratch block
                # (the threads only read; copies into destinations, maybe on a GPU, stay on
                # this thread, whose device is the rank's)
                small = [b for b in batches if b[-1].end - b[0].begin < _SMALL_READ]
                if small:
                    with ThreadPoolExecutor(
                        _PARALLEL_READS, thread_name_prefix="fsdp-read"
                    ) as pool:
                        futures = [pool.submit(self._fetch, name, b) for b in small]
                        for batch, future in zip(small, futures, strict=True):
                            _hand_out(batch, future.result())
                batches = [b for b in batches if b[-1].end - b[0].begin >= _SMALL_READ]
            for batch in batches:
                self._read_batch(name, batch, on_block, self._scratch_of)
        except StorageError as exc:
            raise ResumeError(f"cannot read {name} of {self.reader.path}: {exc}") from exc
        if hasher is not None:
            assert expected is not None
            done: Future[str] = Future()
            done.set_result(hasher.hexdigest())
            self.reader._checks.append((name, done, expected))

    def _read_batch(
        self,
        name: str,
        batch: list[_Read],
        on_block: Callable[[memoryview], Any] | None,
        scratch: Callable[[int], memoryview] | None = None,
    ) -> None:
        """One ranged read for ``batch`` (adjacent reads): straight into a lone read's
        destination, else into scratch (``scratch``, or fresh memory) handed out read by read."""
        first = batch[0]
        if len(batch) == 1 and first.dest is not None:
            self.storage.read_range(name, first.begin, first.dest, on_block)
            return
        span = batch[-1].end - first.begin
        raw = scratch(span) if scratch is not None else memoryview(bytearray(span))
        self.storage.read_range(name, first.begin, raw, on_block)
        _hand_out(batch, raw)

    def _fetch(self, name: str, batch: list[_Read]) -> memoryview:
        """The bytes of ``batch`` (adjacent reads) in fresh memory."""
        raw = memoryview(bytearray(batch[-1].end - batch[0].begin))
        self.storage.read_range(name, batch[0].begin, raw)
        return raw

    @staticmethod
    def _with_gaps(reads: list[_Read], size: int, start: int) -> list[_Read]:
        """``reads`` and reads of every byte from ``start`` on between them (for the checksum),
        in file order."""
        out: list[_Read] = []
        at = start

        def gap(lo: int, hi: int) -> None:
            for start in range(lo, hi, CHUNK_BYTES):
                out.append(_Read(start, min(start + CHUNK_BYTES, hi)))

        for r in reads:
            gap(at, r.begin)
            out.append(r)
            at = r.end
        gap(at, size)
        return out

    def _scratch_of(self, nbytes: int) -> memoryview:
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        return memoryview(self._scratch.numpy()).cast("B")[:nbytes]

    def whole(self, name: str, key: str) -> torch.Tensor:
        """The piece of ``key`` in file ``name``, whole (a new CPU tensor)."""
        entry = self.entries[name][key]
        out = torch.empty(entry.shape, dtype=entry.dtype)
        if out.numel():
            self.storage.read_range(name, entry.begin, _bytes_of(out))
        return out

    def close(self) -> None:
        self._reads.clear()
        self._scratch = None


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
            full = torch.empty(saved[0][2], dtype=pieces.entry(key).dtype)
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


def _optimizer_targets(
    model: nn.Module, optimizer: torch.optim.Optimizer, pieces: _Pieces, path: str
) -> dict[str, torch.Tensor]:
    """Empty tensors for exactly the optimizer state the checkpoint holds (its structure, in
    the file's metadata, names them): for a sharded moment a DTensor sharded as its parameter
    is, for a replicated value (a step) a CPU tensor. Parameters without saved state (never
    used, or a save before the first step) get none, as they had none; nothing is created on
    the live optimizer (no fake step)."""
    from torch.distributed.tensor import DTensor

    if pieces.optimizer_meta is None:
        raise ResumeError(f"{path} holds no optimizer structure")
    try:
        doc = json.loads(pieces.optimizer_meta)
        state = doc["state_dict"]["state"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ResumeError(f"{path}: the optimizer structure is unreadable: {exc}") from exc
    names = _param_names(model)
    params = {names[id(p)]: p for p in _optimizer_ids(optimizer) if id(p) in names}
    targets: dict[str, torch.Tensor] = {}
    for fqn, values in (state or {}).items():
        param = params.get(fqn)
        if param is None or not isinstance(values, dict):
            raise ResumeError(
                f"{path} holds optimizer state of {fqn!r}, which this optimizer does not "
                "train: resume with the model and optimizer it was saved from"
            )
        for value in values.values():
            key = value.get("__tensor__") if isinstance(value, dict) else None
            if not isinstance(key, str):
                continue
            if key in pieces.where:
                shape, dtype = pieces.where[key][0][2], pieces.entry(key).dtype
                if not isinstance(param, DTensor) or list(param.shape) != list(shape):
                    raise ResumeError(
                        f"{key!r} in {path} has shape {shape}, its parameter "
                        f"{list(param.shape)}: resume with the model it was saved from"
                    )
                targets[key] = torch.empty_like(param, dtype=dtype, requires_grad=False)
            elif key in pieces.replicated:
                entry = pieces.entry(key)
                targets[key] = torch.empty(entry.shape, dtype=entry.dtype)
            else:
                raise ResumeError(f"{path} holds no {key!r} (named by its optimizer structure)")
    return targets


def _load_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, optim_sd: dict[str, Any], path: str
) -> None:
    """Load a state dict keyed by parameter names into ``optimizer`` with its own
    ``load_state_dict`` (parameters without saved state keep none)."""
    names = _param_names(model)
    index = {names[id(p)]: i for i, p in enumerate(_optimizer_ids(optimizer))}
    saved_groups = optim_sd.get("param_groups") or []
    if len(saved_groups) != len(optimizer.param_groups):
        raise ResumeError(
            f"{path} holds {len(saved_groups)} optimizer parameter group(s), this optimizer "
            f"{len(optimizer.param_groups)}: resume with the optimizer it was saved from"
        )
    groups = []
    for saved, live in zip(saved_groups, optimizer.param_groups, strict=True):
        live_names = [names[id(p)] for p in live["params"]]
        if sorted(saved["params"]) != sorted(live_names):
            raise ResumeError(
                f"{path}: an optimizer parameter group holds {sorted(saved['params'])}, this "
                f"optimizer's {sorted(live_names)}"
            )
        groups.append({**saved, "params": [index[n] for n in live_names]})
    state = {index[fqn]: values for fqn, values in optim_sd.get("state", {}).items()}
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _load_pieces(
    reader: CheckpointReader,
    sharding: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_state_dict

    _check_optimizer(reader, sharding, optimizer)
    files = [str(f) for f in sharding.get("files") or []]
    rank, world = collectives.rank(), collectives.world_size()
    error: Exception | None = None
    optim_sd: dict[str, Any] | None = None
    model_sd: dict[str, Any] = {}
    pieces: _Pieces | None = None
    try:
        pieces = _Pieces(reader, files)
        model_sd = dict(get_model_state_dict(model))
        targets = {
            f"{_MODEL_PREFIX}{k}": t for k, t in model_sd.items() if isinstance(t, torch.Tensor)
        }
        optim_targets = (
            _optimizer_targets(model, optimizer, pieces, reader.path)
            if optimizer is not None
            else {}
        )
        for key, target in {**targets, **optim_targets}.items():
            pieces.plan(key, target)
        # Each file once, in file order: the planned ranges only, or (the one rank checking
        # it) every byte, the checksum computed as they arrive.
        for i, name in enumerate(files):
            pieces.read(name, verify=verifier_of(i, len(files), world) == rank)
        if optimizer is not None:
            assert pieces.optimizer_meta is not None
            optim_sd = optimizer_state_from_tensors(optim_targets, pieces.optimizer_meta)
        reader.wait_verified()
    except Exception as exc:  # every rank stops together (a collective follows)
        error = exc
    finally:
        if pieces is not None:
            pieces.close()
    if collectives.agree_to_stop(error is not None):
        raise error or ResumeError(f"{reader.path}: the load failed on another rank")
    if optimizer is not None:
        assert optim_sd is not None
        _load_optimizer_state(model, optimizer, optim_sd, reader.path)
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
