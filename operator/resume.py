"""Which checkpoint the next attempt resumes from, and the attempt fence value (pure)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from preemptible_operator.models import CheckpointRef

__all__ = ["FENCE_STRIDE", "LATEST", "ResumeChoice", "attempt_fence", "resume_checkpoint"]

LATEST = "latest"

FENCE_STRIDE = 1_000_000
"""Attempts per TrainingJob incarnation in the fence value (far more than any job makes)."""


@dataclass(frozen=True)
class ResumeChoice:
    """Value of PREEMPTIBLE_RESUME_FROM and the step it stands for (None: unknown)."""

    resume_from: str
    step: int | None
    source: str


def resume_checkpoint(
    storage_seen: bool,
    storage_latest: CheckpointRef | None,
    reported_latest: CheckpointRef | None,
) -> ResumeChoice:
    """Decide PREEMPTIBLE_RESUME_FROM for the next attempt (any attempt, the first included).

    ``storage_seen``: the operator looked at the checkpoint root just now and saw it (mapped,
    present, listed in time); ``storage_latest`` is then the newest complete checkpoint it
    verified, None when it saw none. ``reported_latest``: the newest complete checkpoint the
    runtime reported (termination message, /metrics) or any earlier pass saw.

    A path only when the operator saw the storage itself and its newest complete checkpoint is
    at least what the runtime reported (storage on a tie: its path is verified). A report alone
    is never sent as a path: it can be older than the newest complete checkpoint (a periodic
    save committed after the last scrape, a pod that ended without a message), and a path sends
    training back to it. Every other case is "latest": the runtime applies the completeness
    rule itself and takes the newest complete checkpoint (none: it starts fresh); the attempt
    fence already keeps stale writers out. ``step`` is then the newest step the operator knows
    of (the report), the least the runtime is expected to load. The operator never forces a
    fresh start (""): a root it cannot see, or sees empty, says nothing sure about the pods'
    volume (the path map may point at another volume, e.g. the operator's own PVC for every
    namespace), while "latest" over an empty root costs nothing.
    """
    if (
        storage_seen
        and storage_latest is not None
        and (reported_latest is None or storage_latest.step >= reported_latest.step)
    ):
        return ResumeChoice(storage_latest.path, storage_latest.step, "storage")
    known = reported_latest.step if reported_latest is not None else None
    if storage_seen and storage_latest is not None:
        return ResumeChoice(
            LATEST, known, "storage listed older than the runtime reported: the runtime looks"
        )
    if storage_seen:
        return ResumeChoice(
            LATEST, known, "storage seen without a complete checkpoint: the runtime looks"
        )
    return ResumeChoice(LATEST, known, "storage not visible to the operator: the runtime looks")


def attempt_fence(created: str | None, attempt: int) -> int:
    """The value of PREEMPTIBLE_ATTEMPT: increases with every attempt of a TrainingJob and from
    one incarnation of a name to the next.

    The runtime refuses to write next to a checkpoint of a higher attempt value (a stale pod must
    never overwrite a newer attempt's work). A TrainingJob deleted and re-created over the same
    ``checkpoint.uri`` restarts its attempt count at 1, so a plain count would be refused by
    every checkpoint the old incarnation left. The fence therefore is
    ``creationTimestamp (Unix seconds) * FENCE_STRIDE + attempt``: a later incarnation is always
    higher, with no storage access needed (the operator often cannot read the pods' volume).
    Values stay below 2**53 (exact in JSON). Without a creation time, the plain attempt number.
    """
    if not created:
        return attempt
    try:
        seconds = dt.datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return attempt
    return int(seconds) * FENCE_STRIDE + attempt
