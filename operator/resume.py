"""Which checkpoint the next attempt resumes from (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from preemptible_operator.models import CheckpointRef

__all__ = ["LATEST", "ResumeChoice", "resume_checkpoint"]

LATEST = "latest"


@dataclass(frozen=True)
class ResumeChoice:
    """Value of PREEMPTIBLE_RESUME_FROM and the step it stands for (None: unknown)."""

    resume_from: str
    step: int | None
    source: str


def resume_checkpoint(
    attempt: int,
    storage_readable: bool,
    storage_latest: CheckpointRef | None,
    reported_latest: CheckpointRef | None,
) -> ResumeChoice:
    """Decide PREEMPTIBLE_RESUME_FROM for attempt ``attempt``.

    - The operator reads storage: the newest complete checkpoint it verified (path as the pods
      see it), or "" (fresh start) when there is none.
    - It cannot: the first attempt starts fresh unless the runtime already reported a checkpoint;
      later attempts get "latest" and the runtime applies the completeness rule itself (a
      checkpoint the runtime reported may have been rotated away or be newer than the report).
      The expected step is the one the runtime last reported.
    """
    if storage_readable:
        if storage_latest is None:
            return ResumeChoice("", 0, "storage: no complete checkpoint")
        return ResumeChoice(storage_latest.path, storage_latest.step, "storage")
    if attempt <= 1 and reported_latest is None:
        return ResumeChoice("", 0, "first attempt")
    step = reported_latest.step if reported_latest is not None else None
    return ResumeChoice(LATEST, step, "runtime reports (storage not readable by the operator)")
