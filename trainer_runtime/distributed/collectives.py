"""Small helpers for agreeing across ranks; every one is a no-op in a single process."""

from __future__ import annotations

import atexit
import logging
import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = [
    "agree_max",
    "agree_to_stop",
    "all_reduce_sum",
    "barrier",
    "destroy_at_exit",
    "is_distributed",
    "rank",
    "run_and_exit",
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


def agree_max(local_value: int) -> int:
    """The largest of one small integer over ranks (every rank gets it; all-reduce MAX)."""
    if not is_distributed():
        return int(local_value)
    flag = torch.tensor([int(local_value)], dtype=torch.int32, device=_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def all_reduce_sum(value: int) -> int:
    """Sum of an integer over ranks (the label-token count of a global batch)."""
    if not is_distributed():
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return int(t.item())


def all_reduce_mean(value: float) -> float:
    """Mean of a float over ranks (the logged training loss, as transformers gathers it)."""
    if not is_distributed():
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t.item()) / dist.get_world_size()


def barrier() -> None:
    if is_distributed():
        dist.barrier()


_destroy_registered = False


def destroy_at_exit() -> None:
    """Destroy the default process group when the interpreter exits normally (``sys.exit``
    included). Left to interpreter teardown, gloo's process group is destroyed after Python has
    finalised and sometimes aborts the process ("terminate called without an active exception",
    exit -6): a finished run would then look like a crash to the operator."""
    global _destroy_registered
    if not _destroy_registered and dist.is_available() and dist.is_initialized():
        atexit.register(_destroy_process_group)
        _destroy_registered = True


def _destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message") prints it and exits 1
    return 1


def run_and_exit(main: Callable[[], int | None]) -> None:
    """Run an entry point's ``main`` and exit the process with its code.

    After a distributed run the exit skips the interpreter's teardown: the process group is
    destroyed and every stream flushed first, then ``os._exit``. Even with the process group
    destroyed, a gloo process that ran an evaluation aborted at teardown in about 1 run in 10 on
    our machines (C++ "terminate called without an active exception", exit -6), which would turn
    a completed or preempted run into a crash for the operator.
    """
    try:
        code = _exit_code(main())
    except SystemExit as exc:
        code = _exit_code(exc.code)
    exit_process(code)


def exit_process(code: int) -> None:
    """Exit with ``code`` now; in a distributed run without the interpreter's teardown (see
    :func:`run_and_exit`), after the exit handlers ran and every stream was flushed."""
    if not (dist.is_available() and dist.is_initialized()):
        sys.exit(code)
    atexit._run_exitfuncs()  # the process group's destroy and every other library's handlers
    # A process group we did not create (a stock transformers script: accelerate made it) has
    # no destroy registered; gloo's threads must still end before the process does.
    try:
        _destroy_process_group()
    except Exception as exc:  # exiting anyway: the code is what matters
        print(f"destroying the process group at exit: {exc!r}", file=sys.stderr)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
