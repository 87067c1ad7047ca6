"""Starting an attempt (pure): the next attempt's plan (grace, resume checkpoint, fence, what
it cleans up), the parameters of a Job an earlier pass created, and its record in the pass's
working status (tests/unit/operator/test_start.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from preemptible_operator import models, render
from preemptible_operator.checkpoint_store import StorageSnapshot
from preemptible_operator.children import jobs_to_delete
from preemptible_operator.grace import GraceDecision, cap_grace, next_grace
from preemptible_operator.interval import auto_save_interval
from preemptible_operator.observation import Snapshot
from preemptible_operator.phases import next_attempt_number
from preemptible_operator.recording import snapshot_ref
from preemptible_operator.resume import attempt_fence, resume_checkpoint

__all__ = [
    "AttemptPlan",
    "adopted_params",
    "attempt_created_message",
    "current_record",
    "find_record",
    "outcomes",
    "plan_attempt",
    "start_attempt",
]


def find_record(status: models.TrainingJobStatus, attempt: int) -> models.AttemptRecord | None:
    """The record of ``attempt`` in status.attempts, if any."""
    for rec in status.attempts or []:
        if rec.attempt == attempt:
            return rec
    return None


def current_record(
    status: models.TrainingJobStatus, attempt: int, job: dict[str, Any] | None
) -> models.AttemptRecord | None:
    """The current attempt's record in the pass's working status. A Job without a record: the
    pass that created it crashed before writing the status; the record is rebuilt from the
    Job's annotations (and the backoff that preceded it is over)."""
    record = find_record(status, attempt)
    if not attempt or record is not None or job is None:
        return record
    ann = job["metadata"].get("annotations") or {}
    record = models.AttemptRecord(
        attempt=attempt,
        job_name=job["metadata"]["name"],
        start_time=job["metadata"].get("creationTimestamp"),
        resume_from=ann.get(render.ANNOTATION_RESUME_FROM),
        start_step=_int_or_none(ann.get(render.ANNOTATION_START_STEP)),
        grace_seconds=_int_or_none(ann.get(render.ANNOTATION_GRACE)),
        nodes=_completions(job),
    )
    status.attempts = [*(status.attempts or []), record]
    # The pass that created attempt 1 never wrote status.startTime either: the Job's creation
    # is when activeDeadlineSeconds starts to count (never left unset: no deadline then).
    status.start_time = status.start_time or record.start_time
    status.next_attempt_after = None
    gp = status.grace_period or models.GraceStatus()
    gp.current = record.grace_seconds
    status.grace_period = gp
    return record


def outcomes(status: models.TrainingJobStatus) -> dict[int, str | None]:
    """Each recorded attempt's outcome (None while it runs)."""
    return {rec.attempt: rec.outcome for rec in status.attempts or []}


@dataclass(frozen=True)
class AttemptPlan:
    """The attempt a create_attempt pass creates, and what it cleans up once its Job exists."""

    params: render.AttemptParams
    grace: GraceDecision
    old_jobs: list[dict[str, Any]]
    """Earlier attempts' Jobs to delete (the newest failed one is kept for its logs)."""
    old_pods: list[dict[str, Any]]
    """Earlier attempts' pods to release (all finished: the decision waited for that)."""
    previous: models.AttemptRecord | None
    """The newest attempt recorded before this one."""


def plan_attempt(
    snap: Snapshot,
    spec: models.TrainingJobSpec,
    status: models.TrainingJobStatus,
    recorded: bool,
    reported: models.CheckpointRef | None,
    storage: StorageSnapshot | None,
    max_grace_seconds: int | None,
) -> AttemptPlan:
    """The next attempt (or the current one again, when its Job is missing and it was never
    recorded): its grace from the measurements (doubled after a kill at the grace deadline,
    capped by the operator), where it resumes (storage's look ``storage``, already applied to
    ``status``, or the newest checkpoint ``reported`` before that) and its fence."""
    meta = snap.obj["metadata"]
    attempt = next_attempt_number(snap.attempt, recorded)
    # Earlier attempts' leftovers, cleaned up once this attempt's Job exists (in the
    # background, like an ended attempt's, which usually did it already). Their pods have
    # all finished (the decision waits for that; the Jobs fail on exit and never replace a
    # pod), so nothing of theirs can write checkpoints any more.
    old_jobs = [
        dict(j)
        for j in jobs_to_delete(snap.jobs, outcomes(status), attempt - 1, snap.pods_by_attempt)
    ]
    old_pods = [p for n, ps in snap.pods_by_attempt.items() if n < attempt for p in ps]
    last = (status.attempts or [])[-1] if status.attempts else None
    killed_grace = last.grace_seconds if last is not None and last.killed else None
    grace = cap_grace(
        next_grace(spec.grace_period, status.timings, killed_grace), max_grace_seconds
    )
    choice = resume_checkpoint(storage is not None, snapshot_ref(storage), reported)
    params = render.AttemptParams(
        attempt=attempt,
        grace_seconds=grace.seconds,
        resume_from=choice.resume_from,
        suspended=bool(spec.queue_name),
        start_step=choice.step,
        fence=attempt_fence(meta.get("creationTimestamp"), attempt),
        save_interval_seconds=auto_save_interval(spec, status),
    )
    return AttemptPlan(params, grace, old_jobs, old_pods, last)


def _int_or_none(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


def adopted_params(existing: dict[str, Any], planned: render.AttemptParams) -> render.AttemptParams:
    """The attempt's Job exists already (ours: an earlier pass created it and did not record
    it): what it was created with, from its annotations, rules over this pass's plan."""
    ann = existing["metadata"].get("annotations") or {}
    return render.AttemptParams(
        attempt=planned.attempt,
        grace_seconds=int(ann.get(render.ANNOTATION_GRACE, planned.grace_seconds)),
        resume_from=ann.get(render.ANNOTATION_RESUME_FROM, planned.resume_from),
        suspended=planned.suspended,
        start_step=_int_or_none(ann.get(render.ANNOTATION_START_STEP)),
        fence=planned.fence,
        # An elastic attempt's size is the Job's (the admission may have changed since).
        nodes=_completions(existing) if planned.nodes is not None else None,
        elastic=planned.elastic,
        node_selector=planned.node_selector,
        tolerations=planned.tolerations,
    )


def _completions(job: dict[str, Any]) -> int | None:
    value = (job.get("spec") or {}).get("completions")
    return int(value) if value is not None else None


def start_attempt(
    status: models.TrainingJobStatus, name: str, params: render.AttemptParams, now: str
) -> None:
    """Record the attempt whose Job now exists in the pass's working status: its record (once),
    the current attempt, the start time, its grace; the backoff is over."""
    if find_record(status, params.attempt) is None:
        status.attempts = [
            *(status.attempts or []),
            models.AttemptRecord(
                attempt=params.attempt,
                job_name=render.job_name(name, params.attempt),
                start_time=now,
                start_step=params.start_step,
                resume_from=params.resume_from,
                grace_seconds=params.grace_seconds,
            ),
        ]
    status.attempt = params.attempt
    status.start_time = status.start_time or now
    status.next_attempt_after = None
    gp = status.grace_period or models.GraceStatus()
    gp.current = params.grace_seconds
    status.grace_period = gp


def attempt_created_message(name: str, params: render.AttemptParams, grace_reason: str) -> str:
    """The Event message of a created attempt."""
    return (
        f"attempt {params.attempt}: Job {render.job_name(name, params.attempt)}, grace "
        f"{params.grace_seconds} s ({grace_reason}), resume from "
        f"{params.resume_from or 'scratch'!r}"
    )
