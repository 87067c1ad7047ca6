"""Small helpers for agreeing across ranks; every one is a no-op in a single process."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "agree_to_stop",
    "all_reduce_sum",
    "barrier",
    "is_distributed",
    "rank",
    "world_size",
]


def is_distributed() -> bool:
    """True when torch.distributed is initialised with more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _device() -> torch.device:
    # NCCL only reduces CUDA tensors; gloo reduces CPU tensors.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_to_stop(local_flag: bool) -> bool:
    """True on every rank if any rank wants to stop (all-reduce MAX of one int)."""
    if not is_distributed():
        return bool(local_flag)
    flag = torch.tensor([1 if local_flag else 0], dtype=torch.int32, device=_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def all_reduce_sum(value: int) -> int:
    """Sum of an integer over ranks (the label-token count of a global batch)."""
    if not is_distributed():
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return int(t.item())


def barrier() -> None:
    if is_distributed():
        dist.barrier()
