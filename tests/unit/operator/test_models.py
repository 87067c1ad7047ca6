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


# Status objects as a newer operator may have written them: a field this version does not know,
# at the top and in every nested status model (a rollback of the operator must neither refuse the
# object nor drop the field on its next write).
_FUTURE = {"futureField": {"kept": [1, "two"]}}
_STATUS_WITH_FUTURE_FIELDS: list[tuple[str, dict[str, Any]]] = [
    ("top level", {"phase": "Running", "somethingNew": 1}),
    ("attempts[]", {"attempts": [{"attempt": 1, "jobName": "tj-a1", **_FUTURE}]}),
    ("conditions[]", {"conditions": [{"type": "Running", "status": "True", **_FUTURE}]}),
    ("progress", {"progress": {"step": 3, **_FUTURE}}),
    ("timings", {"timings": {"stepSecondsMax": 0.5, **_FUTURE}}),
    ("gracePeriod", {"gracePeriod": {"current": 30, **_FUTURE}}),
    ("checkpointInterval", {"checkpointInterval": {"reason": "x", **_FUTURE}}),
    ("lastCompleteCheckpoint", {"lastCompleteCheckpoint": {"step": 5, "path": "/c/5", **_FUTURE}}),
    (
        "incompleteCheckpoints[]",
        {"incompleteCheckpoints": [{"step": 6, "path": "/c/6", **_FUTURE}]},
    ),
]


@pytest.mark.parametrize(
    "raw",
    [r for _, r in _STATUS_WITH_FUTURE_FIELDS],
    ids=[i for i, _ in _STATUS_WITH_FUTURE_FIELDS],
)
def test_status_keeps_fields_a_newer_operator_wrote(raw: dict[str, Any]) -> None:
    status = models.TrainingJobStatus.model_validate(raw)
    assert status.to_k8s() == raw
    # A pass works on a deep copy and writes it whole: the field survives both.
    copy = status.model_copy(deep=True)
    copy.preemptions = 2
    assert copy.to_k8s() == {**raw, "preemptions": 2}


# Enum values a newer operator may add (the CRD is not downgraded on a rollback, so the apiserver
# stores them): read, kept and written back unchanged, like unknown fields.
_STATUS_WITH_NEWER_VALUES: list[tuple[str, dict[str, Any]]] = [
    ("phase", {"phase": "Resizing"}),
    (
        "attempts[].outcome",
        {"attempts": [{"attempt": 1, "jobName": "tj-a1", "outcome": "Resized"}]},
    ),
    (
        "attempts[].failureAction",
        {"attempts": [{"attempt": 1, "jobName": "tj-a1", "failureAction": "Quarantine"}]},
    ),
    ("conditions[].status", {"conditions": [{"type": "Running", "status": "Partly"}]}),
]


@pytest.mark.parametrize(
    "raw",
    [r for _, r in _STATUS_WITH_NEWER_VALUES],
    ids=[i for i, _ in _STATUS_WITH_NEWER_VALUES],
)
def test_status_keeps_enum_values_a_newer_operator_wrote(raw: dict[str, Any]) -> None:
    status = models.TrainingJobStatus.model_validate(raw)
    assert status.to_k8s() == raw
    copy = status.model_copy(deep=True)
    copy.preemptions = 1
    assert copy.to_k8s() == {**raw, "preemptions": 1}


@pytest.mark.parametrize(
    ("model", "kwargs"),
    [
        (models.TrainingJobStatus, {"phase": "Resizing"}),
        (models.AttemptRecord, {"attempt": 1, "job_name": "tj-a1", "outcome": "Resized"}),
        (models.AttemptRecord, {"attempt": 1, "job_name": "tj-a1", "failure_action": "Quarantine"}),
        (models.Condition, {"type": "Running", "status": "Partly"}),
    ],
)
def test_status_enums_stay_strict_for_python_callers(model: type, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match="Input should be"):
        model(**kwargs)


def test_a_non_string_enum_value_is_still_refused_from_the_wire() -> None:
    with pytest.raises(ValidationError):
        models.TrainingJobStatus.model_validate({"phase": 3})


def test_status_stays_strict_for_python_callers() -> None:
    with pytest.raises(ValidationError, match="no field"):
        models.AttemptRecord(attempt=1, job_name="tj-a1", lost_step=3)  # type: ignore[call-arg]
    record = models.AttemptRecord(attempt=1, job_name="tj-a1")
    with pytest.raises(AttributeError, match="no field 'lost_step'"):
        record.lost_step = 3  # type: ignore[attr-defined]
    record.lost_steps = 3
    assert record.to_k8s() == {"attempt": 1, "jobName": "tj-a1", "lostSteps": 3}


def test_spec_still_refuses_unknown_fields() -> None:
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        models.parse_spec({"image": "img", "checkpoint": {"uri": "/c", "futureField": 1}})


def test_crd_schema_of_status_is_not_opened_by_the_kept_fields() -> None:
    from preemptible_operator import crd

    status = crd.openapi_schema()["properties"]["status"]
    nodes = [status, status["properties"]["attempts"]["items"], status["properties"]["progress"]]
    for node in nodes:
        assert "x-kubernetes-preserve-unknown-fields" not in node
        assert "additionalProperties" not in node


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
