"""Launching several training processes per pod with torchrun, inside the grace period.

torchrun (``torch.distributed.run``) is the agent: it starts one worker per device, and on
SIGTERM/SIGINT/SIGHUP/SIGQUIT it forwards the signal to its workers, waits ``--shutdown-timeout``
seconds (default 30, or ``$TORCH_ELASTIC_SHUTDOWN_TIMEOUT``) and then SIGKILLs them. A JIT
checkpoint may need the whole grace period, so the timeout must come from
``$PREEMPTIBLE_GRACE_SECONDS``. Two more torchrun behaviours matter under the operator:

* its workers run in their own sessions (``start_new_session``): only the agent forwards signals;
* when its workers stop with exit code 75 (preempted) it exits 1 (``ChildFailedError``), or with
  a traceback when it was signalled itself; the operator would read a failure.

``trainer-runtime launch`` wraps torchrun for that: it computes the options below, starts torchrun
in its own session, forwards the first termination signal exactly once (a second SIGTERM would
abort torchrun's graceful wait), and exits 75 when the workers of this pod stopped for a JIT
checkpoint (the termination message written during this launch says ``preempted``). This module
is torch-free: the wrapper only spawns torchrun.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from trainer_runtime.errors import ConfigurationError
from trainer_runtime.protocol import (
    DEFAULT_TERMINATION_LOG,
    ENV_GRACE_SECONDS,
    ENV_TERMINATION_LOG,
    EXIT_PEER_FAILED,
    EXIT_PREEMPTED,
    read_termination_message,
)

__all__ = [
    "FORWARDED_SIGNALS",
    "TORCHRUN_DEFAULT_SHUTDOWN_TIMEOUT",
    "LaunchPlan",
    "add_launch_parser",
    "launch_exit_code",
    "plan_launch",
    "run_launch",
    "shutdown_timeout_seconds",
    "torchrun_options",
]

logger = logging.getLogger(__name__)

# What torchrun does without our options (torch 2.x: LaunchConfig and run.py).
TORCHRUN_DEFAULT_SHUTDOWN_TIMEOUT = 30
# Signals torchrun turns into a graceful shutdown of its workers; we pass them explicitly so a
# stray $PET_SIGNALS_TO_HANDLE in the image cannot drop SIGTERM.
FORWARDED_SIGNALS: tuple[str, ...] = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
ENV_SHUTDOWN_TIMEOUT = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
ENV_SIGNALS_TO_HANDLE = "TORCHELASTIC_SIGNALS_TO_HANDLE"
# Default of `trainer-runtime launch --nproc-per-node` (e.g. set in the image or pod template).
ENV_NPROC_PER_NODE = "PREEMPTIBLE_NPROC_PER_NODE"


def shutdown_timeout_seconds(grace_seconds: float | None) -> int | None:
    """torchrun's ``--shutdown-timeout`` for a pod with ``grace_seconds`` of grace.

    The kubelet SIGKILLs the container ``grace`` seconds after SIGTERM, and torchrun receives
    SIGTERM at the same moment, so torchrun must not kill its workers any earlier: the timeout is
    the grace period rounded up. None (no grace known) keeps torchrun's own default.
    """
    if grace_seconds is None:
        return None
    if isinstance(grace_seconds, bool) or not math.isfinite(grace_seconds) or grace_seconds <= 0:
        raise ConfigurationError(
            f"{ENV_GRACE_SECONDS}={grace_seconds!r} is invalid: use the pod's "
            "terminationGracePeriodSeconds, a number > 0"
        )
    return math.ceil(grace_seconds)


def _grace_from_env(env: Mapping[str, str]) -> float | None:
    raw = env.get(ENV_GRACE_SECONDS, "").strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        raise ConfigurationError(
            f"{ENV_GRACE_SECONDS}={raw!r} is not a number: set it to the pod's "
            "terminationGracePeriodSeconds"
        ) from None


def torchrun_options(
    *,
    grace_seconds: float | None,
    nproc_per_node: int | str = 1,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str | None = None,
    master_port: int | None = None,
) -> list[str]:
    """torchrun options (before the training script) for a pod with ``grace_seconds`` of grace.

    One node without a master address: ``--standalone``. Several nodes: static rendezvous on
    ``master_addr:master_port`` (the operator's headless-Service address of pod 0).
    ``--max-restarts 0``: a preempted or failed worker ends the attempt; the operator, not
    torchrun, decides what runs next.
    """
    if nnodes < 1:
        raise ConfigurationError(f"nnodes={nnodes!r} must be >= 1 (the number of pods)")
    if not 0 <= node_rank < nnodes:
        raise ConfigurationError(
            f"node_rank={node_rank!r} must be within [0, nnodes={nnodes}); the operator sets "
            "NODE_RANK to the Job completion index"
        )
    opts = [f"--nproc-per-node={nproc_per_node}"]
    if nnodes == 1 and not master_addr:
        opts.append("--standalone")
    else:
        if not master_addr or master_port is None:
            raise ConfigurationError(
                f"nnodes={nnodes} needs MASTER_ADDR and MASTER_PORT (the address of node 0's "
                "launcher): set both"
            )
        opts += [
            f"--nnodes={nnodes}",
            f"--node-rank={node_rank}",
            "--rdzv-backend=static",
            f"--master-addr={master_addr}",
            f"--master-port={master_port}",
        ]
    opts += ["--max-restarts=0", f"--signals-to-handle={','.join(FORWARDED_SIGNALS)}"]
    timeout = shutdown_timeout_seconds(grace_seconds)
    if timeout is not None:
        opts.append(f"--shutdown-timeout={timeout}")
    return opts


@dataclass(frozen=True)
class LaunchPlan:
    """The torchrun command line and environment of one pod."""

    command: list[str]
    env: dict[str, str]
    shutdown_timeout: int | None
    grace_seconds: float | None
    termination_log: str | None = None
    notes: list[str] = field(default_factory=list)


def _int_env(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigurationError(f"{name}={raw!r} is not an integer") from None


# `python`, `python3`, `python3.11`: an interpreter, not a script such as `python-script.py`
_INTERPRETER_RE = re.compile(r"^python(\d+(\.\d+)*)?$")

# The runner that attaches the integration to an unmodified transformers script.
HF_RUNNER_MODULE = "trainer_runtime.hf.run"


def plan_launch(
    training_command: Sequence[str],
    env: Mapping[str, str],
    *,
    nproc_per_node: int | str = 1,
    nnodes: int | None = None,
    node_rank: int | None = None,
    python: str = sys.executable,
    transformers: bool = False,
) -> LaunchPlan:
    """Pure: the torchrun invocation for ``training_command`` (``-m module args`` or
    ``script.py args``) under the environment ``env``.

    The operator's environment describes one process per pod: ``WORLD_SIZE`` pods, this pod's
    ``NODE_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` of pod 0. Under the launcher those are nodes;
    torchrun then gives each worker its own ``RANK``, ``LOCAL_RANK`` and
    ``WORLD_SIZE = nnodes * nproc_per_node``.

    ``transformers``: the command is a stock transformers / TRL script; every worker runs it
    through ``-m trainer_runtime.hf.run``, which attaches the operator contract to each
    ``transformers.Trainer`` the script builds (the script is not changed).
    """
    cmd = list(training_command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if cmd and _INTERPRETER_RE.match(os.path.basename(cmd[0])):
        cmd = cmd[1:]  # `-- python train.py`: torchrun starts the interpreter itself
    if not cmd or (cmd[0] == "-m" and len(cmd) < 2):
        raise ConfigurationError(
            "no training command: use `trainer-runtime launch [options] -- -m module [args]` or "
            "`... -- script.py [args]`"
        )
    if transformers:
        cmd = ["-m", HF_RUNNER_MODULE, *cmd]
    grace = _grace_from_env(env)
    nodes = nnodes if nnodes is not None else _int_env(env, "WORLD_SIZE", 1)
    rank = node_rank if node_rank is not None else _int_env(env, "NODE_RANK", 0)
    addr = env.get("MASTER_ADDR") or None
    port = _int_env(env, "MASTER_PORT", 29500) if addr else None
    opts = torchrun_options(
        grace_seconds=grace,
        nproc_per_node=nproc_per_node,
        nnodes=nodes,
        node_rank=rank,
        master_addr=addr if nodes > 1 else None,
        master_port=port,
    )
    timeout = shutdown_timeout_seconds(grace)
    child_env = dict(env)
    notes: list[str] = []
    # The same values as environment, for anything that builds its own LaunchConfig
    # (accelerate launch reads TORCH_ELASTIC_SHUTDOWN_TIMEOUT when no option is given).
    child_env[ENV_SIGNALS_TO_HANDLE] = ",".join(FORWARDED_SIGNALS)
    if timeout is not None:
        child_env[ENV_SHUTDOWN_TIMEOUT] = str(timeout)
    else:
        notes.append(
            f"{ENV_GRACE_SECONDS} is not set: torchrun kills workers "
            f"{child_env.get(ENV_SHUTDOWN_TIMEOUT, TORCHRUN_DEFAULT_SHUTDOWN_TIMEOUT)} s after "
            "SIGTERM"
        )
    command = [python, "-m", "torch.distributed.run", *opts, *cmd]
    return LaunchPlan(
        command=command,
        env=child_env,
        shutdown_timeout=timeout,
        grace_seconds=grace,
        termination_log=_termination_log_path(env),
        notes=notes,
    )


def _termination_log_path(env: Mapping[str, str]) -> str | None:
    path = env.get(ENV_TERMINATION_LOG) or None
    if path:
        return path
    return DEFAULT_TERMINATION_LOG if os.path.exists(DEFAULT_TERMINATION_LOG) else None


def launch_exit_code(returncode: int, termination_text: str | None) -> int:
    """Pure: the pod's exit code from torchrun's and the termination message of this launch.

    0 stays 0. Otherwise the workers' own verdict wins: a termination message saying
    ``preempted`` (written after a complete JIT checkpoint) makes it EXIT_PREEMPTED, so the
    operator requeues instead of counting a failure; ``peer_gone`` (the workers stopped because
    a rank of another pod was gone) makes it EXIT_PEER_FAILED, so the operator looks for the cause
    in that other pod. Anything else keeps torchrun's code.
    """
    if returncode == 0:
        return 0
    msg = read_termination_message(termination_text)
    if msg is not None and msg.reason == "preempted":
        return EXIT_PREEMPTED
    if msg is not None and msg.peer_gone:
        return EXIT_PEER_FAILED
    return returncode if returncode > 0 else 128 - returncode


def _read_fresh(path: str | None, since: float) -> str | None:
    """The termination message if it was written during this launch (not a stale one)."""
    if not path:
        return None
    try:
        if os.stat(path).st_mtime < since:
            return None
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except OSError:
        return None


def run_launch(plan: LaunchPlan) -> int:
    """Run torchrun per ``plan``; forward the first SIGTERM/SIGINT/SIGHUP/SIGQUIT once; map its
    exit code with :func:`launch_exit_code`."""
    for note in plan.notes:
        logger.warning("%s", note)
    started = time.time() - 1.0  # mtime granularity
    proc = subprocess.Popen(plan.command, env=plan.env, start_new_session=True)
    forwarded: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        if forwarded:
            # torchrun is already shutting its workers down; a second signal would abort that.
            return
        forwarded.append(signum)
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    previous: dict[int, Any] = {}
    for name in FORWARDED_SIGNALS:
        sig = getattr(signal, name)
        previous[sig] = signal.signal(sig, forward)
    try:
        while True:
            try:
                returncode = proc.wait()
                break
            except InterruptedError:
                continue
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    code = launch_exit_code(returncode, _read_fresh(plan.termination_log, started))
    if code != returncode:
        logger.warning(
            "torchrun exited %d; the workers stopped for a JIT checkpoint: exit %d",
            returncode,
            code,
        )
    return code


# ------------------------------------------------------------------------------------------------
# `trainer-runtime launch`
# ------------------------------------------------------------------------------------------------


def _cmd_launch(args: argparse.Namespace) -> int:
    plan = plan_launch(
        args.training_command,
        os.environ,
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        transformers=args.transformers,
    )
    if args.dry_run:
        print(" ".join(plan.command))
        if plan.shutdown_timeout is not None:
            print(f"{ENV_SHUTDOWN_TIMEOUT}={plan.shutdown_timeout}")
        for note in plan.notes:
            print(f"note: {note}")
        return 0
    logging.basicConfig(level=logging.INFO, format="[launch] %(message)s")
    return run_launch(plan)


def add_launch_parser(sub: Any) -> None:
    """Register ``trainer-runtime launch`` on an argparse sub-parser collection."""
    p = sub.add_parser(
        "launch",
        help="run torchrun with a shutdown timeout equal to the grace period",
        description="Start N training processes per pod with torchrun. The shutdown timeout is "
        f"${ENV_GRACE_SECONDS} (torchrun's default kills workers after 30 s), the first "
        "SIGTERM is forwarded once, and the exit code is 75 when the workers stopped for a JIT "
        "checkpoint. Nodes: $WORLD_SIZE pods, this one $NODE_RANK, rendezvous on "
        "$MASTER_ADDR:$MASTER_PORT (what the operator sets).",
    )
    p.add_argument(
        "--nproc-per-node",
        default=os.environ.get(ENV_NPROC_PER_NODE, "1"),
        help="processes per pod: a number, 'gpu' or 'cpu' (torchrun's values; default 1)",
    )
    p.add_argument("--nnodes", type=int, default=None, help="pods (default $WORLD_SIZE or 1)")
    p.add_argument("--node-rank", type=int, default=None, help="this pod (default $NODE_RANK)")
    p.add_argument("--dry-run", action="store_true", help="print the torchrun command and exit")
    p.add_argument(
        "--transformers",
        action="store_true",
        help="the command is an unmodified transformers.Trainer / TRL script: run it through "
        f"`python -m {HF_RUNNER_MODULE}`, which gives every Trainer it builds the operator "
        "contract (JIT checkpoint, exit 75, resume, /metrics)",
    )
    p.add_argument(
        "training_command",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND",
        help="the training command after --: `-m module args` or `script.py args`",
    )
    p.set_defaults(func=_cmd_launch)
