"""Launching several training processes per pod with torchrun, as one unit for the operator.

torchrun (``torch.distributed.run``) is the agent: it starts one worker per device, and on
SIGTERM/SIGINT/SIGHUP/SIGQUIT it forwards the signal to its workers, waits ``--shutdown-timeout``
seconds (default 30, or ``$TORCH_ELASTIC_SHUTDOWN_TIMEOUT``) and then SIGKILLs them. A JIT
checkpoint may need nearly the whole grace period, so the timeout comes from
``$PREEMPTIBLE_GRACE_SECONDS``, less a margin (``deadline.launcher_margin``: 2 to 5 s) in which
the launcher merges its workers' messages and writes the pod's, before the kubelet's SIGKILL.
The workers read the same timeout as their deadline (``signals.launcher_timeout_from_env``). And
should torchrun itself not have ended by then (a worker it cannot reap), the launcher writes the
pod's message from what its workers said and ends the pod, still before the grace ends. What
else torchrun does matters under the operator (torch 2.15):

* its workers run in their own sessions (``start_new_session``): only the agent forwards signals;
* when a worker fails, the agent SIGTERMs the others (which a preemption-safe runtime would take
  for a preemption), SIGKILLs them 30 s later, and exits 1 (``ChildFailedError``, which knows
  every worker's exit code); when it is signalled itself it exits through ``SignalException``,
  which knows none;
* every worker gets the same environment: one /metrics port, one termination-message file.

``trainer-runtime launch`` makes such a pod keep the operator's contract as one unit: it starts
torchrun's own CLI and elastic launch in a child process (:mod:`trainer_runtime.distributed.agent`,
which records how each worker ended), forwards the pod's first termination signal exactly once
(a second SIGTERM would abort torchrun's graceful wait), gives every worker its own termination
file (``$PREEMPTIBLE_TERMINATION_DIR``), and when the workers are done merges them into the pod's
one message with the pod's exit code (:func:`pod_end`): 75 only when every local rank committed
its part of the same JIT checkpoint, the first real failure's own code naming its local and global
rank, 69 when a peer is gone; the SIGTERM-to-exit time it reports runs to the last worker's end.
This module is torch-free: it only spawns the agent.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from trainer_runtime.deadline import launcher_margin, torchrun_shutdown_timeout
from trainer_runtime.errors import ConfigurationError
from trainer_runtime.protocol import (
    DEFAULT_TERMINATION_LOG,
    ENV_GRACE_SECONDS,
    ENV_TERMINATION_DIR,
    ENV_TERMINATION_LOG,
    EXIT_PEER_FAILED,
    EXIT_PREEMPTED,
    REASON_DEADLINE_TOO_SHORT,
    TerminationMessage,
    read_termination_message,
    write_termination_message,
)

__all__ = [
    "AGENT_ENDS_FILE",
    "FORWARDED_SIGNALS",
    "PET_ENV",
    "TORCHRUN_DEFAULT_SHUTDOWN_TIMEOUT",
    "LaunchPlan",
    "WorkerEnd",
    "add_launch_parser",
    "launcher_end_seconds",
    "plan_launch",
    "pod_end",
    "read_worker_ends",
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
# torchrun reads every option it is not given from $PET_<OPTION> (an argparse "env" action); the
# operator renders these for a pod of numProcPerNode processes (Kubeflow Trainer's convention),
# so a plain `torchrun train.py` in the user's command comes out right, and so do we.
PET_ENV = {
    "nnodes": "PET_NNODES",
    "nproc_per_node": "PET_NPROC_PER_NODE",
    "node_rank": "PET_NODE_RANK",
    "master_addr": "PET_MASTER_ADDR",
    "master_port": "PET_MASTER_PORT",
}
# The child process that runs torchrun's CLI and records each worker's end, and the runner every
# worker starts through (the process-group guard, --transformers).
AGENT_MODULE = "trainer_runtime.distributed.agent"
WORKER_MODULE = "trainer_runtime.distributed.worker"
# What the agent writes into $PREEMPTIBLE_TERMINATION_DIR: how torchrun and each worker ended.
AGENT_ENDS_FILE = "agent.json"


def shutdown_timeout_seconds(grace_seconds: float | None) -> int | None:
    """torchrun's ``--shutdown-timeout`` for a pod with ``grace_seconds`` of grace.

    The kubelet SIGKILLs the container ``grace`` seconds after SIGTERM, and torchrun receives
    SIGTERM at the same moment. torchrun must not kill its workers much earlier, nor so late
    that the pod dies before its termination message is written: the grace less the launcher's
    margin (:func:`~trainer_runtime.deadline.torchrun_shutdown_timeout`). None (no grace known)
    keeps torchrun's own default.
    """
    if grace_seconds is None:
        return None
    if isinstance(grace_seconds, bool) or not math.isfinite(grace_seconds) or grace_seconds <= 0:
        raise ConfigurationError(
            f"{ENV_GRACE_SECONDS}={grace_seconds!r} is invalid: use the pod's "
            "terminationGracePeriodSeconds, a number > 0"
        )
    return torchrun_shutdown_timeout(grace_seconds)


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
    nproc_per_node: int | None = None
    """Workers per pod when it is a number (``gpu``/``cpu``/``auto`` are torchrun's to count)."""


def _int_env(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigurationError(f"{name}={raw!r} is not an integer") from None


def _first_env(env: Mapping[str, str], *names: str) -> str | None:
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return name
    return None


# `python`, `python3`, `python3.11`: an interpreter, not a script such as `python-script.py`
_INTERPRETER_RE = re.compile(r"^python(\d+(\.\d+)*)?$")


def plan_launch(
    training_command: Sequence[str],
    env: Mapping[str, str],
    *,
    nproc_per_node: int | str | None = None,
    nnodes: int | None = None,
    node_rank: int | None = None,
    python: str = sys.executable,
    transformers: bool = False,
) -> LaunchPlan:
    """Pure: the torchrun invocation for ``training_command`` (``-m module args``,
    ``script.py args``, or an executable with its args) under the environment ``env``.

    The topology comes from the options, else from torchrun's own ``PET_*`` variables (what the
    operator renders for ``numProcPerNode``: ``PET_NNODES`` pods, this pod's ``PET_NODE_RANK``,
    ``PET_MASTER_ADDR``/``PET_MASTER_PORT`` of pod 0, ``PET_NPROC_PER_NODE`` workers), else from
    the one-process-per-pod environment (``WORLD_SIZE`` pods, ``NODE_RANK``, ``MASTER_ADDR``),
    else one standalone node. torchrun gives each worker its own ``RANK``, ``LOCAL_RANK`` and
    ``WORLD_SIZE = nnodes * nproc_per_node``.

    A Python command (``-m module``, ``*.py``, a leading interpreter, which is dropped: torchrun
    starts the interpreter itself) runs in every worker through
    :mod:`trainer_runtime.distributed.worker` (a script that sets up a process group of another
    shape than this launch gets a clear error instead of a hang). Any other executable runs as it
    is in every worker (torchrun's ``--no-python``). ``transformers``: the command is a stock
    transformers / TRL script; every worker attaches the operator contract to each
    ``transformers.Trainer`` the script builds (the script is not changed).
    """
    cmd = list(training_command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    interpreter = bool(cmd) and _INTERPRETER_RE.match(os.path.basename(cmd[0])) is not None
    if interpreter:
        cmd = cmd[1:]  # `-- python train.py`: torchrun starts the interpreter itself
    if not cmd or (cmd[0] == "-m" and len(cmd) < 2):
        raise ConfigurationError(
            "no training command: use `trainer-runtime launch [options] -- -m module [args]`, "
            "`... -- script.py [args]` or `... -- executable [args]`"
        )
    is_python = interpreter or cmd[0] == "-m" or cmd[0].endswith(".py")
    if transformers and not is_python:
        raise ConfigurationError(
            f"--transformers runs a Python script or module, not the executable {cmd[0]!r}: "
            "give `script.py [args]` or `-m module [args]`"
        )
    grace = _grace_from_env(env)
    if nproc_per_node is None:
        name = _first_env(env, PET_ENV["nproc_per_node"], ENV_NPROC_PER_NODE)
        nproc_per_node = env[name].strip() if name else 1
    nproc_str = str(nproc_per_node)
    if nnodes is None:
        name = _first_env(env, PET_ENV["nnodes"], "WORLD_SIZE")
        nnodes = _int_env(env, name, 1) if name else 1
    if node_rank is None:
        name = _first_env(env, PET_ENV["node_rank"], "NODE_RANK")
        node_rank = _int_env(env, name, 0) if name else 0
    addr_name = _first_env(env, PET_ENV["master_addr"], "MASTER_ADDR")
    addr = env[addr_name].strip() if addr_name else None
    port = None
    if addr:
        port_name = _first_env(env, PET_ENV["master_port"], "MASTER_PORT")
        port = _int_env(env, port_name, 29500) if port_name else 29500
    opts = torchrun_options(
        grace_seconds=grace,
        nproc_per_node=nproc_str,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=addr if nnodes > 1 else None,
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
    if is_python:
        worker = ["-m", WORKER_MODULE, *(["--transformers"] if transformers else []), *cmd]
    else:
        worker = ["--no-python", *cmd]
    command = [python, "-m", AGENT_MODULE, *opts, *worker]
    return LaunchPlan(
        command=command,
        env=child_env,
        shutdown_timeout=timeout,
        grace_seconds=grace,
        termination_log=_termination_log_path(env),
        notes=notes,
        nproc_per_node=int(nproc_str) if nproc_str.isdigit() else None,
    )


def _termination_log_path(env: Mapping[str, str]) -> str | None:
    path = env.get(ENV_TERMINATION_LOG) or None
    if path:
        return path
    return DEFAULT_TERMINATION_LOG if os.path.exists(DEFAULT_TERMINATION_LOG) else None


# ------------------------------------------------------------------------------------------------
# How the pod ended: one exit code and one message from its workers' ends
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerEnd:
    """How one worker of the pod ended."""

    local_rank: int
    rank: int | None
    """Global rank (None when torchrun never assigned one, e.g. signalled during rendezvous)."""
    exit_code: int | None
    """Shell convention (128 + N after signal N); None: unknown (torchrun did not say)."""
    message: TerminationMessage | None = None
    """The termination message it wrote itself, if any."""

    def name(self) -> str:
        rank = f"rank {self.rank}" if self.rank is not None else "rank ?"
        return f"local rank {self.local_rank} ({rank})"


# A worker that ends by one of these without its own word was stopped, not failed on its own,
# when the pod was signalled or another worker had ended first (torchrun then SIGTERMs the
# others and SIGKILLs them 30 s later).
_STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGKILL, signal.SIGINT, signal.SIGHUP})
_SIGKILL_EXIT = 128 + signal.SIGKILL
# What a collective raises when the other side went away (gloo, NCCL): such a worker's own
# "failed" is the consequence of another's end, not its cause (same patterns as peers.py).
_PEER_LOSS = re.compile(
    r"Connection closed by peer|Connection reset by peer|gloo.*(Broken pipe|Read error|Timed out)|"
    r"ncclRemoteError|NCCL communicator was aborted|remote process exited|DistNetworkError|"
    r"DistBackendError|DistStoreError",
    re.IGNORECASE,
)
_PREEMPTED_REASONS = frozenset({"preempted", REASON_DEADLINE_TOO_SHORT})


def _verdict(end: WorkerEnd, *, signalled: bool, after_other_end: bool) -> str:
    """completed | preempted | peer_gone | stopped | failed"""
    msg = end.message
    if msg is not None and msg.reason in _PREEMPTED_REASONS:
        return "preempted"
    if (msg is not None and msg.peer_gone) or (msg is None and end.exit_code == EXIT_PEER_FAILED):
        return "peer_gone"
    if end.exit_code == 0 and (msg is None or msg.reason == "completed"):
        return "completed"
    code = end.exit_code
    if (
        msg is None
        and code is not None
        and code > 128
        and (code - 128) in _STOP_SIGNALS
        and (signalled or after_other_end)
    ):
        return "stopped"
    return "failed"


def _looks_like_peer_loss(end: WorkerEnd) -> bool:
    return bool(end.message and end.message.message and _PEER_LOSS.search(end.message.message))


def _merge_timings(messages: Sequence[TerminationMessage], base: TerminationMessage) -> dict:
    """The pod's timings: the main worker's, with the longest step / save / micro-batch of all
    (the grace rule needs the slowest rank)."""

    def longest(values: Sequence[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return max(present) if present else None

    step = base.step_seconds.model_copy(
        update={"max": longest([m.step_seconds.max for m in messages])}
    )
    save = base.save_seconds.model_copy(
        update={"max": longest([m.save_seconds.max for m in messages])}
    )
    micro = None
    if base.micro_batch_seconds is not None:
        micro = base.micro_batch_seconds.model_copy(
            update={
                "max": longest(
                    [m.micro_batch_seconds.max for m in messages if m.micro_batch_seconds]
                )
            }
        )
    return {"step_seconds": step, "save_seconds": save, "micro_batch_seconds": micro}


def pod_end(
    workers: Sequence[WorkerEnd],
    *,
    expected_workers: int | None = None,
    ordered: bool = True,
    signalled: bool = False,
    sigterm_to_exit: float | None = None,
    agent_code: int = 0,
    agent_error: str | None = None,
) -> tuple[int, TerminationMessage]:
    """Pure: the pod's exit code and its one termination message, from its workers' ends.

    ``workers``: every worker torchrun started, in the order they ended when ``ordered`` (torchrun
    reported failures with their times), else in local-rank order (torchrun was signalled and
    only shut its workers down). ``signalled``: the pod got a termination signal (forwarded to
    torchrun). ``sigterm_to_exit``: seconds from that signal to the end of the last worker.
    ``agent_code``/``agent_error``: how torchrun's agent itself ended.

    - every worker exited 0: 0;
    - a real failure (an exception, a crash, a kill nobody asked for, a worker that ended by a
      signal first): the first one's own exit code (by time; without times, a failure that is
      not a lost connection first), its local and global rank named;
    - every worker wrote a complete JIT message for the same checkpoint: 75 (deadline_too_short
      from every worker: 75 too, with that reason). Torchrun's own exit (1, or a traceback when
      it was signalled) never decides this;
    - a peer gone (69 / ``peer_gone``) and no real failure: 69 naming it;
    - workers SIGKILLed after the pod's signal (torchrun's shutdown timeout): 137;
    - otherwise (workers stopped by the signal without a word, torchrun failing before its
      workers ran): 128 + that signal, or torchrun's own code.
    """
    messages = [w.message for w in workers if w.message is not None]
    verdicts: list[str] = []
    ended_nonzero = False
    for w in workers:
        verdicts.append(_verdict(w, signalled=signalled, after_other_end=ended_nonzero))
        ended_nonzero = ended_nonzero or w.exit_code not in (0, None)
    codes = sorted(workers, key=lambda w: w.local_rank)
    # The launcher's own measure runs to the last worker's end; without a signal to the pod (a
    # stop agreed with another pod) the workers' own are all there is.
    own = [m.sigterm_to_exit_seconds for m in messages if m.sigterm_to_exit_seconds is not None]
    common: dict[str, Any] = {
        "step": max((m.step for m in messages), default=0),
        "sigterm_to_exit_seconds": sigterm_to_exit
        if sigterm_to_exit is not None
        else (max(own) if own else None),
        "exit_codes": [w.exit_code for w in codes] or None,
        "attempt": next((m.attempt for m in messages if m.attempt is not None), None),
        # Every rank loads the same checkpoint (they agree on any fallback): the first says it.
        "resumed_from": next((m.resumed_from for m in messages if m.resumed_from), None),
        "resumed_from_step": next(
            (m.resumed_from_step for m in messages if m.resumed_from_step is not None), None
        ),
    }
    base = min(
        (w for w in workers if w.message is not None), key=lambda w: w.local_rank, default=None
    )
    if base is not None and base.message is not None:
        common.update(_merge_timings(messages, base.message))
        ckpt = [m for m in messages if m.checkpoint and m.complete]
        if ckpt:
            newest = max(ckpt, key=lambda m: m.step)
            common.update(checkpoint=newest.checkpoint, complete=True)
    complete_workers = expected_workers if expected_workers is not None else len(workers)
    judged = list(zip(workers, verdicts, strict=True))
    failures = [(i, w) for i, (w, v) in enumerate(judged) if v == "failed"]
    if failures:
        key = (lambda iw: iw[0]) if ordered else (lambda iw: (_looks_like_peer_loss(iw[1]), iw[0]))
        _, first = min(failures, key=key)
        code = first.exit_code if first.exit_code not in (None, 0) else 1
        said = first.message.message if first.message is not None else None
        how = (
            f"exited {first.exit_code}"
            if first.exit_code is not None
            else "ended (exit code unknown)"
        )
        if said and code > 128 and (code - 128) in _STOP_SIGNALS:
            # It reported its own failure (an exception: exit 1) and was then stopped while it
            # wound down (torchrun SIGTERMs the others when one worker ends): the pod's code is
            # the failure's, not that of the signal, which would read as a stop from outside.
            how = f"failed (then stopped by signal {code - 128} while winding down)"
            code = 1
        text = f"{first.name()} {how}" + (f": {said}" if said else "")
        return code, TerminationMessage(
            reason="failed",
            message=text[:2000],
            rank=first.rank,
            local_rank=first.local_rank,
            **common,
        )
    if workers and agent_code == 0 and all(v == "completed" for v in verdicts):
        return 0, TerminationMessage(reason="completed", **common)
    preempted = [w.message for w, v in judged if v == "preempted" and w.message is not None]
    if workers and len(preempted) == len(workers) == complete_workers:
        # Every local rank stopped for the same checkpoint (or for the same too-short deadline).
        reasons = {m.reason for m in preempted}
        points = {(m.step, m.checkpoint) for m in preempted}
        if reasons == {REASON_DEADLINE_TOO_SHORT} and len(points) == 1:
            common.update(checkpoint=None, complete=False)
            return EXIT_PREEMPTED, TerminationMessage(
                reason=REASON_DEADLINE_TOO_SHORT, message=preempted[0].message, **common
            )
        complete = all(m.complete and m.checkpoint for m in preempted)
        if reasons == {"preempted"} and len(points) == 1 and complete:
            return EXIT_PREEMPTED, TerminationMessage(
                reason="preempted", stop=preempted[0].stop, **common
            )
    gone = [w for w, v in judged if v == "peer_gone"]
    if gone:
        first = gone[0]
        peer = first.message
        return EXIT_PEER_FAILED, TerminationMessage(
            reason="failed",
            peer_gone=True,
            failed_rank=peer.failed_rank if peer is not None else None,
            message=(peer.message if peer is not None and peer.message else None)
            or f"{first.name()} exited {EXIT_PEER_FAILED}: another rank is gone",
            rank=first.rank,
            local_rank=first.local_rank,
            **common,
        )
    killed = [w for w in workers if w.exit_code == _SIGKILL_EXIT]
    unfinished = (
        "the JIT checkpoint was not completed by every local rank"
        f" ({len(preempted)} of {complete_workers} reported it)"
    )
    if signalled and killed:
        return _SIGKILL_EXIT, TerminationMessage(
            reason="preempted",
            message=f"{killed[0].name()} was SIGKILLed after the pod's SIGTERM (torchrun's "
            f"shutdown timeout, the grace less the launcher's margin): {unfinished}",
            **common,
        )
    stopped = [w for w, v in judged if v == "stopped"]
    if signalled and workers:
        code = stopped[0].exit_code if stopped and stopped[0].exit_code else 128 + signal.SIGTERM
        return code, TerminationMessage(
            reason="preempted",
            message=f"stopped by the pod's termination signal: {unfinished}",
            **common,
        )
    code = agent_code if agent_code not in (0, None) else 1
    detail = agent_error or (
        "torchrun ended before its workers reported"
        if not workers
        else f"workers ended {[w.exit_code for w in codes]}: {unfinished}"
    )
    return code, TerminationMessage(reason="failed", message=f"torchrun: {detail}"[:2000], **common)


# ------------------------------------------------------------------------------------------------
# Running it
# ------------------------------------------------------------------------------------------------


def _make_workdir() -> str:
    # Where the workers' messages and the agent's record go: the default temporary directory,
    # else /dev/shm (writable in a container whose root filesystem is read-only).
    try:
        return tempfile.mkdtemp(prefix="preemptible-launch-")
    except OSError:
        return tempfile.mkdtemp(prefix="preemptible-launch-", dir="/dev/shm")


def read_worker_ends(directory: str) -> tuple[list[WorkerEnd], dict[str, Any]]:
    """The workers' ends from the agent's record and the workers' own termination files in
    ``directory``, in the order they ended (``record["ordered"]``), and the agent's record."""
    record: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(directory, AGENT_ENDS_FILE), encoding="utf-8") as fh:
            loaded = json.load(fh)
        if isinstance(loaded, dict):
            record = loaded
    messages: dict[int, TerminationMessage] = {}
    for name in os.listdir(directory):
        match = re.fullmatch(r"local-rank-(\d+)\.json", name)
        if not match:
            continue
        with contextlib.suppress(OSError):
            with open(os.path.join(directory, name), encoding="utf-8") as fh:
                msg = read_termination_message(fh.read())
            if msg is not None:
                messages[int(match.group(1))] = msg
    ends: list[WorkerEnd] = []
    seen: set[int] = set()
    for item in record.get("workers") or []:
        local = int(item["local_rank"])
        seen.add(local)
        ends.append(WorkerEnd(local, item.get("rank"), item.get("exit_code"), messages.get(local)))
    for local in sorted(set(messages) - seen):
        ends.append(WorkerEnd(local, None, None, messages[local]))
    return ends, record


def launcher_end_seconds(grace_seconds: float) -> float:
    """Seconds after the pod's SIGTERM at which the launcher stops waiting for torchrun and
    writes the pod's message itself: half the launcher's margin before the grace ends (torchrun
    has SIGKILLed its workers the other half earlier)."""
    return grace_seconds - launcher_margin(grace_seconds) / 2


# Seconds the agent may take to exit once its record is written (its interpreter's teardown can
# hang on torch's own threads after its workers ended); then the launcher goes on without it.
_AGENT_EXIT_SECONDS = 1.0


def _wait_for_agent(
    proc: subprocess.Popen[bytes],
    signalled_at: list[float],
    grace_seconds: float | None,
    record: str | None = None,
) -> int | None:
    """torchrun's return code; None when it had not ended by :func:`launcher_end_seconds` after
    the pod's signal (polled: the signal handler may start that clock at any moment), or within
    ``_AGENT_EXIT_SECONDS`` of writing its ``record`` (every worker has ended by then)."""
    recorded: float | None = None
    while True:
        timeout = 0.5
        now = time.monotonic()
        if signalled_at and grace_seconds is not None:
            left = signalled_at[0] + launcher_end_seconds(grace_seconds) - now
            if left <= 0:
                return None
            timeout = min(timeout, left)
        if record is not None:
            if recorded is None and os.path.exists(record):
                recorded = now
            if recorded is not None and now - recorded >= _AGENT_EXIT_SECONDS:
                return None
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            continue


def run_launch(plan: LaunchPlan) -> int:
    """Run torchrun per ``plan``: forward the first SIGTERM/SIGINT/SIGHUP/SIGQUIT once, then
    write the pod's one termination message and return its exit code (:func:`pod_end`)."""
    for note in plan.notes:
        logger.warning("%s", note)
    workdir = _make_workdir()
    env = {**plan.env, ENV_TERMINATION_DIR: workdir}
    proc = subprocess.Popen(plan.command, env=env, start_new_session=True)
    signalled_at: list[float] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        if signalled_at:
            # torchrun is already shutting its workers down; a second signal would abort that.
            return
        signalled_at.append(time.monotonic())
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    previous: dict[int, Any] = {}
    for name in FORWARDED_SIGNALS:
        sig = getattr(signal, name)
        previous[sig] = signal.signal(sig, forward)
    try:
        record_path = os.path.join(workdir, AGENT_ENDS_FILE)
        returncode = _wait_for_agent(proc, signalled_at, plan.grace_seconds, record_path)
        # torchrun has waited for (or killed) every worker: this is the pod's end.
        ended = time.monotonic()
        workers, record = read_worker_ends(workdir)
        error = record.get("error")
        if returncode is None:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            if record:
                # Its record is complete (every worker ended): only its own exit hung.
                logger.warning("torchrun's agent did not exit after its workers: killed")
                recorded_code = record.get("code")
                returncode = recorded_code if isinstance(recorded_code, int) else 1
            else:
                late = ended - signalled_at[0]
                error = (
                    f"torchrun had not ended {late:.1f} s after the pod's SIGTERM (grace "
                    f"{plan.grace_seconds:g} s, its shutdown timeout {plan.shutdown_timeout} "
                    "s): the launcher ended the pod so that its termination message is written"
                )
                logger.error("%s", error)
                returncode = -signal.SIGKILL
        code, message = pod_end(
            workers,
            expected_workers=record.get("nproc", plan.nproc_per_node),
            ordered=bool(record.get("ordered")),
            signalled=bool(signalled_at),
            sigterm_to_exit=round(ended - signalled_at[0], 3) if signalled_at else None,
            agent_code=returncode if returncode >= 0 else 128 - returncode,
            agent_error=error,
        )
        if plan.termination_log:
            try:
                write_termination_message(message, plan.termination_log)
            except OSError as exc:
                logger.error("cannot write the termination message: %s", exc)
        logger.warning(
            "pod exit %d (torchrun %d, workers %s): %s%s",
            code,
            returncode,
            message.exit_codes,
            message.reason,
            f" {message.message}" if message.message else "",
        )
        return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(workdir, ignore_errors=True)


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
        help="run torchrun so that a pod of several processes keeps the operator's contract",
        description="Start N training processes per pod with torchrun. The shutdown timeout is "
        f"${ENV_GRACE_SECONDS} less a 2-5 s margin for the pod's termination message "
        "(torchrun's default kills workers after 30 s), the first "
        "SIGTERM is forwarded once, and the pod ends as one unit: one termination message, "
        "exit 75 only when every worker committed its part of the JIT checkpoint, a failing "
        "worker's own exit code otherwise. Topology: $PET_NNODES pods (else $WORLD_SIZE), "
        "this one $PET_NODE_RANK (else $NODE_RANK), rendezvous on "
        "$PET_MASTER_ADDR:$PET_MASTER_PORT (else $MASTER_ADDR:$MASTER_PORT): what the operator "
        "sets.",
    )
    p.add_argument(
        "--nproc-per-node",
        default=None,
        help="processes per pod: a number, 'gpu' or 'cpu' (torchrun's values; default "
        f"$PET_NPROC_PER_NODE, else ${ENV_NPROC_PER_NODE}, else 1)",
    )
    p.add_argument("--nnodes", type=int, default=None, help="pods (default $PET_NNODES or 1)")
    p.add_argument("--node-rank", type=int, default=None, help="this pod (default $PET_NODE_RANK)")
    p.add_argument("--dry-run", action="store_true", help="print the torchrun command and exit")
    p.add_argument(
        "--transformers",
        action="store_true",
        help="the command is an unmodified transformers.Trainer / TRL script: every worker "
        "gives every Trainer it builds the operator contract (JIT checkpoint, exit 75, resume, "
        "/metrics)",
    )
    p.add_argument(
        "training_command",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND",
        help="the training command after --: `-m module args`, `script.py args` or "
        "`executable args`",
    )
    p.set_defaults(func=_cmd_launch)
