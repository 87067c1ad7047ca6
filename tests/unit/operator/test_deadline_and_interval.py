"""DeadlineTooShort classification, the grace rule per stop policy and node notice, and the
checkpoint interval recommendation (operator side, pure functions, as tables)."""

from __future__ import annotations

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
    recommend_interval,
    running_seconds,
)
from preemptible_operator.reconcile import _apply_metrics
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
    _apply_metrics(status, scraped, _spec())
    assert status.timings is not None and status.timings.micro_batch_seconds_max == 7.5
