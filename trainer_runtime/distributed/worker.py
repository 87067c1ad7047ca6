"""What every worker of ``trainer-runtime launch`` runs:
``python -m trainer_runtime.distributed.worker [--transformers] (-m module | script.py) [args]``.

It runs the training command as ``python script.py`` / ``python -m module`` would (the script as
``__main__``, its own ``sys.argv``, its directory first on ``sys.path``), after two set-ups:

- a guard on ``torch.distributed.init_process_group``: torchrun has already given this worker
  its place (``WORLD_SIZE``, ``RANK``, its rendezvous store on ``MASTER_ADDR:MASTER_PORT``). A
  script that builds a process group of another shape (a hard-coded ``world_size``, its own
  ``tcp://`` or ``file://`` rendezvous, its own store) would wait for ranks that never come (torch
  2.15: a larger ``world_size`` waits out the 30-minute timeout) or silently train unrelated
  copies side by side (``world_size=1, rank=0`` in every worker). The guard refuses it at once
  with a message naming the argument and the launch's shape, written as the worker's termination
  message too, so the pod fails with that reason;
- with ``--transformers``: the hook that gives every ``transformers.Trainer`` the script builds
  the operator contract (:mod:`trainer_runtime.hf.hook`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import runpy
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from trainer_runtime.errors import ConfigurationError

__all__ = ["guard_process_group", "main", "process_group_problem", "run_python_command"]

USAGE = (
    "usage: python -m trainer_runtime.distributed.worker [--transformers] "
    "(-m module | script.py) [args...]"
)


def process_group_problem(
    env: Mapping[str, str],
    *,
    init_method: str | None = None,
    world_size: int | None = None,
    rank: int | None = None,
    store: bool = False,
) -> str | None:
    """Pure: why ``init_process_group`` with these arguments cannot join this launch's process
    group (None when it can: no arguments, ``env://``, or the launch's own world size and rank)."""
    try:
        world, own_rank = int(env["WORLD_SIZE"]), int(env["RANK"])
    except (KeyError, ValueError):
        return None  # not started by torchrun: nothing to compare with
    shape = (
        f"this launch has WORLD_SIZE={world} and this worker RANK={own_rank} (torchrun sets both, "
        f"with its rendezvous on MASTER_ADDR:MASTER_PORT={env.get('MASTER_ADDR')}:"
        f"{env.get('MASTER_PORT')})"
    )
    fix = (
        "call init_process_group(backend) without init_method, store, world_size or rank (the "
        "default env:// reads them), or pass int(os.environ['WORLD_SIZE']) and "
        "int(os.environ['RANK'])"
    )
    if world_size not in (None, -1) and int(world_size) != world:
        return (
            f"init_process_group(world_size={world_size}) under trainer-runtime launch, but "
            f"{shape}: the group would wait for ranks that never come or leave ranks out; {fix}"
        )
    if rank not in (None, -1) and int(rank) != own_rank:
        return f"init_process_group(rank={rank}) under trainer-runtime launch, but {shape}; {fix}"
    if store:
        return (
            f"init_process_group(store=...) under trainer-runtime launch: a store of the "
            f"script's own is not the launch's rendezvous ({shape}); {fix}"
        )
    if init_method is not None and not init_method.startswith("env://"):
        return (
            f"init_process_group(init_method={init_method!r}) under trainer-runtime launch: a "
            f"rendezvous of the script's own is not the launch's ({shape}; on several pods its "
            f"ranks would not meet); {fix}"
        )
    return None


def _refuse(message: str) -> None:
    # The worker's own termination message: the launcher names it as the pod's failure.
    from trainer_runtime.protocol import TerminationMessage, write_termination_message

    with contextlib.suppress(OSError):
        write_termination_message(TerminationMessage(reason="failed", step=0, message=message))
    raise ConfigurationError(message)


def _guarded(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            return original(*args, **kwargs)  # torch reports the bad call itself
        problem = process_group_problem(
            os.environ,
            init_method=bound.get("init_method"),
            world_size=bound.get("world_size"),
            rank=bound.get("rank"),
            store=bound.get("store") is not None,
        )
        if problem is not None:
            _refuse(problem)
        return original(*args, **kwargs)

    init_process_group.__preemptible_guard__ = True  # type: ignore[attr-defined]
    return init_process_group


def guard_process_group() -> None:
    """Install the guard on both names a script may call (``torch.distributed`` and
    ``torch.distributed.distributed_c10d``); idempotent."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if getattr(dist.init_process_group, "__preemptible_guard__", False):
        return
    guarded = _guarded(distributed_c10d.init_process_group)
    distributed_c10d.init_process_group = guarded
    dist.init_process_group = guarded


def run_python_command(args: Sequence[str], usage: str = USAGE) -> None:
    """Run ``-m module args`` or ``script.py args`` as ``python`` would run it, then exit the
    process with the script's code. In a distributed run the exit destroys the process group
    and skips the interpreter's teardown (:func:`~trainer_runtime.distributed.collectives.
    run_and_exit`): left to teardown, a finished gloo run sometimes aborts (exit -6) and torchrun
    reports a completed run as failed."""
    from trainer_runtime.distributed import collectives  # torch: only once a run starts

    collectives.run_and_exit(lambda: _run_python_command(args, usage))


def _run_python_command(args: Sequence[str], usage: str) -> None:
    args = list(args)
    if args and args[0] == "--":
        args = args[1:]
    if not args or (args[0] == "-m" and len(args) < 2):
        raise SystemExit(usage)
    if args[0] == "-m":
        module, rest = args[1], args[2:]
        sys.argv = [module, *rest]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script, rest = args[0], args[1:]
    if not os.path.isfile(script):
        raise SystemExit(f"{script}: no such file ({usage})")
    sys.argv = [script, *rest]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    transformers = bool(args) and args[0] == "--transformers"
    if transformers:
        args = args[1:]
    guard_process_group()
    if transformers:
        from trainer_runtime.hf.hook import install

        install()
    run_python_command(args)


if __name__ == "__main__":
    main()
