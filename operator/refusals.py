"""What a refused child does to the pass's status (pure): condition CreateRefused, the decision
the status shows instead (the pass keeps its own), the Warning Event and when to retry; and when
to look for the pods the Job controller is refused (tests/unit/operator/test_refusals.py). What a
refusal is: children.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from preemptible_operator import conditions as cond
from preemptible_operator import models
from preemptible_operator.children import Refusal, pods_refused, refusal_retry_seconds
from preemptible_operator.conditions import Event, Reason
from preemptible_operator.phases import Decision
from preemptible_operator.timestamps import parse_rfc3339

__all__ = [
    "RefusalOutcome",
    "awaits_pods",
    "clear_refused",
    "no_pods_wait",
    "pods_refusal",
    "refusal_outcome",
]


def clear_refused(
    conditions: list[models.Condition] | None, now: str, generation: int | None
) -> list[models.Condition] | None:
    """CreateRefused set False (the children exist now), where it was True."""
    before = cond.find_condition(conditions, cond.CREATE_REFUSED)
    if before is None or before.status != "True":
        return conditions
    return cond.set_condition(
        conditions, cond.CREATE_REFUSED, "False", Reason.CREATED, "", now, generation
    )


def awaits_pods(
    decision: Decision,
    spec: models.TrainingJobSpec | None,
    job: dict[str, Any] | None,
    recorded: bool,
) -> bool:
    """The attempt's Job exists, is not suspended and the pass waits for its pods (Pending): the
    pass then clears a refusal once pods exist, or looks why there are none."""
    return (
        decision.action == "none"
        and decision.phase == "Pending"
        and spec is not None
        and job is not None
        and not recorded
        and not (job.get("spec") or {}).get("suspend")
    )


def pods_refusal(job: dict[str, Any], events: list[dict[str, Any]]) -> Refusal | None:
    """The Job controller is refused the attempt's pods (a ResourceQuota, Pod Security
    Admission): it retries by itself; the refusal only shows why (never fatal)."""
    why = pods_refused(job, events)
    if why is None:
        return None
    return Refusal(
        Reason.PODS_REFUSED,
        f"the Job controller cannot create the pods of Job {job['metadata']['name']}: {why}",
        fatal=False,
    )


def no_pods_wait(job: dict[str, Any], now: float) -> float:
    """When to look again at a Job that has no pods and no refusal yet (no watch event comes
    for a refusal): backing off with the Job's age."""
    created = parse_rfc3339(job["metadata"].get("creationTimestamp"))
    return refusal_retry_seconds(now - created if created is not None else 0.0)


@dataclass(frozen=True)
class RefusalOutcome:
    """What a refused child shows: CreateRefused True, the decision the status shows."""

    conditions: list[models.Condition]
    decision: Decision
    """Failed for a fatal refusal (the spec cannot succeed), else the decided phase; no action."""
    event: Event | None
    """A Warning when the refusal is new or says something new."""
    requeue_after: float | None
    """When to retry (None when fatal: nothing to retry)."""


def refusal_outcome(
    conditions: list[models.Condition] | None,
    refusal: Refusal,
    decision: Decision,
    now: str,
    generation: int | None,
    now_s: float,
) -> RefusalOutcome:
    """Condition CreateRefused True with the refusal; a retry backing off with how long it has
    been refused (since the condition turned True)."""
    before = cond.find_condition(conditions, cond.CREATE_REFUSED)
    after = cond.set_condition(
        conditions,
        cond.CREATE_REFUSED,
        "True",
        refusal.reason,
        refusal.message,
        now,
        generation,
    )
    event: Event | None = None
    if (
        before is None
        or before.status != "True"
        or (before.reason, before.message) != (refusal.reason, refusal.message)
    ):
        event = ("Warning", refusal.reason, refusal.message)
    shown = Decision(
        "Failed" if refusal.fatal else decision.phase, "none", refusal.reason, refusal.message
    )
    requeue: float | None = None
    if not refusal.fatal:
        now_refused = cond.find_condition(after, cond.CREATE_REFUSED)
        since = parse_rfc3339(now_refused.last_transition_time if now_refused else None)
        requeue = refusal_retry_seconds(now_s - since if since is not None else 0.0)
    return RefusalOutcome(after, shown, event, requeue)
