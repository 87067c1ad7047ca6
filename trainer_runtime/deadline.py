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
"""

from __future__ import annotations

import math
from enum import IntEnum
from typing import Literal

__all__ = [
    "Action",
    "StopPolicy",
    "deadline_budget",
    "micro_batch_action",
    "save_action",
]

StopPolicy = Literal["finish_step", "micro_batch"]


class Action(IntEnum):
    """A rank's wish at a decision point; ranks agree on the largest (the most urgent)."""

    CONTINUE = 0
    """Go on: the next micro-batch (or the save)."""
    DROP_STEP = 1
    """Drop the partial accumulation now and save the last completed step."""
    SKIP_SAVE = 2
    """Not even the save fits the deadline: exit without writing."""


def deadline_budget(grace_seconds: float | None, node_notice_seconds: float | None) -> float | None:
    """Seconds from SIGTERM to the deadline: the shorter of grace and node notice (None: none)."""
    known = [s for s in (grace_seconds, node_notice_seconds) if s is not None]
    return min(known) if known else None


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def micro_batch_action(
    *,
    policy: StopPolicy,
    acting: bool,
    seconds_left: float | None,
    micro_batches_left: int,
    micro_batch_seconds: float | None,
    save_seconds: float | None,
) -> Action:
    """The decision at a micro-batch boundary, ``micro_batches_left`` (>= 1) before the step ends.

    ``acting``: a SIGTERM arrived on this rank and kill_wait has passed. ``seconds_left``: until
    the deadline (None: no deadline known). ``micro_batch_seconds``: the longest micro-batch seen
    (None: none measured yet); ``save_seconds``: the longest save seen (None: unknown, counted 0).
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
    rest = micro_batches_left * per_batch + (_finite(save_seconds) or 0.0)
    return Action.DROP_STEP if rest > left else Action.CONTINUE


def save_action(*, seconds_left: float | None, save_seconds: float | None) -> Action:
    """SKIP_SAVE when the longest save seen cannot finish before the deadline, else CONTINUE.

    Unknown save time or no deadline: save (nothing says it cannot fit).
    """
    left, save = _finite(seconds_left), _finite(save_seconds)
    if left is None or save is None:
        return Action.CONTINUE
    return Action.SKIP_SAVE if save > left else Action.CONTINUE
