"""What a JIT stop does with the time it has left (pure, torch-free, table-tested).

After a SIGTERM the runtime has until its deadline: the SIGTERM time plus the pod's grace period
($PREEMPTIBLE_GRACE_SECONDS), or plus the node's notice ($PREEMPTIBLE_NODE_NOTICE_SECONDS) when
that is shorter (a spot node goes away after its notice whatever grace the pod asked for). Once
``kill_wait`` has passed, every rank takes these decisions and all ranks agree on the most urgent
one (an all-reduce MAX of :class:`Action`):

- at a micro-batch boundary inside a gradient-accumulation step (:func:`micro_batch_action`):
  under ``micro_batch`` always drop the partial accumulation and save the last completed step at
  once; under ``finish_step`` only when the rest of the step plus the save would miss the deadline;
- before the save (:func:`save_action`): when even the longest save seen cannot finish in the time
  left, do not start it (a save SIGKILLed half-way is worth nothing) and exit at once.

Every one of these keeps back the exit reserve (:func:`exit_reserve`): what must still run after
the commit (rotation deletes, a barrier, ``on_save`` callbacks, the termination message, the
process group's teardown, the launcher's merge). A save that fits only without it is not started:
a checkpoint committed so late that the pod is SIGKILLed before its message is written reads as a
grace kill, not a preemption. A periodic save that falls due once a SIGTERM arrived is the JIT
save (:func:`due_save_action`): one save, on the JIT path, counted as the stop's.
"""

from __future__ import annotations

import math
from enum import IntEnum
from typing import Literal

__all__ = [
    "EXIT_TEARDOWN_SECONDS",
    "LAUNCHER_MARGIN_MAX",
    "LAUNCHER_MARGIN_MIN",
    "UNMEASURED_POST_COMMIT_SECONDS",
    "Action",
    "DueSave",
    "StopPolicy",
    "deadline_budget",
    "due_save_action",
    "exit_reserve",
    "launcher_margin",
    "micro_batch_action",
    "save_action",
    "torchrun_shutdown_timeout",
]

# What the exit after a commit takes that no save measures: the termination message, the process
# group's teardown, the interpreter's exit, the launcher's merge of its workers' messages.
EXIT_TEARDOWN_SECONDS = 1.0
# The post-commit work (rotation deletes, the barrier, on_save callbacks) before any save of this
# run was measured: a floor, replaced by the longest measured once there is one.
UNMEASURED_POST_COMMIT_SECONDS = 1.0
# The launcher's margin after torchrun's shutdown timeout (launcher_margin).
LAUNCHER_MARGIN_MIN = 2.0
LAUNCHER_MARGIN_MAX = 5.0

StopPolicy = Literal["finish_step", "micro_batch"]


class Action(IntEnum):
    """A rank's wish at a decision point; ranks agree on the largest (the most urgent)."""

    CONTINUE = 0
    """Go on: the next micro-batch (or the save)."""
    DROP_STEP = 1
    """Drop the partial accumulation now and save the last completed step."""
    SKIP_SAVE = 2
    """Not even the save fits the deadline: exit without writing."""


def deadline_budget(
    grace_seconds: float | None,
    node_notice_seconds: float | None,
    launcher_timeout_seconds: float | None = None,
) -> float | None:
    """Seconds from SIGTERM to the deadline: the shortest of grace, node notice and the shutdown
    timeout of the torchrun agent this process is a worker of (it SIGKILLs its workers then,
    before the grace ends: :func:`torchrun_shutdown_timeout`). None: no deadline known."""
    known = [
        s for s in (grace_seconds, node_notice_seconds, launcher_timeout_seconds) if s is not None
    ]
    return min(known) if known else None


def launcher_margin(grace_seconds: float) -> float:
    """Seconds a launcher keeps between SIGKILLing its workers and the kubelet's SIGKILL of the
    pod: the launcher merges its workers' messages and writes the pod's termination message
    there, so the kubelet has one to read. A tenth of the grace, at least 2 s, at most 5 s."""
    return min(LAUNCHER_MARGIN_MAX, max(LAUNCHER_MARGIN_MIN, 0.1 * grace_seconds))


def torchrun_shutdown_timeout(grace_seconds: float) -> int:
    """torchrun's ``--shutdown-timeout`` (``$TORCH_ELASTIC_SHUTDOWN_TIMEOUT``) for a pod with
    ``grace_seconds`` of grace: the grace less :func:`launcher_margin`, whole seconds, >= 1.
    Its workers' deadline is that timeout (:func:`deadline_budget`)."""
    return max(1, math.floor(grace_seconds - launcher_margin(grace_seconds)))


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def exit_reserve(post_commit_seconds: float | None) -> float:
    """Seconds kept back before the deadline for what follows a commit: the longest post-commit
    work measured (rotation, barrier, ``on_save``; None: nothing measured yet, the floor
    ``UNMEASURED_POST_COMMIT_SECONDS``) plus the teardown no save measures."""
    measured = _finite(post_commit_seconds)
    post = UNMEASURED_POST_COMMIT_SECONDS if measured is None else max(0.0, measured)
    return post + EXIT_TEARDOWN_SECONDS


class DueSave(IntEnum):
    """What becomes of a periodic save due at a step boundary; ranks agree on the largest."""

    PERIODIC = 0
    """No SIGTERM: the periodic save, as configured."""
    DEFER = 1
    """A SIGTERM arrived, ``kill_wait`` still running (training goes on, as transformers does):
    not written now; the stop's JIT save writes a later step (or the last one, should training
    end first)."""
    JIT_NOW = 2
    """A SIGTERM arrived and ``kill_wait`` is over: the stop happens at this step boundary and
    this save is its JIT save."""


def due_save_action(*, jit_enabled: bool, sigterm: int, training_finished: bool) -> DueSave:
    """A periodic save is due at this step boundary. ``sigterm``: 0 no SIGTERM on any rank, 1 one
    arrived (``kill_wait`` running), 2 the stop is due (all agreed: the largest). A save due
    after a SIGTERM is never a periodic save followed by a second, JIT save a few steps later:
    one JIT save (sharded, no full gather, checked against the deadline) replaces both. Not at
    the last step (``training_finished``): that save ends a completed run, which exits 0."""
    if not jit_enabled or training_finished or sigterm <= 0:
        return DueSave.PERIODIC
    return DueSave.JIT_NOW if sigterm >= 2 else DueSave.DEFER


def micro_batch_action(
    *,
    policy: StopPolicy,
    acting: bool,
    seconds_left: float | None,
    micro_batches_left: int,
    micro_batch_seconds: float | None,
    save_seconds: float | None,
    exit_seconds: float = 0.0,
) -> Action:
    """The decision at a micro-batch boundary, ``micro_batches_left`` (>= 1) before the step ends.

    ``acting``: a SIGTERM arrived on this rank and kill_wait has passed. ``seconds_left``: until
    the deadline (None: no deadline known). ``micro_batch_seconds``: the longest micro-batch seen
    (None: none measured yet); ``save_seconds``: the longest save seen (None: unknown, counted 0);
    ``exit_seconds``: the exit reserve kept back after the commit (:func:`exit_reserve`).
    """
    if not acting or micro_batches_left <= 0:
        return Action.CONTINUE
    if policy == "micro_batch":
        return Action.DROP_STEP
    left = _finite(seconds_left)
    if left is None:
        return Action.CONTINUE  # no deadline known: finish the step, as the policy says
    per_batch = _finite(micro_batch_seconds)
    if per_batch is None:
        return Action.CONTINUE  # nothing to estimate the rest of the step with
    rest = micro_batches_left * per_batch + (_finite(save_seconds) or 0.0) + exit_seconds
    return Action.DROP_STEP if rest > left else Action.CONTINUE


def save_action(
    *, seconds_left: float | None, save_seconds: float | None, exit_seconds: float = 0.0
) -> Action:
    """SKIP_SAVE when the longest save seen, plus the exit reserve ``exit_seconds`` kept back for
    what follows its commit, cannot finish before the deadline, else CONTINUE.

    Unknown save time or no deadline: save (nothing says it cannot fit).
    """
    left, save = _finite(seconds_left), _finite(save_seconds)
    if left is None or save is None:
        return Action.CONTINUE
    return Action.SKIP_SAVE if save + exit_seconds > left else Action.CONTINUE
