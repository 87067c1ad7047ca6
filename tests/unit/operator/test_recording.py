"""Recording an ended attempt (recording.record_attempt_end): record, timings, checkpoint, lost
steps, preemptions, failures and the restart backoff, from the pods' terminated states."""

from __future__ import annotations

import math
from typing import Any

import pytest

from preemptible_operator import conditions as conds
from preemptible_operator import models
from preemptible_operator.classify import Interruption
from preemptible_operator.conditions import Reason
from preemptible_operator.recording import apply_metrics, record_attempt_end, rfc3339, rfc3339_ms
from preemptible_operator.scrape import RuntimeMetrics
from preemptible_operator.timestamps import parse_rfc3339
from tests.unit.operator.builders import make_pod, make_spec, make_storage_snapshot
from trainer_runtime import protocol

T0 = 1_780_000_000.0
T0_RFC = "2026-05-28T20:26:40Z"


def _msg(reason: str, step: int, **extra: Any) -> str:
    return protocol.TerminationMessage(reason=reason, step=step, **extra).model_dump_json()  # type: ignore[arg-type]


PREEMPTED_AT_12 = _msg(
    "preempted",
    12,
    checkpoint="/ckpt/run/checkpoint-12",
    complete=True,
    sigterm_to_exit_seconds=4.5,
)
KUEUE = Interruption("Preempted", Reason.KUEUE_PREEMPTED, "Kueue preempted it")
FAILED = Interruption("Failed", Reason.TRAINING_FAILED, "exit 1")
DONE = Interruption("Succeeded", Reason.COMPLETED, "")
RESTART_ON_1 = {"rules": [{"name": "flaky", "action": "Restart", "onExitCodes": [1]}]}
IGNORE_ON_1 = {"rules": [{"name": "data", "action": "Ignore", "onExitCodes": [1]}]}

CASES = [
    # (id, pods, interruption, spec fields, checkpoint known, expected record fields,
    #  expected status fields, event reasons in order, lost, preempted)
    (
        "preempted-checkpoint-at-the-end",
        [make_pod(phase="Failed", exit_code=75, message=PREEMPTED_AT_12)],
        KUEUE,
        {},
        None,
        {"outcome": "Preempted", "end_step": 12, "checkpoint": "/ckpt/run/checkpoint-12"},
        {"preemptions": 1, "lost_steps": 0, "failures": None, "next_attempt_after": None},
        [Reason.KUEUE_PREEMPTED],
        0,
        Reason.KUEUE_PREEMPTED,
    ),
    (
        "preempted-without-a-save-loses-steps",
        [make_pod(phase="Failed", exit_code=75, message=_msg("preempted", 15))],
        KUEUE,
        {},
        10,
        {"outcome": "Preempted", "end_step": 15, "checkpoint": "/ckpt/run/checkpoint-10"},
        {"preemptions": 1, "lost_steps": 5},
        [Reason.LOST_STEPS, Reason.KUEUE_PREEMPTED],
        5,
        Reason.KUEUE_PREEMPTED,
    ),
    (
        # No failure policy: the default verdict, counted, the first backoff (10 s).
        "failed-counted",
        [make_pod(phase="Failed", exit_code=1, message=_msg("failed", 7))],
        FAILED,
        {"maxRestarts": 3},
        None,
        {"outcome": "Failed", "failure_action": "Restart", "failure_rule": None},
        {"failures": 1, "next_attempt_after": "2026-05-28T20:26:50Z", "preemptions": None},
        [Reason.LOST_STEPS, Reason.BACKOFF, Reason.TRAINING_FAILED],
        7,
        None,
    ),
    (
        "failed-restarted-by-a-rule",
        [make_pod(phase="Failed", exit_code=1, message=_msg("failed", 7))],
        FAILED,
        {"maxRestarts": 3, "failurePolicy": RESTART_ON_1},
        None,
        {"outcome": "Failed", "failure_action": "Restart", "failure_rule": "flaky"},
        {"failures": 1, "failure_times": [T0_RFC]},
        [Reason.LOST_STEPS, Reason.BACKOFF, Reason.TRAINING_FAILED],
        7,
        None,
    ),
    (
        "failed-ignored-by-a-rule",
        [make_pod(phase="Failed", exit_code=1, message=_msg("failed", 7))],
        FAILED,
        {"maxRestarts": 3, "failurePolicy": IGNORE_ON_1},
        None,
        {"outcome": "Failed", "failure_action": "Ignore", "failure_rule": "data"},
        {"failures": None, "failure_times": None, "next_attempt_after": "2026-05-28T20:26:50Z"},
        [Reason.LOST_STEPS, Reason.FAILURE_IGNORED, Reason.TRAINING_FAILED],
        7,
        None,
    ),
    (
        # The restarts are used up: no BACKOFF Event (the state machine fails the job).
        "failed-past-max-restarts",
        [make_pod(phase="Failed", exit_code=1, message=_msg("failed", 7))],
        FAILED,
        {"maxRestarts": 0},
        None,
        {"outcome": "Failed"},
        {"failures": 1},
        [Reason.LOST_STEPS, Reason.TRAINING_FAILED],
        7,
        None,
    ),
    (
        "succeeded",
        [make_pod(phase="Succeeded", exit_code=0, message=_msg("completed", 100))],
        DONE,
        {},
        None,
        {"outcome": "Succeeded", "end_step": 100, "lost_steps": 0},
        {"lost_steps": 0, "preemptions": None, "failures": None},
        [Reason.COMPLETED],
        0,
        None,
    ),
]


@pytest.mark.parametrize(
    ("pods", "interruption", "spec_fields", "known", "record_fields", "status_fields", "events",
     "lost", "preempted"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)  # fmt: skip
def test_record_attempt_end(
    pods: list[dict[str, Any]],
    interruption: Interruption,
    spec_fields: dict[str, Any],
    known: int | None,
    record_fields: dict[str, Any],
    status_fields: dict[str, Any],
    events: list[str],
    lost: int,
    preempted: str | None,
) -> None:
    record = models.AttemptRecord(attempt=1, job_name="tj-a1", grace_seconds=30, start_step=0)
    status = models.TrainingJobStatus(attempt=1, attempts=[record])
    if known is not None:
        status.last_complete_checkpoint = models.CheckpointRef(
            step=known, path=f"/ckpt/run/checkpoint-{known}"
        )
    spec = make_spec(**spec_fields)
    end = record_attempt_end(status, record, spec, pods, interruption, None, T0_RFC, T0, 4)
    assert record.end_time == T0_RFC and record.reason == interruption.reason
    for key, value in record_fields.items():
        assert getattr(record, key) == value, key
    for key, value in status_fields.items():
        assert getattr(status, key) == value, key
    assert [e[1] for e in end.events] == events
    assert end.lost_steps == lost and record.lost_steps == lost
    assert end.preempted == preempted
    preempted_cond = conds.find_condition(status.conditions, conds.PREEMPTED)
    if preempted is None:
        assert preempted_cond is None
    else:
        assert preempted_cond is not None and preempted_cond.status == "True"
        assert preempted_cond.observed_generation == 4


def test_rank0_sigterm_and_timings() -> None:
    """Rank 0's SIGTERM-to-exit is the attempt's; every pod's counts for the maxima."""
    pods = [
        make_pod("a", index=0, phase="Failed", exit_code=75, message=PREEMPTED_AT_12),
        make_pod(
            "b",
            index=1,
            phase="Failed",
            exit_code=75,
            message=_msg("preempted", 12, sigterm_to_exit_seconds=9.0),
        ),
    ]
    record = models.AttemptRecord(attempt=1, job_name="tj-a1", grace_seconds=30)
    status = models.TrainingJobStatus(attempts=[record])
    end = record_attempt_end(status, record, make_spec(), pods, KUEUE, None, T0_RFC, T0, 1)
    assert end.sigterm_to_exit == 4.5 and record.sigterm_to_exit_seconds == 4.5
    assert status.timings is not None and status.timings.sigterm_to_exit_seconds_max == 9.0
    assert record.exit_codes == [75, 75]


def test_storage_snapshot_newer_than_the_report_wins() -> None:
    """Storage shows a newer complete checkpoint than the runtime's report: it is recorded."""
    pods = [make_pod(phase="Failed", exit_code=75, message=PREEMPTED_AT_12)]
    snapshot = make_storage_snapshot(14)
    record = models.AttemptRecord(attempt=1, job_name="tj-a1", grace_seconds=30)
    status = models.TrainingJobStatus(attempts=[record])
    record_attempt_end(status, record, make_spec(), pods, KUEUE, snapshot, T0_RFC, T0, 1)
    assert record.checkpoint == "/ckpt/run/checkpoint-14"
    assert status.last_complete_checkpoint is not None
    assert status.last_complete_checkpoint.step == 14


# --------------------------------------- lost steps of an attempt that left no termination message
def _ended(
    exit_code: int | None,
    *,
    finished: float | None,
    sigterm: float | None = None,
    message: str | None = None,
    reason: str = "Error",
) -> dict[str, Any]:
    """Rank 0's pod, its container ended at ``finished`` (whole seconds, as the kubelet writes
    it), deleted (SIGTERM) at ``sigterm`` with a 30 s grace."""
    pod = make_pod(phase="Failed", exit_code=exit_code, message=message, grace=30)
    if exit_code is None:  # a lost node: the container never reported its end
        pod["status"]["containerStatuses"] = [{"name": "trainer", "state": {"running": {}}}]
        return pod
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    terminated["reason"] = reason
    if finished is not None:
        terminated["finishedAt"] = rfc3339(finished)
    if sigterm is not None:
        pod["metadata"]["deletionTimestamp"] = rfc3339(sigterm + 30)
        pod["metadata"]["deletionGracePeriodSeconds"] = 30
    return pod


SCRAPED_AT = T0 - 100.0  # the last scrape written: step 100, at 2 steps/s
NO_MESSAGE_CASES = [
    # (id, pod, progress attempt, expected endStep, lost, estimated)
    # SIGKILLed at the 30 s grace deadline while saving: trained until SIGTERM + 3 s (kill wait)
    ("killed-at-grace", _ended(137, finished=T0 - 10, sigterm=T0 - 40), 1, 227, 127, True),
    # the OOM killer: trained until its end
    ("oom", _ended(137, finished=T0 - 20, reason="OOMKilled"), 1, 261, 161, True),
    # no SIGTERM handler (a periodic-only script): died at SIGTERM
    ("no-handler", _ended(143, finished=T0 - 50, sigterm=T0 - 50), 1, 201, 101, True),
    # a lost node: no end of its own; rank 0 stopped answering 21 s after its last scrape:
    # stopped at the middle, 10.5 s of 2 steps/s
    ("node-lost", _ended(None, finished=None), 1, 121, 21, True, SCRAPED_AT + 21.0),
    # the first unanswered scrape came after the attempt was seen ended: the end bounds it
    ("node-lost-late-scrape", _ended(None, finished=None), 1, 200, 100, True, T0 + 50.0),
    # no scrape failed before its pods were gone: the last scrape (an undercount, an estimate)
    ("node-lost-unseen", _ended(None, finished=None), 1, 100, 0, True),
    # ended before any scrape of its own (progress still shows attempt 0's): nothing known
    ("never-scraped", _ended(137, finished=T0 - 20, reason="OOMKilled"), 0, 100, 0, True),
    # a termination message: exact, whatever the scrapes say
    (
        "with-a-message",
        _ended(75, finished=T0 - 10, sigterm=T0 - 40, message=_msg("preempted", 130)),
        1,
        130,
        30,
        None,
    ),
]


@pytest.mark.parametrize(
    ("pod", "progress_attempt", "end_step", "lost", "estimated", "unreachable_since"),
    [(*c[1:], None)[:6] for c in NO_MESSAGE_CASES],
    ids=[c[0] for c in NO_MESSAGE_CASES],
)
def test_lost_steps_without_a_message_are_estimated(
    pod: dict[str, Any],
    progress_attempt: int,
    end_step: int,
    lost: int,
    estimated: bool | None,
    unreachable_since: float | None,
) -> None:
    """The last scraped step is up to a status write old when the pod ends without a message:
    the steps at the measured rate from that scrape to when training stopped are added, and the
    record says it is an estimate (issue 39, finding 5). On a lost node (no end of its own) it
    stopped between the last answered scrape and the first unanswered one."""
    record = models.AttemptRecord(
        attempt=1,
        job_name="tj-a1",
        grace_seconds=30,
        start_step=100,
        unreachable_since=rfc3339_ms(unreachable_since) if unreachable_since else None,
    )
    status = models.TrainingJobStatus(
        attempt=1,
        attempts=[record],
        progress=models.Progress(
            step=100,
            attempt=progress_attempt,
            scraped_at=rfc3339_ms(SCRAPED_AT),
            steps_per_second=2.0,
            max_steps=1000,
        ),
        last_complete_checkpoint=models.CheckpointRef(step=100, path="/ckpt/run/checkpoint-100"),
    )
    end = record_attempt_end(status, record, make_spec(), [pod], KUEUE, None, T0_RFC, T0, 1)
    assert (record.end_step, record.lost_steps, end.lost_steps) == (end_step, lost, lost)
    assert record.lost_steps_estimated is estimated
    assert status.lost_steps_estimated is estimated
    assert status.lost_steps == lost
    if progress_attempt == 1:
        assert (record.last_scraped_step, record.steps_per_second) == (100, 2.0)
        assert record.last_scraped_time == rfc3339_ms(SCRAPED_AT)
    # progress shows what the runtime reported, never the estimate
    assert status.progress is not None
    assert status.progress.step == (100 if estimated else end_step)
    if lost and estimated:
        assert "estimated" in next(e[2] for e in end.events if e[1] == Reason.LOST_STEPS)


def _scrape(step: int, at: float, ema: float | None = None) -> RuntimeMetrics:
    values = {"step": float(step)} | ({"step_seconds_ema": ema} if ema else {})
    return RuntimeMetrics(values, scraped_at=at)


def test_scrapes_record_the_step_its_time_and_the_attempts_rate() -> None:
    spec = make_spec()
    status = models.TrainingJobStatus(progress=models.Progress(step=80, attempt=1))
    # attempt 2's first scrape: its rate is the runtime's step time until a second scrape
    apply_metrics(status, _scrape(10, T0, ema=0.25), spec, attempt=2)
    progress = status.progress
    assert progress is not None
    assert (progress.step, progress.attempt, progress.steps_per_second) == (10, 2, 4.0)
    assert progress.scraped_at == rfc3339_ms(T0) and parse_rfc3339(progress.scraped_at) == T0
    apply_metrics(status, _scrape(30, T0 + 10.0), spec, attempt=2)
    weight = 1 - math.exp(-10 / 60)
    assert progress.steps_per_second == pytest.approx(weight * 2.0 + (1 - weight) * 4.0, abs=1e-4)
    # a scrape without a time (none measured) keeps the attempt's rate and time
    apply_metrics(status, RuntimeMetrics({"step": 31.0}), spec, attempt=2)
    assert progress.step == 31 and progress.scraped_at == rfc3339_ms(T0 + 10.0)
    # the next attempt starts its own rate
    apply_metrics(status, RuntimeMetrics({"step": 5.0}), spec, attempt=3)
    assert (progress.scraped_at, progress.steps_per_second) == (None, None)


def test_an_unanswered_scrape_marks_when_rank0_became_unreachable() -> None:
    """The first unanswered scrape after an answered one of the same attempt is kept on its
    record (the upper bound of a lost node's training); an answer clears it (issue 39)."""
    spec = make_spec()
    record = models.AttemptRecord(attempt=2, job_name="tj-a2")
    earlier = models.AttemptRecord(attempt=1, job_name="tj-a1", end_time=T0_RFC)
    status = models.TrainingJobStatus(
        attempts=[earlier, record], progress=models.Progress(step=80, attempt=1, scraped_at=T0_RFC)
    )
    # not answered before this attempt's own first answer (loading, or the step is attempt
    # 1's): nothing to bound
    apply_metrics(status, RuntimeMetrics.unanswered(T0 + 1.0), spec, attempt=2)
    assert record.unreachable_since is None and earlier.unreachable_since is None
    apply_metrics(status, _scrape(90, T0 + 2.0), spec, attempt=2)
    apply_metrics(status, RuntimeMetrics.unanswered(T0 + 3.25), spec, attempt=2)
    assert record.unreachable_since == rfc3339_ms(T0 + 3.25)
    # the progress is left as the last answer had it
    assert status.progress is not None and status.progress.step == 90
    assert status.progress.scraped_at == rfc3339_ms(T0 + 2.0)
    apply_metrics(status, RuntimeMetrics.unanswered(T0 + 4.5), spec, attempt=2)
    assert record.unreachable_since == rfc3339_ms(T0 + 3.25)  # the first failure is the bound
    apply_metrics(status, _scrape(95, T0 + 5.0), spec, attempt=2)
    assert record.unreachable_since is None  # answered again: a passing hiccup
    # an ended attempt's record is never changed
    earlier.unreachable_since = None
    apply_metrics(status, RuntimeMetrics.unanswered(T0 + 6.0), spec, attempt=1)
    assert earlier.unreachable_since is None


@pytest.mark.parametrize(
    ("ts", "text"),
    [(T0, "2026-05-28T20:26:40.000Z"), (T0 + 0.1234, "2026-05-28T20:26:40.123Z")],
)
def test_rfc3339_ms(ts: float, text: str) -> None:
    assert rfc3339_ms(ts) == text
    assert parse_rfc3339(text) == pytest.approx(ts, abs=1e-3)


def _pending_then_deleted() -> dict[str, Any]:
    """A pod deleted before its container started (Kueue evicted the workload while pending)."""
    pod = make_pod(phase="Failed", exit_code=137, grace=30)
    pod["status"]["containerStatuses"][0]["state"]["terminated"]["reason"] = (
        "ContainerStatusUnknown"
    )
    return pod


def _started_then_deleted() -> dict[str, Any]:
    pod = make_pod(phase="Failed", exit_code=137, grace=30)
    pod["status"]["containerStatuses"][0]["state"]["terminated"]["startedAt"] = T0_RFC
    return pod


@pytest.mark.parametrize(
    ("pods", "running_time", "before_running"),
    [
        ([_pending_then_deleted()], None, 1),
        ([], None, 1),  # no pod at all: the Job never got to create them
        ([_started_then_deleted()], None, None),
        ([_pending_then_deleted()], T0_RFC, None),  # the operator saw it run
        ([make_pod(phase="Failed", exit_code=75, message=PREEMPTED_AT_12)], None, None),
    ],
)
def test_preemptions_of_attempts_that_never_ran_are_counted_apart(
    pods: list[dict[str, Any]], running_time: str | None, before_running: int | None
) -> None:
    record = models.AttemptRecord(
        attempt=1, job_name="tj-a1", grace_seconds=30, start_step=0, running_time=running_time
    )
    status = models.TrainingJobStatus(attempt=1, attempts=[record])
    record_attempt_end(status, record, make_spec(), pods, KUEUE, None, T0_RFC, T0, 1)
    assert status.preemptions == 1  # every preemption is shown
    assert status.preemptions_before_running == before_running
