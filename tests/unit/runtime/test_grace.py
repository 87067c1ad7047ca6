"""The grace rule: ceil(kill_wait + (1 + headroom) * (step_max + save_max)) + exit_margin."""

from __future__ import annotations

import pytest

from trainer_runtime.errors import ConfigurationError
from trainer_runtime.grace import GracePolicy, grace_seconds, recommend_grace


@pytest.mark.parametrize(
    ("step_max", "save_max", "kwargs", "expected"),
    [
        (120, 120, {}, 243),  # the reference docs' example
        (120.0, 120.0, {"kill_wait": 3.0}, 243),
        (0, 0, {}, 3),
        (0.1, 0.2, {}, 4),  # 3.3 rounds up
        (120, 120, {"headroom": 0.1}, 267),  # 3 + 264.00000000000003 must not become 268
        (120, 120, {"headroom": 0.25}, 303),
        (120, 120, {"exit_margin": 5}, 248),
        (120, 120, {"kill_wait": 0}, 240),
        (120, 120, {"maximum": 200}, 200),
        (1, 1, {"minimum": 30}, 30),
        (1, 1, {"minimum": 30, "maximum": 60}, 30),
        (100, 100, {"minimum": 30, "maximum": 60}, 60),
        (59.5, 0.4, {"kill_wait": 0}, 60),
        (10, 20, {"headroom": 1.0, "exit_margin": 2, "kill_wait": 1}, 63),
    ],
)
def test_grace_seconds_table(step_max: float, save_max: float, kwargs: dict, expected: int) -> None:
    assert grace_seconds(step_max, save_max, **kwargs) == expected


@pytest.mark.parametrize(
    ("args", "kwargs", "field"),
    [
        ((-1, 1), {}, "step_max"),
        ((1, float("nan")), {}, "save_max"),
        ((1, 1), {"headroom": -0.1}, "headroom"),
        ((1, 1), {"minimum": 10, "maximum": 5}, "minimum"),
        (("1", 1), {}, "step_max"),
    ],
)
def test_grace_seconds_rejects_bad_input(args: tuple, kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigurationError, match=field):
        grace_seconds(*args, **kwargs)


P0 = GracePolicy(
    initial_seconds=300, minimum=30, maximum=3600, headroom=0.0, kill_wait=3.0, exit_margin=0
)


@pytest.mark.parametrize(
    ("step_max", "save_max", "observed", "policy", "seconds", "reason_part"),
    [
        (None, None, None, P0, 300, "no measurements"),
        (None, None, [], P0, 300, "no measurements"),
        (None, None, None, GracePolicy(initial_seconds=20, minimum=30), 30, "no measurements"),
        (
            None,
            None,
            None,
            GracePolicy(initial_seconds=9000, maximum=3600),
            3600,
            "no measurements",
        ),
        (120, 120, None, P0, 243, "grace rule"),
        (120, 120, None, GracePolicy(headroom=0.25, exit_margin=5), 308, "grace rule"),
        (1, 1, None, P0, 30, "minimum"),
        (2000, 2000, None, P0, 3600, "capped at maximum"),
        # a step measured but no save yet: the save is unknown, keep at least initial_seconds
        (5, None, None, P0, 300, "save time not measured"),
        (500, None, None, P0, 503, "save time not measured"),
        # observed SIGTERM-to-exit is ground truth: never below ceil(observed*(1+h)) + margin
        (10, 10, 100.2, P0, 101, "observed"),
        (10, 10, [40.0, 100.2, 7.0], P0, 101, "observed"),
        (10, 10, 100.2, GracePolicy(headroom=0.5, exit_margin=4, minimum=1), 155, "observed"),
        (120, 120, 50, P0, 243, "grace rule"),  # observed below the rule: rule wins
        (None, None, 100.2, P0, 101, "observed"),  # only exit times measured
        (None, None, 10, P0, 30, "minimum"),
    ],
)
def test_recommend_grace_table(
    step_max: float | None,
    save_max: float | None,
    observed: float | list[float] | None,
    policy: GracePolicy,
    seconds: int,
    reason_part: str,
) -> None:
    rec = recommend_grace(step_max, save_max, observed, policy)
    assert rec.seconds == seconds
    assert reason_part in rec.reason
    assert rec.inputs["step_max"] == step_max and rec.inputs["save_max"] == save_max
    assert rec.inputs["headroom"] == policy.headroom


def test_recommendation_reports_when_maximum_caps_the_need() -> None:
    rec = recommend_grace(10, 10, 5000, GracePolicy(maximum=600))
    assert rec.seconds == 600 and rec.required_seconds is not None and rec.required_seconds > 600
    assert rec.capped and rec.to_dict()["capped"] is True
    ok = recommend_grace(10, 10, None, GracePolicy())
    assert not ok.capped


def test_observed_floor_holds_for_many_values() -> None:
    policy = GracePolicy(minimum=1, maximum=100000, headroom=0.2, exit_margin=3)
    for observed in [0.5, 1.0, 9.99, 33.3, 121.0, 600.01]:
        for step, save in [(0.1, 0.1), (1, 2), (50, 60)]:
            rec = recommend_grace(step, save, observed, policy)
            assert rec.seconds >= observed * 1.2 + 3
            assert rec.seconds >= grace_seconds(step, save, headroom=0.2, exit_margin=3)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"minimum": 100, "maximum": 10}, "minimum"),
        ({"headroom": -1}, "headroom"),
        ({"initial_seconds": float("inf")}, "initial_seconds"),
    ],
)
def test_policy_validation(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigurationError, match=field):
        GracePolicy(**kwargs)


def test_policy_defaults_are_documented_values() -> None:
    p = GracePolicy()
    assert (p.initial_seconds, p.minimum, p.maximum, p.headroom, p.kill_wait, p.exit_margin) == (
        300,
        30,
        3600,
        0.25,
        3.0,
        5,
    )
