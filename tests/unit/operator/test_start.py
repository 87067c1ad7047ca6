"""Starting an attempt (start.py): its plan, an adopted Job's parameters, its record."""

from __future__ import annotations

from typing import Any

import pytest

from preemptible_operator import models, render
from preemptible_operator.resume import attempt_fence
from preemptible_operator.start import (
    adopted_params,
    attempt_created_message,
    current_record,
    find_record,
    plan_attempt,
    start_attempt,
)
from tests.unit.operator.builders import cond, make_job, make_pod, make_snapshot, make_spec

T0_RFC = "2026-05-28T20:26:40Z"


def _record(**fields: Any) -> models.AttemptRecord:
    return models.AttemptRecord(**{"attempt": 1, "job_name": "tj-a1", **fields})


def _annotated_job(**ann: str) -> dict[str, Any]:
    job = make_job()
    job["metadata"]["annotations"] = ann
    job["metadata"]["creationTimestamp"] = T0_RFC
    return job


def test_find_record() -> None:
    status = models.TrainingJobStatus(attempts=[_record(attempt=1), _record(attempt=3)])
    assert find_record(status, 3) is status.attempts[1]  # type: ignore[index]
    assert find_record(status, 2) is None
    assert find_record(models.TrainingJobStatus(), 1) is None


def test_current_record_found() -> None:
    status = models.TrainingJobStatus(attempts=[_record()], next_attempt_after=T0_RFC)
    assert current_record(status, 1, make_job()) is status.attempts[0]  # type: ignore[index]
    assert status.next_attempt_after == T0_RFC  # nothing rebuilt, nothing changed
    assert current_record(models.TrainingJobStatus(), 0, make_job()) is None
    assert current_record(models.TrainingJobStatus(), 1, None) is None


def test_current_record_rebuilt_from_the_job() -> None:
    """The pass that created the Job crashed before writing the status."""
    status = models.TrainingJobStatus(next_attempt_after=T0_RFC)
    job = _annotated_job(
        **{
            render.ANNOTATION_GRACE: "45",
            render.ANNOTATION_START_STEP: "12",
            render.ANNOTATION_RESUME_FROM: "/ckpt/run/checkpoint-12",
        }
    )
    record = current_record(status, 2, job)
    assert record is not None and status.attempts == [record]
    assert (record.attempt, record.job_name, record.start_time) == (2, "tj-a1", T0_RFC)
    assert (record.grace_seconds, record.start_step) == (45, 12)
    assert record.resume_from == "/ckpt/run/checkpoint-12"
    assert status.next_attempt_after is None
    assert status.grace_period is not None and status.grace_period.current == 45


@pytest.mark.parametrize(
    ("start_time", "expected"),
    [(None, T0_RFC), ("2025-12-31T00:00:00Z", "2025-12-31T00:00:00Z")],
    ids=["lost-start-time-from-the-job", "kept"],
)
def test_current_record_rebuilt_sets_the_start_time(start_time: str | None, expected: str) -> None:
    """The operator died between creating attempt 1's Job and writing the status: the job's
    start (activeDeadlineSeconds counts from it) is the Job's creation, never left unset."""
    status = models.TrainingJobStatus(start_time=start_time)
    assert current_record(status, 1, _annotated_job()) is not None
    assert status.start_time == expected


def _job_of(attempt: int, *, failed: bool = False) -> dict[str, Any]:
    conditions = [cond("Failed", "BackoffLimitExceeded")] if failed else []
    job = make_job(conditions=conditions)
    job["metadata"]["name"] = f"tj-a{attempt}"
    return job


CKPT_10 = models.CheckpointRef(step=10, path="/ckpt/run/checkpoint-10")


PLANS = [
    # (id, snapshot attempt, recorded, attempts, reported, attempt, resume_from, start_step,
    #  old job attempts)
    ("first", 0, False, [], None, 1, "latest", None, []),
    (
        "after-a-preemption",
        1,
        True,
        [_record(outcome="Preempted", end_time=T0_RFC)],
        CKPT_10,
        2,
        # storage not seen (None): the report is the least step expected, never a path
        "latest",
        10,
        [1],
    ),
    # The Job of an unrecorded attempt is missing: the same attempt again.
    ("recreate-unrecorded", 1, False, [_record()], None, 1, "latest", None, []),
    (
        # The newest failed attempt's Job stays for its logs; older ones go.
        "keeps-the-newest-failed-job",
        2,
        True,
        [
            _record(attempt=1, outcome="Failed", end_time=T0_RFC),
            _record(attempt=2, outcome="Failed", end_time=T0_RFC),
        ],
        None,
        3,
        "latest",
        None,
        [1],
    ),
]


@pytest.mark.parametrize(
    ("snap_attempt", "recorded", "attempts", "reported", "attempt", "resume", "start", "old"),
    [c[1:] for c in PLANS],
    ids=[c[0] for c in PLANS],
)
def test_plan_attempt(
    snap_attempt: int,
    recorded: bool,
    attempts: list[models.AttemptRecord],
    reported: models.CheckpointRef | None,
    attempt: int,
    resume: str,
    start: int | None,
    old: list[int],
) -> None:
    jobs = {n: _job_of(n, failed=True) for n in range(1, snap_attempt + 1)}
    pods = {n: [make_pod(f"p{n}", phase="Failed", exit_code=75)] for n in jobs}
    created = "2026-05-28T20:00:00Z"
    snap = make_snapshot(
        obj={
            "metadata": {"name": "tj", "namespace": "ns", "uid": "u", "creationTimestamp": created}
        },
        attempt=snap_attempt,
        jobs=jobs,
        pods_by_attempt=pods,
    )
    status = models.TrainingJobStatus(attempts=attempts or None)
    plan = plan_attempt(snap, make_spec(), status, recorded, reported, None, None)
    p = plan.params
    assert (p.attempt, p.resume_from, p.start_step) == (attempt, resume, start)
    assert p.fence == attempt_fence(created, attempt) and p.suspended is False
    assert [j["metadata"]["name"] for j in plan.old_jobs] == [f"tj-a{n}" for n in old]
    assert [pod["metadata"]["name"] for pod in plan.old_pods] == [
        f"p{n}" for n in range(1, attempt) if n in pods
    ]
    assert plan.previous == (attempts[-1] if attempts else None)


def test_plan_attempt_grace_doubles_after_a_kill_and_is_capped() -> None:
    killed = _record(outcome="Preempted", end_time=T0_RFC, killed=True, grace_seconds=200)
    status = models.TrainingJobStatus(attempts=[killed])
    snap = make_snapshot(attempt=1)
    plan = plan_attempt(snap, make_spec(), status, True, None, None, None)
    assert plan.params.grace_seconds == plan.grace.seconds == 400
    capped = plan_attempt(snap, make_spec(), status, True, None, None, 250)
    assert capped.params.grace_seconds == 250 and "--max-grace-seconds" in capped.grace.reason


def test_plan_attempt_under_kueue_starts_suspended() -> None:
    plan = plan_attempt(
        make_snapshot(),
        make_spec(queueName="q"),
        models.TrainingJobStatus(),
        False,
        None,
        None,
        None,
    )
    assert plan.params.suspended is True


def test_adopted_params_follow_the_existing_job() -> None:
    planned = render.AttemptParams(
        attempt=2,
        grace_seconds=60,
        resume_from="latest",
        suspended=True,
        start_step=None,
        fence=7,
        save_interval_seconds=300,
    )
    job = _annotated_job(
        **{
            render.ANNOTATION_GRACE: "45",
            render.ANNOTATION_START_STEP: "12",
            render.ANNOTATION_RESUME_FROM: "/c/checkpoint-12",
        }
    )
    assert adopted_params(job, planned) == render.AttemptParams(
        attempt=2,
        grace_seconds=45,
        resume_from="/c/checkpoint-12",
        suspended=True,
        start_step=12,
        fence=7,
    )
    # Not annotated (an older operator's Job): the plan's values.
    bare = adopted_params(make_job(), planned)
    assert (bare.grace_seconds, bare.resume_from, bare.start_step) == (60, "latest", None)


def test_start_attempt_records_it_once() -> None:
    params = render.AttemptParams(
        attempt=2, grace_seconds=45, resume_from="/c/checkpoint-12", suspended=False, start_step=12
    )
    status = models.TrainingJobStatus(
        attempts=[_record(outcome="Preempted", end_time=T0_RFC)],
        next_attempt_after=T0_RFC,
        start_time="2026-01-01T00:00:00Z",
    )
    start_attempt(status, "tj", params, T0_RFC)
    assert status.attempt == 2 and status.next_attempt_after is None
    assert status.start_time == "2026-01-01T00:00:00Z"  # the first attempt's
    assert status.grace_period is not None and status.grace_period.current == 45
    assert status.attempts is not None and len(status.attempts) == 2
    new = status.attempts[-1]
    assert (new.attempt, new.job_name, new.start_time, new.start_step, new.resume_from) == (
        2,
        render.job_name("tj", 2),
        T0_RFC,
        12,
        "/c/checkpoint-12",
    )
    start_attempt(status, "tj", params, "2026-05-28T20:30:00Z")  # a redone pass
    assert len(status.attempts) == 2 and status.attempts[-1].start_time == T0_RFC


def test_attempt_created_message() -> None:
    params = render.AttemptParams(attempt=3, grace_seconds=45, resume_from="", suspended=False)
    assert attempt_created_message("tj", params, "rule") == (
        f"attempt 3: Job {render.job_name('tj', 3)}, grace 45 s (rule), resume from 'scratch'"
    )
