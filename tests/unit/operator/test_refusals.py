"""What a refused child does to the pass (refusals.py)."""

from __future__ import annotations

from typing import Any

import pytest

from preemptible_operator import conditions as conds
from preemptible_operator import models
from preemptible_operator.children import Refusal
from preemptible_operator.conditions import Reason
from preemptible_operator.phases import Decision
from preemptible_operator.refusals import (
    awaits_pods,
    clear_refused,
    no_pods_wait,
    pods_refusal,
    refusal_outcome,
)
from tests.unit.operator.builders import cond, make_job, make_spec

T0 = 1_780_000_000.0  # 2026-05-28T20:26:40Z
T0_RFC = "2026-05-28T20:26:40Z"


def _conditions(ctype: str, status: str, reason: str = "", message: str = "") -> Any:
    return conds.set_condition(None, ctype, status, reason, message, "2026-05-28T20:00:00Z", 1)  # type: ignore[arg-type]


REFUSED = _conditions(conds.CREATE_REFUSED, "True", Reason.CHILD_FORBIDDEN, "quota")


@pytest.mark.parametrize(
    ("before", "expected"),
    [
        (None, None),
        (REFUSED, "False"),
        (_conditions(conds.CREATE_REFUSED, "False", Reason.CREATED), "False"),
    ],
    ids=["none", "refused-cleared", "already-clear"],
)
def test_clear_refused(before: Any, expected: str | None) -> None:
    after = clear_refused(before, T0_RFC, 2)
    found = conds.find_condition(after, conds.CREATE_REFUSED)
    assert (found.status if found else None) == expected
    if before is not None and before[0].status == "False":
        assert after is before  # nothing to change: the same list


PENDING = Decision("Pending", "none", Reason.STARTED)


AWAITS = [
    # (id, decision, spec, job, recorded, awaits)
    ("pending-job-running", PENDING, make_spec(), make_job(), False, True),
    ("queued-job-suspended", PENDING, make_spec(), make_job(suspend=True), False, False),
    ("no-job", PENDING, make_spec(), None, False, False),
    ("recorded", PENDING, make_spec(), make_job(), True, False),
    ("no-spec", PENDING, None, make_job(), False, False),
    ("running", Decision("Running", "none", Reason.STARTED), make_spec(), make_job(), False, False),
    (
        "creating",
        Decision("Pending", "create_attempt", Reason.STARTED),
        make_spec(),
        make_job(),
        False,
        False,
    ),
]


@pytest.mark.parametrize(
    ("decision", "spec", "job", "recorded", "expected"),
    [c[1:] for c in AWAITS],
    ids=[c[0] for c in AWAITS],
)
def test_awaits_pods(
    decision: Decision,
    spec: models.TrainingJobSpec | None,
    job: dict[str, Any] | None,
    recorded: bool,
    expected: bool,
) -> None:
    assert awaits_pods(decision, spec, job, recorded) is expected


def _failed_create(message: str, at: str) -> dict[str, Any]:
    return {"reason": "FailedCreate", "message": message, "lastTimestamp": at}


@pytest.mark.parametrize(
    ("events", "job_conditions", "message"),
    [
        ([], [], None),
        (
            [
                _failed_create("old", "2026-01-01T00:00:00Z"),
                _failed_create("quota", "2026-01-02T00:00:00Z"),
            ],
            [],
            "the Job controller cannot create the pods of Job tj-a1: quota",
        ),
        (
            [],
            [cond("ReplicaFailure", "FailedCreate", "forbidden: PSA")],
            "the Job controller cannot create the pods of Job tj-a1: forbidden: PSA",
        ),
    ],
    ids=["nothing-said", "newest-event", "job-condition"],
)
def test_pods_refusal(
    events: list[dict[str, Any]], job_conditions: list[dict[str, Any]], message: str | None
) -> None:
    got = pods_refusal(make_job(conditions=job_conditions), events)
    if message is None:
        assert got is None
        return
    assert got == Refusal(Reason.PODS_REFUSED, message, fatal=False)


@pytest.mark.parametrize(
    ("created", "wait"),
    [
        (None, 5.0),
        ("2026-05-28T20:26:38Z", 5.0),
        ("2026-05-28T20:25:40Z", 60.0),
        ("2026-05-28T10:00:00Z", 300.0),
    ],
    ids=["unknown-age", "new", "a-minute", "hours"],
)
def test_no_pods_wait_backs_off_with_the_job_age(created: str | None, wait: float) -> None:
    job = make_job()
    if created is not None:
        job["metadata"]["creationTimestamp"] = created
    assert no_pods_wait(job, T0) == pytest.approx(wait)


FORBIDDEN = Refusal(Reason.CHILD_FORBIDDEN, "quota", fatal=False)


INVALID = Refusal(Reason.CHILD_INVALID, "Job tj-a1 is invalid", fatal=True)


REFUSALS = [
    # (id, conditions before, refusal, phase, event, requeue_after)
    ("new-temporary", None, FORBIDDEN, "Pending", True, 5.0),
    # Refused since 20:00:00, 1600 s before T0: retried at the cap.
    ("same-again", REFUSED, FORBIDDEN, "Pending", False, 300.0),
    (
        "says-something-new",
        REFUSED,
        Refusal(Reason.CHILD_FORBIDDEN, "other quota", fatal=False),
        "Pending",
        True,
        300.0,
    ),
    ("fatal", None, INVALID, "Failed", True, None),
]


@pytest.mark.parametrize(
    ("before", "refusal", "phase", "event", "requeue"),
    [c[1:] for c in REFUSALS],
    ids=[c[0] for c in REFUSALS],
)
def test_refusal_outcome(
    before: Any, refusal: Refusal, phase: str, event: bool, requeue: float | None
) -> None:
    got = refusal_outcome(before, refusal, PENDING, T0_RFC, 3, T0)
    found = conds.find_condition(got.conditions, conds.CREATE_REFUSED)
    assert found is not None and (found.status, found.reason, found.message) == (
        "True",
        refusal.reason,
        refusal.message,
    )
    assert got.decision == Decision(phase, "none", refusal.reason, refusal.message)  # type: ignore[arg-type]
    assert got.event == (("Warning", refusal.reason, refusal.message) if event else None)
    assert got.requeue_after == (pytest.approx(requeue) if requeue is not None else None)
