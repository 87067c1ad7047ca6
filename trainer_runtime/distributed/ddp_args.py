"""Data-parallel (DDP) arguments as one pydantic field group, and what the Trainer derives.

:class:`DdpArguments` is meant to be a base class of ``TrainingArguments``
(``class TrainingArguments(DdpArguments, ...)``): Hugging Face names and defaults, validated at
construction. ``log_level_replica`` is not here: it lives with the other log levels in
:mod:`trainer_runtime.features.arguments`.

Torch-free at import (``accelerator_kwargs`` imports accelerate lazily), like ``training_args``.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trainer_runtime.errors import ConfigurationError

__all__ = [
    "SUPPORTED_DDP_BACKENDS",
    "AcceleratorConfig",
    "DdpArguments",
    "accelerator_kwargs",
    "check_accelerator_world",
    "check_backend",
    "dispatch_batches",
    "even_batches",
    "per_rank_batch_size",
]

SUPPORTED_DDP_BACKENDS: tuple[str, ...] = ("gloo", "nccl", "mpi")
# Hugging Face accepts these too; they need vendor plugins this runtime does not ship.
_VENDOR_BACKENDS = ("ccl", "hccl", "cncl", "mccl", "xccl")


class AcceleratorConfig(BaseModel):
    """How batches are spread over ranks (the Hugging Face ``accelerator_config`` keys).

    Every rank always runs the same number of micro-batches per epoch (the per-step stop agreement
    and DDP's all-reduce are collectives): with ``even_batches=False`` a rank that runs out of
    samples runs a padding micro-batch whose loss and gradient are zero instead of a duplicate.
    """

    model_config = ConfigDict(extra="forbid")

    split_batches: bool = Field(
        False,
        description="per_device_train_batch_size is the global batch, split over the ranks "
        "(must divide evenly); False: every rank takes that many samples.",
    )
    dispatch_batches: bool | None = Field(
        None,
        description="The main process alone iterates the dataloader and sends every rank its "
        "share of each global batch. None: True for iterable datasets with several ranks, False "
        "for map-style ones (whose samplers shard by index; the same samples either way).",
    )
    even_batches: bool = Field(
        True,
        description="Pad the epoch by wrapping around so every rank gets as many samples; False: "
        "no sample twice, ranks short of data run zero-weight padding micro-batches.",
    )
    use_seedable_sampler: bool = Field(
        True,
        description="The batch order is a pure function of (seed, epoch), which resume relies "
        "on. Must stay True.",
    )
    non_blocking: bool = Field(
        False, description="Copy batches to the device with non_blocking=True (pinned memory)."
    )
    gradient_accumulation_kwargs: dict[str, Any] | None = Field(
        None, description="Not used: gradient accumulation follows gradient_accumulation_steps."
    )

    @model_validator(mode="after")
    def _supported(self) -> AcceleratorConfig:
        if not self.use_seedable_sampler:
            raise ValueError(
                "use_seedable_sampler=False is not supported: resuming at a batch needs the "
                "seeded order; keep use_seedable_sampler=True"
            )
        if self.gradient_accumulation_kwargs:
            raise ValueError(
                "gradient_accumulation_kwargs is not supported: set "
                "gradient_accumulation_steps instead"
            )
        return self


def load_json_or_path(value: Any) -> Any:
    """A mapping, a JSON string, or the path of a JSON file (as Hugging Face accepts for its
    dict-valued arguments); anything else is returned for the model to validate."""
    if isinstance(value, str):
        text = value.strip()
        if not text.startswith("{"):
            if not os.path.isfile(text):
                raise ValueError(
                    "neither a JSON object nor the path of an existing JSON file; pass a dict, "
                    "a JSON string or a path"
                )
            with open(text, encoding="utf-8") as fh:
                text = fh.read()
        try:
            value = json.loads(text) if text else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON ({exc})") from exc
    return value


def _load_accelerator_config(value: Any) -> Any:
    return AcceleratorConfig() if value is None else load_json_or_path(value)


class DdpArguments(BaseModel):
    """Distributed data-parallel fields of ``TrainingArguments``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_default=True)

    # -- process group -------------------------------------------------------------------------
    ddp_backend: str | None = Field(
        None,
        description="torch.distributed backend: 'gloo' (CPU), 'nccl' (CUDA) or 'mpi'. Default: "
        "nccl on CUDA, gloo on CPU.",
    )
    ddp_timeout: int = Field(
        1800,
        ge=1,
        description="Seconds a collective may wait for the other ranks before failing (passed "
        "to init_process_group).",
    )

    # -- DistributedDataParallel wrapper -------------------------------------------------------
    ddp_find_unused_parameters: bool | None = Field(
        None,
        description="Let DDP find parameters without gradients each step (slower). None: False.",
    )
    ddp_bucket_cap_mb: int | None = Field(
        None, gt=0, description="Gradient bucket size in MiB. None: torch's default (25)."
    )
    ddp_broadcast_buffers: bool | None = Field(
        None,
        description="Broadcast buffers (e.g. batch-norm statistics) from rank 0 every forward. "
        "None: torch's default (True).",
    )
    ddp_static_graph: bool | None = Field(
        None,
        description="Tell DDP the set of used parameters never changes (enables optimisations). "
        "None: False.",
    )

    # -- loss and data over ranks --------------------------------------------------------------
    average_tokens_across_devices: bool = Field(
        True,
        description="Count label tokens over all ranks (all-reduce) so the loss of a global batch "
        "is exact under data parallelism.",
    )
    accelerator_config: AcceleratorConfig = Field(
        default_factory=AcceleratorConfig,
        description="Batch distribution over ranks: a dict, a JSON string or the path of a JSON "
        "file with keys split_batches, dispatch_batches, even_batches, use_seedable_sampler, "
        "non_blocking.",
    )

    # -- checkpoints -----------------------------------------------------------------------------
    save_on_each_node: bool = Field(
        False,
        description="Multi-node runs whose nodes do NOT share storage: the main process of "
        "every node writes a complete copy of each checkpoint to its own node's output_dir, and "
        "each node resumes from its own copy. Never with storage the nodes share (the copies "
        "would collide; refused at the first save).",
    )

    @field_validator("ddp_backend")
    @classmethod
    def _check_backend(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        name = value.strip().lower()
        if name in SUPPORTED_DDP_BACKENDS:
            return name
        if name in _VENDOR_BACKENDS:
            raise ValueError(
                f"the {name} backend needs a vendor plugin this runtime does not ship; use one "
                f"of {', '.join(SUPPORTED_DDP_BACKENDS)} or leave it unset"
            )
        raise ValueError(
            f"unknown backend; use one of {', '.join(SUPPORTED_DDP_BACKENDS)} or leave it unset"
        )

    @field_validator("accelerator_config", mode="before")
    @classmethod
    def _parse_accelerator_config(cls, value: Any) -> Any:
        return _load_accelerator_config(value)

    @model_validator(mode="after")
    def _check_save_on_each_node(self) -> DdpArguments:
        # fsdp is a field of TrainingArguments (fsdp_args), which inherits this validator.
        if self.save_on_each_node and getattr(self, "fsdp", None):
            raise ValueError(
                "save_on_each_node=True cannot be combined with fsdp: every rank holds its own "
                "shard, so no node can write a complete copy; use save_on_each_node=False with "
                "storage all nodes share"
            )
        return self


# ------------------------------------------------------------------------------------------------
# what the Trainer derives from these fields
# ------------------------------------------------------------------------------------------------


def check_backend(backend: str | None, *, cuda: bool) -> str:
    """The backend to use on this machine (``cuda``: the model trains on CUDA devices).

    Raises ConfigurationError for nccl without CUDA (NCCL reduces CUDA tensors only).
    """
    if backend is None:
        return "nccl" if cuda else "gloo"
    if backend == "nccl" and not cuda:
        raise ConfigurationError(
            "ddp_backend='nccl' needs CUDA devices but this run trains on CPU; use "
            "ddp_backend='gloo' (or leave it unset)"
        )
    return backend


def check_accelerator_world(*, process_group_size: int, accelerator_processes: int) -> None:
    """Refuse a run whose ranks would each train their own copy of the model.

    On a machine without a usable GPU, torchrun or ``accelerate launch`` start N processes and
    the process group has N ranks, yet accelerate (asked for neither ``cpu`` nor a GPU) runs
    each process as a single one: no gradient is all-reduced, the ranks diverge from the first
    step, and every checkpoint holds rank 0's copy alone. transformers only warns; nothing is
    lost by stopping before the first step instead."""
    if process_group_size > 1 and accelerator_processes <= 1:
        raise ConfigurationError(
            f"the process group has {process_group_size} ranks but accelerate runs this process "
            "as a single one (without a GPU accelerate sees the ranks only with use_cpu=True): "
            "each rank would train its own copy of the model. Set use_cpu=True (--use_cpu) to "
            "train on CPU across the ranks, or run on GPUs"
        )


def per_rank_batch_size(args: Any, world_size: int) -> int:
    """Micro-batch size of one rank: per_device_train_batch_size, or its share under
    ``accelerator_config.split_batches`` (which must divide evenly)."""
    size = int(args.per_device_train_batch_size)
    config = getattr(args, "accelerator_config", None)
    if config is None or not config.split_batches or world_size <= 1:
        return size
    if size % world_size:
        raise ConfigurationError(
            f"accelerator_config.split_batches=True with per_device_train_batch_size={size} and "
            f"{world_size} ranks: the batch does not split evenly; use a multiple of {world_size}"
        )
    return size // world_size


def dispatch_batches(args: Any, *, iterable: bool, world_size: int) -> bool:
    """Whether the main process reads the training data and sends each rank its share.

    ``accelerator_config.dispatch_batches``, or when it is None accelerate's default: True for an
    iterable dataset (one stream, split by the main process: no rank reads a sample twice), False
    for a map-style one. Always False in a single process (there is nobody to send to).
    """
    if world_size <= 1:
        return False
    config = getattr(args, "accelerator_config", None)
    value = None if config is None else config.dispatch_batches
    return bool(iterable) if value is None else bool(value)


def even_batches(args: Any) -> bool:
    """``accelerator_config.even_batches`` (True when the arguments have no accelerator_config)."""
    config = getattr(args, "accelerator_config", None)
    return True if config is None else bool(config.even_batches)


def _launched_world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        return 1


def accelerator_kwargs(args: Any, *, cuda: bool = False) -> dict[str, Any]:
    """Keyword arguments for ``accelerate.Accelerator`` from the DDP fields of ``args``.

    Only values the user set are passed, so torch's and accelerate's defaults stay in force.
    """
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    check_backend(args.ddp_backend, cuda=cuda)
    group: dict[str, Any] = {"timeout": timedelta(seconds=args.ddp_timeout)}
    if args.ddp_backend is not None and _launched_world_size() > 1:
        # Unset: accelerate picks nccl on CUDA and gloo on CPU itself. In a single process an
        # explicit backend would make accelerate expect a process group that nobody creates.
        group["backend"] = args.ddp_backend
    handlers: list[Any] = [InitProcessGroupKwargs(**group)]
    ddp: dict[str, Any] = {}
    if args.ddp_find_unused_parameters is not None:
        ddp["find_unused_parameters"] = args.ddp_find_unused_parameters
    elif getattr(args, "full_determinism", False) and not args.ddp_static_graph:
        # DDP re-orders its gradient buckets once, after the first step of each process. A
        # resumed process reduces its first step in the initial order, so with 3+ ranks the float
        # sums round differently from an uninterrupted run. find_unused_parameters=True is the
        # public way to keep the initial order for the whole run (at the cost of a graph walk
        # per step): resume is then bit-identical for any world size.
        ddp["find_unused_parameters"] = True
    if args.ddp_bucket_cap_mb is not None:
        ddp["bucket_cap_mb"] = args.ddp_bucket_cap_mb
    if args.ddp_broadcast_buffers is not None:
        ddp["broadcast_buffers"] = args.ddp_broadcast_buffers
    if args.ddp_static_graph is not None:
        ddp["static_graph"] = args.ddp_static_graph
    if ddp:
        handlers.append(DistributedDataParallelKwargs(**ddp))
    return {"kwargs_handlers": handlers}
