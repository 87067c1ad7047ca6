"""The operator's grace decisions on top of the shared rule (trainer_runtime.grace)."""

from __future__ import annotations

from typing import Any

import pytest

from preemptible_operator import conditions as conds
from preemptible_operator import models
from preemptible_operator.conditions import Reason
from preemptible_operator.grace import grace_status, grace_sufficiency, next_grace, policy_from_spec
from preemptible_operator.models import GracePeriodSpec, Timings
from tests.unit.operator.builders import make_spec

AUTO = GracePeriodSpec(initialSeconds=60, min=10, max=600, headroom=0.0, exitMargin=0)


@pytest.mark.parametrize(
    ("spec", "timings", "killed", "seconds", "required"),
    [
        # nothing measured: initialSeconds, no requirement known
        (AUTO, None, None, 60, None),
        # the reference example: 120 s step + 120 s save need 243 s
        (AUTO, {"stepSecondsMax": 120, "saveSecondsMax": 120}, None, 243, 243),
        # small measurements are raised to min
        (AUTO, {"stepSecondsMax": 1, "saveSecondsMax": 1}, None, 10, 5),
        # large ones are capped at max, the requirement stays visible
        (AUTO, {"stepSecondsMax": 500, "saveSecondsMax": 500}, None, 600, 1003),
        # an observed SIGTERM-to-exit time is ground truth
        (
            AUTO,
            {"stepSecondsMax": 1, "saveSecondsMax": 1, "sigtermToExitSecondsMax": 40},
            None,
            40,
            40,
        ),
        # SIGKILLed at 20 s: the next attempt gets at least double
        (AUTO, {"stepSecondsMax": 1, "saveSecondsMax": 1}, 20, 40, 40),
        # doubling is bounded by max
        (AUTO, None, 400, 600, 600),
        # pinned seconds win, the requirement is still reported
        (
            GracePeriodSpec(seconds=15, headroom=0.0, exitMargin=0),
            {"stepSecondsMax": 120, "saveSecondsMax": 120},
            None,
            15,
            243,
        ),
    ],
)
def test_next_grace(
    spec: GracePeriodSpec,
    timings: dict[str, Any] | None,
    killed: int | None,
    seconds: int,
    required: int | None,
) -> None:
    decision = next_grace(spec, Timings.model_validate(timings) if timings else None, killed)
    assert (decision.seconds, decision.required) == (seconds, required), decision.reason


def test_inputs_are_reported() -> None:
    d = next_grace(AUTO, Timings(stepSecondsMax=2.0, saveSecondsMax=3.0))
    assert d.inputs["stepMax"] == 2.0 and d.inputs["saveMax"] == 3.0
    assert "grace rule" in d.reason


@pytest.mark.parametrize(
    ("current", "timings", "ok", "words"),
    [
        (None, None, True, "no attempt"),
        (60, None, True, "nothing measured"),
        (300, {"stepSecondsMax": 120, "saveSecondsMax": 120}, True, "covers"),
        (
            200,
            {"stepSecondsMax": 120, "saveSecondsMax": 120},
            False,
            "below the measured need of 243",
        ),
    ],
)
def test_grace_sufficiency(
    current: int | None, timings: dict[str, Any] | None, ok: bool, words: str
) -> None:
    decision = next_grace(AUTO, Timings.model_validate(timings) if timings else None)
    got_ok, message = grace_sufficiency(current, decision)
    assert got_ok is ok and words in message


def test_policy_from_spec_maps_every_field() -> None:
    policy = policy_from_spec(
        GracePeriodSpec(
            initialSeconds=7, min=2, max=9, headroom=0.5, killWaitSeconds=1.5, exitMargin=4
        )
    )
    assert (
        policy.initial_seconds,
        policy.minimum,
        policy.maximum,
        policy.headroom,
        policy.kill_wait,
        policy.exit_margin,
    ) == (7, 2, 9, 0.5, 1.5, 4)


T0_RFC = "2026-05-28T20:26:40Z"


def _record(**fields: Any) -> models.AttemptRecord:
    return models.AttemptRecord(**{"attempt": 1, "job_name": "tj-a1", **fields})


GRACE = [
    # (id, attempts, timings, current grace, cap, status, reason, recommended, event)
    ("no-attempt", [], None, None, None, "True", Reason.NOT_MEASURED, 300, False),
    (
        "running-covered",
        [_record(grace_seconds=120)],
        models.Timings(step_seconds_max=2.0, save_seconds_max=5.0),
        120,
        None,
        "True",
        Reason.GRACE_SUFFICIENT,
        None,
        False,
    ),
    (
        "running-short",
        [_record(grace_seconds=5)],
        models.Timings(step_seconds_max=20.0, save_seconds_max=50.0),
        5,
        None,
        "False",
        Reason.GRACE_TOO_SHORT,
        None,
        True,
    ),
    (
        "killed-at-grace",
        [_record(grace_seconds=30, killed=True, end_time=T0_RFC)],
        None,
        30,
        None,
        "False",
        Reason.GRACE_KILLED,
        60,
        True,
    ),
    (
        "killed-capped",
        [_record(grace_seconds=30, killed=True, end_time=T0_RFC)],
        None,
        30,
        40,
        "False",
        Reason.GRACE_KILLED,
        40,
        True,
    ),
    (
        "deadline-too-short",
        [_record(end_time=T0_RFC, reason=Reason.DEADLINE_TOO_SHORT, message="10 s left")],
        None,
        30,
        None,
        "False",
        Reason.DEADLINE_TOO_SHORT,
        None,
        True,
    ),
]


@pytest.mark.parametrize(
    ("attempts", "timings", "current", "cap", "ok", "reason", "recommended", "event"),
    [c[1:] for c in GRACE],
    ids=[c[0] for c in GRACE],
)
def test_grace_status(
    attempts: list[models.AttemptRecord],
    timings: models.Timings | None,
    current: int | None,
    cap: int | None,
    ok: str,
    reason: str,
    recommended: int | None,
    event: bool,
) -> None:
    status = models.TrainingJobStatus(
        attempts=attempts or None,
        timings=timings,
        grace_period=models.GraceStatus(current=current),
    )
    before = status.model_copy(deep=True)
    got = grace_status(status, make_spec(), cap, T0_RFC, 1)
    assert status == before  # pure: the status passed in is not changed
    found = conds.find_condition(got.conditions, conds.GRACE_PERIOD_SUFFICIENT)
    assert found is not None and (found.status, found.reason) == (ok, reason)
    assert got.grace_period.current == current
    assert got.grace_period.recommended == got.recommended
    if recommended is not None:
        assert got.recommended == recommended
    assert (got.event is not None and got.event[:2] == ("Warning", reason)) is event
    # The same outcome again: no second Event.
    status.conditions = got.conditions
    assert grace_status(status, make_spec(), cap, T0_RFC, 1).event is None
