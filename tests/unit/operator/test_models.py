"""Spec validation: defaults, structural errors, and the semantic errors behind InvalidSpec."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from preemptible_operator import models
from tests.unit.operator.builders import make_spec


def test_defaults_come_from_the_shared_grace_policy() -> None:
    from trainer_runtime.grace import GracePolicy

    spec = make_spec()
    gp = spec.grace_period
    policy = GracePolicy()
    assert (gp.initial_seconds, gp.min, gp.max, gp.headroom, gp.kill_wait_seconds) == (
        policy.initial_seconds,
        policy.minimum,
        policy.maximum,
        policy.headroom,
        policy.kill_wait,
    )
    assert spec.num_nodes == 1 and spec.max_restarts == 3 and spec.suspend is False


def test_camel_case_round_trip() -> None:
    spec = make_spec(numNodes=2, gracePeriod={"seconds": 60}, queueName="team-a")
    dumped = spec.to_k8s()
    assert dumped["numNodes"] == 2
    assert dumped["gracePeriod"]["seconds"] == 60
    assert dumped["queueName"] == "team-a"
    assert models.TrainingJobSpec.model_validate(dumped) == spec


@pytest.mark.parametrize(
    ("overrides", "field_path", "words"),
    [
        ({"numNodes": 0}, "spec.numNodes", "greater than or equal to 1 (got 0)"),
        (
            {"gracePeriod": {"min": 100, "max": 50}},
            "spec.gracePeriod.min",
            "min (100) must not exceed",
        ),
        ({"gracePeriod": {"min": 0}}, "spec.gracePeriod.min", "min (0) must be between 1 and"),
        (
            {"gracePeriod": {"headroom": -0.5}},
            "spec.gracePeriod.headroom",
            "headroom must be between 0 and 10",
        ),
        ({"queueName": "Team A!"}, "spec.queueName", '"Team A!" is not a valid Kubernetes label'),
        ({"priorityClass": "x" * 64}, "spec.priorityClass", "at most 63"),
        ({"maxRestarts": -1}, "spec.maxRestarts", "greater than or equal to 0"),
        ({"metricsPort": 70000}, "spec.metricsPort", "less than or equal to 65535"),
        (
            {"env": [{"name": "PREEMPTIBLE_RESUME_FROM", "value": "x"}]},
            "spec.env.0.name",
            "PREEMPTIBLE_RESUME_FROM is set by the operator",
        ),
        ({"checkpoint": {"uri": ""}}, "spec.checkpoint.uri", "at least 1"),
        (
            {"activeDeadlineSeconds": 0},
            "spec.activeDeadlineSeconds",
            "greater than or equal to 1",
        ),
        ({"maxPreemptions": -1}, "spec.maxPreemptions", "greater than or equal to 0"),
        (
            {"ttlSecondsAfterFinished": -1},
            "spec.ttlSecondsAfterFinished",
            "greater than or equal to 0",
        ),
    ],
)
def test_semantic_errors_name_the_field(
    overrides: dict[str, Any], field_path: str, words: str
) -> None:
    raw: dict[str, Any] = {"image": "img", "checkpoint": {"uri": "/c"}, **overrides}
    with pytest.raises(ValidationError) as info:
        models.parse_spec(raw)
    message = models.format_validation_error(info.value)
    assert message.startswith(field_path), message
    assert words in message, message


def test_missing_required_fields_are_reported() -> None:
    with pytest.raises(ValidationError) as info:
        models.parse_spec({})
    message = models.format_validation_error(info.value)
    assert "spec.image" in message and "spec.checkpoint" in message


def test_status_ignores_unknown_fields_and_dumps_camel_case() -> None:
    status = models.TrainingJobStatus.model_validate(
        {
            "phase": "Running",
            "lastCompleteCheckpoint": {"step": 5, "path": "/c/checkpoint-5"},
            "somethingOld": 1,
        }
    )
    assert status.last_complete_checkpoint is not None
    assert status.to_k8s() == {
        "phase": "Running",
        "lastCompleteCheckpoint": {"step": 5, "path": "/c/checkpoint-5"},
    }


_GRACE = models.MAX_GRACE_SECONDS


@pytest.mark.parametrize(
    ("grace", "field", "words"),
    [
        ({"seconds": 0}, "seconds", "gracePeriod.seconds (0) must be between 1 and 7200"),
        ({"seconds": _GRACE + 1}, "seconds", "(7201) must be between 1 and 7200"),
        ({"initialSeconds": 10**6}, "initialSeconds", "initialSeconds (1000000) must be between"),
        ({"min": 7300, "max": 7300}, "min", "gracePeriod.min (7300) must be between 1 and 7200"),
        ({"max": 10**9}, "max", "gracePeriod.max (1000000000) must be between 1 and 7200"),
        ({"headroom": 11.0}, "headroom", "gracePeriod.headroom must be between 0 and 10"),
        ({"killWaitSeconds": -1}, "killWaitSeconds", "killWaitSeconds must be between 0 and 300"),
        ({"killWaitSeconds": 300.5}, "killWaitSeconds", "between 0 and 300"),
        ({"exitMargin": -1}, "exitMargin", "gracePeriod.exitMargin (-1) must be between 0 and 600"),
        ({"nodeNoticeSeconds": 0}, "nodeNoticeSeconds", "(0) must be between 1 and 7200"),
        ({"nodeNoticeSeconds": 9000}, "nodeNoticeSeconds", "unset it"),
        ({"seconds": 1, "initialSeconds": 1, "min": 1, "max": _GRACE}, None, None),
        ({"seconds": _GRACE, "headroom": 0, "killWaitSeconds": 300, "exitMargin": 600}, None, None),
        (
            {"headroom": 10, "killWaitSeconds": 0, "exitMargin": 0, "nodeNoticeSeconds": 7200},
            None,
            None,
        ),
    ],
)
def test_grace_fields_are_bounded(
    grace: dict[str, Any], field: str | None, words: str | None
) -> None:
    raw: dict[str, Any] = {"image": "img", "checkpoint": {"uri": "/c"}, "gracePeriod": grace}
    if field is None:
        models.parse_spec(raw)
        return
    with pytest.raises(ValidationError) as info:
        models.parse_spec(raw)
    message = models.format_validation_error(info.value)
    assert message.startswith(f"spec.gracePeriod.{field}: "), message
    assert words is not None and words in message, message


def test_every_grace_field_has_bounds_in_the_crd_schema() -> None:
    from preemptible_operator import crd

    grace = crd.openapi_schema()["properties"]["spec"]["properties"]["gracePeriod"]
    numeric = {
        name: prop
        for name, prop in grace["properties"].items()
        if prop.get("type") in ("integer", "number")
    }
    assert set(numeric) == {
        "seconds",
        "initialSeconds",
        "min",
        "max",
        "headroom",
        "killWaitSeconds",
        "exitMargin",
        "nodeNoticeSeconds",
    }
    for name, prop in numeric.items():
        assert "minimum" in prop and "maximum" in prop, name
        assert prop["maximum"] <= max(_GRACE, 600), name
    rules = " ".join(v["rule"] for v in grace["x-kubernetes-validations"])
    for name in numeric:
        assert f"self.{name} <=" in rules, name
