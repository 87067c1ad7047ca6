"""Distributed training: process-group collectives (the rank-agreed stop), DDP and FSDP arguments,
FSDP2 wrapping and sharded checkpoints, and the torchrun launcher (torch-free)."""

from __future__ import annotations

from trainer_runtime._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "DdpArguments": "ddp_args",
        "AcceleratorConfig": "ddp_args",
        "FsdpConfig": "fsdp",
        "shard_model": "fsdp",
        "save_sharded": "fsdp",
        "load_sharded": "fsdp",
        "FsdpArguments": "fsdp_args",
        "FsdpConfigArguments": "fsdp_args",
    },
)
