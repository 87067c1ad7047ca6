"""The contract between the operator and the runtime (see DESIGN.md), in one torch-free module.

Environment variable names, the preemption exit code, the termination message and the metric
names live here so both halves import the same constants.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "DEFAULT_KILL_WAIT_SECONDS",
    "DEFAULT_PEER_TIMEOUT_SECONDS",
    "DEFAULT_TERMINATION_LOG",
    "ENV_ATTEMPT",
    "ENV_ELASTIC_ACCUMULATION",
    "ENV_ELASTIC_REFERENCE_NODES",
    "ENV_GRACE_SECONDS",
    "ENV_KILL_WAIT_SECONDS",
    "ENV_METRICS_HOST",
    "ENV_METRICS_PORT",
    "ENV_NODE_NOTICE_FILE",
    "ENV_NODE_NOTICE_SECONDS",
    "ENV_OUTPUT_DIR",
    "ENV_PEER_TIMEOUT_SECONDS",
    "ENV_RESUME_FROM",
    "ENV_SAVE_INTERVAL_SECONDS",
    "ENV_STOP_POLICY",
    "ENV_TERMINATION_DIR",
    "ENV_TERMINATION_LOG",
    "EXIT_PEER_FAILED",
    "EXIT_PREEMPTED",
    "METRIC_NAMES",
    "REASON_DEADLINE_TOO_SHORT",
    "STOP_POLICIES",
    "SaveTimings",
    "StepTimings",
    "TerminationMessage",
    "local_rank_from_env",
    "read_termination_message",
    "termination_message_path",
    "under_operator",
    "worker_termination_file",
    "write_termination_message",
    "writes_termination_message",
]

ENV_OUTPUT_DIR = "PREEMPTIBLE_OUTPUT_DIR"
ENV_RESUME_FROM = "PREEMPTIBLE_RESUME_FROM"
ENV_GRACE_SECONDS = "PREEMPTIBLE_GRACE_SECONDS"
ENV_KILL_WAIT_SECONDS = "PREEMPTIBLE_KILL_WAIT_SECONDS"
ENV_ATTEMPT = "PREEMPTIBLE_ATTEMPT"
# The notice the node gives before it goes away (spot reclaim: ~30 s on GKE, up to 120 s on AWS),
# when that can be shorter than the pod's grace: the runtime's deadline is SIGTERM + the shorter.
ENV_NODE_NOTICE_SECONDS = "PREEMPTIBLE_NODE_NOTICE_SECONDS"
# A file holding the notice of the node the pod landed on (seconds; empty: none known), read at
# SIGTERM: the node is chosen after the pod's env is fixed, so the operator annotates the bound
# pod and a downward-API volume (which kubelet refreshes) shows the annotation as this file.
ENV_NODE_NOTICE_FILE = "PREEMPTIBLE_NODE_NOTICE_FILE"
# How a SIGTERM stops training: "finish_step" or "micro_batch" (TrainingArguments.jit_stop_policy
# default when the script does not set it).
ENV_STOP_POLICY = "PREEMPTIBLE_STOP_POLICY"
# spec.checkpoint.interval: auto: the operator's recommended seconds between periodic saves.
ENV_SAVE_INTERVAL_SECONDS = "PREEMPTIBLE_SAVE_INTERVAL_SECONDS"
ENV_METRICS_PORT = "PREEMPTIBLE_METRICS_PORT"
# Address the /metrics server binds to; the operator sets it to the pod IP (downward API) so that
# several pods sharing one network namespace (the test node agent) do not collide. Default: all.
ENV_METRICS_HOST = "PREEMPTIBLE_METRICS_HOST"
# Where the termination message goes; default /dev/termination-log when that file exists.
ENV_TERMINATION_LOG = "PREEMPTIBLE_TERMINATION_LOG"
# Set by `trainer-runtime launch` for its workers: every worker writes its own message to
# <dir>/local-rank-<LOCAL_RANK>.json, and the launcher merges them into the pod's one message
# (with the pod's exit code), so a pod of several processes ends as one unit.
ENV_TERMINATION_DIR = "PREEMPTIBLE_TERMINATION_DIR"

# An elastic attempt (docs/elastic.md): the reference size (spec.numNodes) and the gradient
# accumulation the script uses at that size; the runtime keeps the global batch at the size it
# got by changing the accumulation (trainer_runtime.elastic).
ENV_ELASTIC_REFERENCE_NODES = "PREEMPTIBLE_ELASTIC_REFERENCE_NODES"
ENV_ELASTIC_ACCUMULATION = "PREEMPTIBLE_ELASTIC_ACCUMULATION"

DEFAULT_KILL_WAIT_SECONDS = 3.0
DEFAULT_TERMINATION_LOG = "/dev/termination-log"

# EX_TEMPFAIL from sysexits.h: "temporary failure, the user is invited to retry". Distinct from
# 0 (finished), 1 (error) and 128+N (killed by a signal).
EXIT_PREEMPTED = 75

# EX_UNAVAILABLE from sysexits.h: this rank stopped because another rank of the attempt is gone
# (it failed, was killed, or its node vanished). Distinct from 75: nothing was saved; the root
# cause is the other rank, whose own exit says what happened.
EXIT_PEER_FAILED = 69
# Seconds without a heartbeat after which a rank counts as gone (0 disables the watch).
ENV_PEER_TIMEOUT_SECONDS = "PREEMPTIBLE_PEER_TIMEOUT_SECONDS"
DEFAULT_PEER_TIMEOUT_SECONDS = 10.0

# finish_step: finish the optimizer step in flight, then save (falls back to micro_batch when the
# step and the save do not both fit the deadline); micro_batch: stop at the next micro-batch
# boundary, drop the partial gradient accumulation and save the last completed step at once.
STOP_POLICIES = ("finish_step", "micro_batch")

# Termination reason when not even the save fits the deadline: the runtime exits without writing.
REASON_DEADLINE_TOO_SHORT = "deadline_too_short"

# Prometheus series the runtime serves and the operator scrapes (gauges unless noted).
METRIC_NAMES = {
    "step": "preemptible_global_step",
    "max_steps": "preemptible_max_steps",
    "epoch": "preemptible_epoch",
    "step_seconds_last": "preemptible_step_seconds_last",
    "step_seconds_ema": "preemptible_step_seconds_ema",
    "step_seconds_p99": "preemptible_step_seconds_p99",
    "step_seconds_max": "preemptible_step_seconds_max",
    "save_seconds_last": "preemptible_save_seconds_last",
    "save_seconds_max": "preemptible_save_seconds_max",
    "micro_batch_seconds_max": "preemptible_micro_batch_seconds_max",
    "last_complete_checkpoint_step": "preemptible_last_complete_checkpoint_step",
    "stop_requested": "preemptible_stop_requested",
}


class StepTimings(BaseModel):
    """Wall-clock seconds per optimizer step, as measured by the runtime."""

    model_config = ConfigDict(extra="ignore")
    last: float | None = None
    ema: float | None = None
    p99: float | None = None
    max: float | None = None
    count: int = 0


class SaveTimings(BaseModel):
    """Wall-clock seconds per checkpoint save (sentinel created to manifest committed)."""

    model_config = ConfigDict(extra="ignore")
    last: float | None = None
    max: float | None = None
    count: int = 0
    recent_blocking: list[float] = Field(
        default_factory=list,
        description="The last few saves that blocked training (JIT saves and periodic saves "
        "without save_async), newest last: what a JIT save is expected to take. Background "
        "writes are not in it (measured while training competed for CPU and disk).",
    )


class TerminationMessage(BaseModel):
    """What the runtime writes to the termination-message file before it exits.

    Kubernetes keeps at most 4096 bytes of it, so keep it small.
    """

    model_config = ConfigDict(extra="ignore")
    reason: Literal["preempted", "completed", "failed", "deadline_too_short"]
    step: int = Field(description="Global step reached when the process stopped.")
    checkpoint: str | None = Field(default=None, description="Path of the checkpoint just written.")
    complete: bool = Field(default=False, description="Whether that checkpoint is complete.")
    attempt: int | None = None
    resumed_from: str | None = Field(
        default=None,
        description="Path of the checkpoint this attempt actually loaded (None: a fresh start). "
        "It differs from PREEMPTIBLE_RESUME_FROM's choice when that checkpoint was corrupt and "
        "the runtime fell back to an earlier complete one.",
    )
    resumed_from_step: int | None = Field(
        default=None, description="With resumed_from: that checkpoint's global step."
    )
    step_seconds: StepTimings = Field(default_factory=StepTimings)
    save_seconds: SaveTimings = Field(default_factory=SaveTimings)
    sigterm_to_exit_seconds: float | None = None
    micro_batch_seconds: StepTimings | None = Field(
        default=None,
        description="Wall-clock seconds per micro-batch (forward + backward) with gradient "
        "accumulation: the unit of the micro_batch stop policy's grace rule.",
    )
    stop: str | None = Field(
        default=None,
        description="How the JIT stop happened: 'step' (at a step boundary), 'micro_batch' "
        "(partial accumulation dropped), 'evaluation' (an evaluation abandoned), 'no_save' "
        "(deadline too short to save).",
    )
    message: str | None = Field(default=None, description="Human-readable detail (errors).")
    peer_gone: bool | None = Field(
        default=None,
        description="True when this rank stopped because another rank was gone (exit "
        "EXIT_PEER_FAILED); the cause is that rank's end.",
    )
    failed_rank: int | None = Field(
        default=None,
        description="With peer_gone: the rank that is gone, when known.",
    )
    rank: int | None = Field(
        default=None,
        description="Written by `trainer-runtime launch`: the global rank whose end decided the "
        "pod's exit code (a failure's first failing rank).",
    )
    local_rank: int | None = Field(
        default=None, description="With rank: that rank's local rank in the pod."
    )
    exit_codes: list[int | None] | None = Field(
        default=None,
        description="Written by `trainer-runtime launch`: each local rank's exit code, by local "
        "rank (None: unknown).",
    )


def under_operator() -> bool:
    """The operator's environment contract is present: exit codes and termination messages apply."""
    return bool(os.environ.get(ENV_OUTPUT_DIR) or os.environ.get(ENV_ATTEMPT))


def worker_termination_file(directory: str, local_rank: int) -> str:
    """Where the worker of ``local_rank`` writes its message under `trainer-runtime launch`."""
    return os.path.join(directory, f"local-rank-{local_rank}.json")


def local_rank_from_env(env: Mapping[str, str]) -> int:
    """$LOCAL_RANK (0 when unset or not a number: a process launched without torchrun)."""
    try:
        return int(env.get("LOCAL_RANK", "0") or 0)
    except ValueError:
        return 0


def writes_termination_message(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process writes a termination message: under `trainer-runtime launch` every
    worker does (to its own file, merged by the launcher); otherwise only a pod's main process
    (local rank 0), since /dev/termination-log is one file per pod and plain torchrun or
    accelerate launch start several workers that would overwrite each other's."""
    env = os.environ if env is None else env
    return bool(env.get(ENV_TERMINATION_DIR)) or local_rank_from_env(env) == 0


def termination_message_path(env: Mapping[str, str] | None = None) -> str | None:
    """The file this process writes its termination message to: its own file in
    $PREEMPTIBLE_TERMINATION_DIR (under `trainer-runtime launch`), else
    $PREEMPTIBLE_TERMINATION_LOG, else /dev/termination-log if it exists, else None."""
    env = os.environ if env is None else env
    directory = env.get(ENV_TERMINATION_DIR)
    if directory:
        return worker_termination_file(directory, local_rank_from_env(env))
    target = env.get(ENV_TERMINATION_LOG)
    if target:
        return target
    return DEFAULT_TERMINATION_LOG if os.path.exists(DEFAULT_TERMINATION_LOG) else None


def write_termination_message(msg: TerminationMessage, path: str | None = None) -> str | None:
    """Write ``msg`` where Kubernetes (or `trainer-runtime launch`) reads it; returns the path
    used, or None when there is none. The path is ``path``, else
    :func:`termination_message_path`."""
    target = path or termination_message_path()
    if not target:
        return None
    data = msg.model_dump_json(exclude_none=True)
    with open(target, "w", encoding="utf-8") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return target


def read_termination_message(text: str | None) -> TerminationMessage | None:
    """Parse a termination message; None when it is empty or not ours (e.g. a Python traceback)."""
    if not text:
        return None
    try:
        data: Any = json.loads(text)
        return TerminationMessage.model_validate(data)
    except (ValueError, TypeError):
        return None
