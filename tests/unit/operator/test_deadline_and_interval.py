"""DeadlineTooShort classification, the grace rule per stop policy and node notice, and the
checkpoint interval recommendation (operator side, pure functions, as tables)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from prometheus_client import generate_latest

from preemptible_operator import models
from preemptible_operator.classify import classify_interruption
from preemptible_operator.conditions import PREEMPTION_REASONS, Reason
from preemptible_operator.grace import next_grace
from preemptible_operator.interval import (
    auto_save_interval,
    interval_status,
    preemption_window,
    recommend_interval,
    running_seconds,
)
from preemptible_operator.phases import bound_attempts
from preemptible_operator.recording import apply_metrics as _apply_metrics
from preemptible_operator.render import AttemptParams, render_job
from preemptible_operator.scrape import parse_metrics
from tests.unit.operator.builders import cond, make_job, make_pod
from trainer_runtime import protocol
from trainer_runtime.metrics import TrainingMetrics

TOO_SHORT_MSG = protocol.TerminationMessage(
    reason="deadline_too_short",
    step=17,
    message="deadline too short: the longest save took 40.00 s but 12.00 s remained",
).model_dump_json()
PREEMPTED_MSG = protocol.TerminationMessage(
    reason="preempted", step=12, checkpoint="/c/checkpoint-12", complete=True
).model_dump_json()


def _pod(msg: str, **kw: Any) -> dict[str, Any]:
    return make_pod(phase="Failed", exit_code=protocol.EXIT_PREEMPTED, message=msg, **kw)


@pytest.mark.parametrize(
    ("pods", "workload", "kwargs", "reason"),
    [
        ([_pod(TOO_SHORT_MSG)], None, {}, Reason.DEADLINE_TOO_SHORT),
        # a node shutdown (spot reclaim) whose notice the save did not fit
        (
            [_pod(TOO_SHORT_MSG, conditions=[cond("DisruptionTarget", "TerminationByKubelet")])],
            None,
            {},
            Reason.DEADLINE_TOO_SHORT,
        ),
        # two ranks: one saw the deadline miss
        (
            [_pod(PREEMPTED_MSG, name="a", index=0), _pod(TOO_SHORT_MSG, name="b", index=1)],
            None,
            {},
            Reason.DEADLINE_TOO_SHORT,
        ),
        # Kueue's eviction keeps precedence: its Workload must be deactivated
        (
            [_pod(TOO_SHORT_MSG)],
            {"metadata": {"name": "wl"}, "status": {"conditions": [cond("Evicted", "Preempted")]}},
            {},
            Reason.KUEUE_PREEMPTED,
        ),
        # a normal JIT stop stays RuntimePreempted
        ([_pod(PREEMPTED_MSG)], None, {}, Reason.RUNTIME_PREEMPTED),
    ],
)
def test_deadline_too_short_is_a_preemption(
    pods: list[dict[str, Any]], workload: dict[str, Any] | None, kwargs: dict, reason: str
) -> None:
    got = classify_interruption(make_job(completions=len(pods)), pods, workload, **kwargs)
    assert (got.outcome, got.reason) == ("Preempted", reason), got
    if reason == Reason.DEADLINE_TOO_SHORT:
        assert "deadline too short" in got.message
    assert reason in PREEMPTION_REASONS


AUTO = {"initialSeconds": 60, "min": 10, "max": 600, "headroom": 0.0, "exitMargin": 0}


@pytest.mark.parametrize(
    ("grace", "timings", "killed", "seconds"),
    [
        # finish_step: the reference 243 s, micro-batches measured or not
        ({}, {"stepSecondsMax": 120, "saveSecondsMax": 120}, None, 243),
        ({}, {"stepSecondsMax": 120, "saveSecondsMax": 120, "microBatchSecondsMax": 8}, None, 243),
        # micro_batch: kill_wait + longest micro-batch + save
        (
            {"stopPolicy": "micro_batch"},
            {"stepSecondsMax": 120, "saveSecondsMax": 120, "microBatchSecondsMax": 8},
            None,
            131,
        ),
        # SIGKILLed at 20 s: doubled to 40 ...
        ({}, {"stepSecondsMax": 1, "saveSecondsMax": 1}, 20, 40),
        # ... but never past the node's 30 s notice
        ({"nodeNoticeSeconds": 30}, {"stepSecondsMax": 1, "saveSecondsMax": 1}, 20, 30),
        # killed at the notice already: no raise at all
        ({"nodeNoticeSeconds": 30}, {"stepSecondsMax": 1, "saveSecondsMax": 1}, 30, 30),
    ],
)
def test_next_grace_per_policy_and_notice(
    grace: dict, timings: dict, killed: int | None, seconds: int
) -> None:
    spec = models.GracePeriodSpec.model_validate({**AUTO, **grace})
    decision = next_grace(spec, models.Timings.model_validate(timings), killed)
    assert decision.seconds == seconds, decision.reason


@pytest.mark.parametrize(
    ("save", "running", "preemptions", "seconds"),
    [
        (None, 3600.0, 2, None),  # no save measured
        (10.0, 3600.0, 0, None),  # no preemption
        (10.0, 0.0, 1, None),  # never ran
        # 10 s saves, a preemption every hour: sqrt(2 * 10 * 3600) = 268.3 -> 269 s
        (10.0, 7200.0, 2, 269),
        # 120 s saves, a preemption every 4 h: sqrt(2 * 120 * 14400) = 1859.03 -> 1860 s
        (120.0, 4 * 14400.0, 4, 1860),
        # tiny saves and frequent preemptions: at least 30 s
        (0.05, 600.0, 6, 30),
    ],
)
def test_recommend_interval(
    save: float | None, running: float, preemptions: int, seconds: int | None
) -> None:
    rec = recommend_interval(save, running, preemptions)
    assert rec.seconds == seconds, rec.reason


def test_running_seconds_counts_started_attempts_only() -> None:
    assert running_seconds([(0.0, 100.0), (None, 200.0), (150.0, None)], now=170.0) == 120.0


def _status(
    preemptions: int, save: float | None, old: int | None = None
) -> models.TrainingJobStatus:
    attempts = [
        models.AttemptRecord(
            attempt=n,
            job_name=f"tj-a{n}",
            running_time=f"2026-01-01T0{n}:00:00Z",
            end_time=f"2026-01-01T0{n}:30:00Z",
            outcome="Preempted",
        )
        for n in range(1, preemptions + 1)
    ]
    return models.TrainingJobStatus(
        attempts=attempts,
        preemptions=preemptions,
        timings=models.Timings(save_seconds_last=save),
        checkpoint_interval=None
        if old is None
        else models.CheckpointIntervalStatus(recommended_seconds=old),
    )


def _spec(interval: str | None = None) -> models.TrainingJobSpec:
    return models.TrainingJobSpec.model_validate(
        {"image": "i", "checkpoint": {"uri": "/c", **({"interval": interval} if interval else {})}}
    )


def test_interval_status_event_and_auto() -> None:
    # three preemptions, each after 30 min of running, 5 s saves: sqrt(2 * 5 * 1800) = 134.2
    status = _status(3, 5.0)
    new, event = interval_status(status, _spec("auto"), now=0.0)
    assert new.recommended_seconds == 135 and new.applied is True
    assert new.mean_time_between_preemptions_seconds == 1800.0
    assert event is not None and "135 s" in event
    status.checkpoint_interval = new
    assert auto_save_interval(_spec("auto"), status) == 135
    assert auto_save_interval(_spec(), status) is None
    # a drift under 10 %: the announced value stays, no event
    again, event = interval_status(_status(3, 5.5, old=135), _spec(), now=0.0)
    assert again.recommended_seconds == 135 and event is None
    # nothing to recommend before a preemption
    none, event = interval_status(_status(0, 5.0), _spec(), now=0.0)
    assert none.recommended_seconds is None and event is None


def _history(
    hourly_preemptions: int, *, running: bool = False, others: tuple[str | None, ...] = ()
) -> models.TrainingJobStatus:
    """A job preempted after every hour of running ``hourly_preemptions`` times, then attempts
    of the ``others`` outcomes (each ran an hour; None: still running), then a running attempt
    when ``running``; only the newest records kept, as the reconciler keeps them, and the
    counters over every attempt."""
    outcomes: list[str | None] = ["Preempted"] * hourly_preemptions + list(others)
    if running:
        outcomes.append(None)
    attempts = []
    for n, outcome in enumerate(outcomes, start=1):
        start = n * 7200.0  # an hour queued, an hour running
        attempts.append(
            models.AttemptRecord(
                attempt=n,
                job_name=f"tj-a{n}",
                start_time=_ts(start - 3600),
                running_time=_ts(start),
                end_time=_ts(start + 3600) if outcome else None,
                outcome=outcome,  # type: ignore[arg-type]
            )
        )
    kept, dropped = bound_attempts(attempts)
    return models.TrainingJobStatus(
        attempts=kept,
        attempts_omitted=dropped or None,
        preemptions=outcomes.count("Preempted"),
        timings=models.Timings(save_seconds_last=120.0),
    )


def _ts(seconds: float) -> str:
    return dt.datetime.fromtimestamp(1_700_000_000 + seconds, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.mark.parametrize(
    ("status", "window", "seconds"),
    [
        # 120 s saves, a preemption every hour of running: sqrt(2 * 120 * 3600) = 929.5 -> 930 s,
        # however many preemptions the records no longer hold (20 kept; the old rate divided
        # their 20 h by all preemptions: 294 s after 200, 132 s after 1,000)
        (_history(3), (3 * 3600.0, 3), 930),
        (_history(20), (20 * 3600.0, 20), 930),
        (_history(200), (20 * 3600.0, 20), 930),
        (_history(1000), (20 * 3600.0, 20), 930),
        # the running attempt is not in the window yet (19 ended records)
        (_history(200, running=True), (19 * 3600.0, 19), 930),
        # an hour that ended without a preemption (a suspension) counts as running time:
        # 20 h / 19 preemptions in the window -> sqrt(2 * 120 * 3789.5) = 953.7 -> 954 s
        (_history(200, others=("Suspended",)), (20 * 3600.0, 19), 954),
        # a preemption of an attempt that never ran interrupted nothing: not counted
        (_history(0), (0.0, 0), None),
    ],
)
def test_interval_rate_counts_running_time_and_preemptions_over_the_same_attempts(
    status: models.TrainingJobStatus, window: tuple[float, int], seconds: int | None
) -> None:
    """Issue 30: status.preemptions covers every attempt, the kept records only the newest 20;
    the rate must come from one window, or the recommendation shrinks with every preemption."""
    assert preemption_window(status.attempts or [], now=1e12) == window
    new, _ = interval_status(status, _spec("auto"), now=1e12)
    assert new.recommended_seconds == seconds, new.reason
    assert (new.running_seconds, new.preemptions) == window


def test_a_preemption_while_queued_counts_no_running_time_and_no_preemption() -> None:
    status = _history(3)
    queued = models.AttemptRecord(
        attempt=4, job_name="tj-a4", start_time=_ts(0), end_time=_ts(600), outcome="Preempted"
    )
    status.attempts = [*(status.attempts or []), queued]
    status.preemptions = 4
    assert preemption_window(status.attempts, now=1e12) == (3 * 3600.0, 3)


def _env(spec: models.TrainingJobSpec, params: AttemptParams) -> dict[str, Any]:
    meta = {"name": "tj", "namespace": "ns", "uid": "u"}
    pod = render_job(meta, spec, params)["spec"]["template"]["spec"]
    container = next(c for c in pod["containers"] if c["name"] == "trainer")
    return {e["name"]: e.get("value") for e in container["env"]}


def test_render_passes_policy_notice_and_interval_only_when_set() -> None:
    params = AttemptParams(attempt=1, grace_seconds=60, resume_from="", suspended=False)
    plain = _env(_spec(), params)
    for name in (
        protocol.ENV_STOP_POLICY,
        protocol.ENV_NODE_NOTICE_SECONDS,
        protocol.ENV_SAVE_INTERVAL_SECONDS,
    ):
        assert name not in plain
    spec = models.TrainingJobSpec.model_validate(
        {
            "image": "i",
            "checkpoint": {"uri": "/c", "interval": "auto"},
            "gracePeriod": {"stopPolicy": "micro_batch", "nodeNoticeSeconds": 30},
        }
    )
    params = AttemptParams(
        attempt=2,
        grace_seconds=60,
        resume_from="latest",
        suspended=False,
        save_interval_seconds=135,
    )
    env = _env(spec, params)
    assert env[protocol.ENV_STOP_POLICY] == "micro_batch"
    assert env[protocol.ENV_NODE_NOTICE_SECONDS] == "30"
    assert env[protocol.ENV_SAVE_INTERVAL_SECONDS] == "135"


@pytest.mark.parametrize(
    ("grace", "field"),
    [
        ({"stopPolicy": "whole_epoch"}, "stopPolicy"),
        ({"nodeNoticeSeconds": 0}, "nodeNoticeSeconds"),
    ],
)
def test_bad_deadline_settings_are_refused(grace: dict, field: str) -> None:
    with pytest.raises(models.ValidationError) as err:
        models.GracePeriodSpec.model_validate(grace)
    assert field in models.format_validation_error(err.value, "spec.gracePeriod")


def test_micro_batch_timings_flow_from_metrics_to_status() -> None:

    runtime = TrainingMetrics()
    runtime.update(micro_batch_seconds=protocol.StepTimings(max=7.5, count=3))
    scraped = parse_metrics(generate_latest(runtime.registry).decode())
    status = models.TrainingJobStatus()
    _apply_metrics(status, scraped, _spec(), attempt=1)
    assert status.timings is not None and status.timings.micro_batch_seconds_max == 7.5
