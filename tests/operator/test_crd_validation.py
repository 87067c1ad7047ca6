"""On the real control plane: the CRD's CEL rules and bounds (generated from the models) make the
apiserver refuse an invalid TrainingJob, on create and on edit, with the message the operator's
own models give; valid objects are accepted. No operator runs: this is the apiserver alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from preemptible_operator import models
from tests.operator.harness import TJClient, toy_training_job

pytestmark = [pytest.mark.cluster]


def _elastic(low: int, high: int | None = None, steps: int | None = None) -> dict[str, Any]:
    elastic: dict[str, Any] = {"minNodes": low}
    if high is not None:
        elastic["maxNodes"] = high
    if steps is not None:
        elastic["gradientAccumulationSteps"] = steps
    return {"elastic": elastic}


# (spec overrides, the field the apiserver names): every rule kind and every bound kind.
INVALID: list[tuple[dict[str, Any], str]] = [
    ({"gracePeriod": {"min": 100, "max": 50}}, "spec.gracePeriod.min"),
    ({"gracePeriod": {"seconds": 0}}, "spec.gracePeriod.seconds"),
    (
        {"env": [{"name": "HF_HOME", "value": "/c"}, {"name": "RANK", "value": "3"}]},
        "spec.env[1].name",
    ),
    ({"env": [{"name": "PREEMPTIBLE_RESUME_FROM", "value": ""}]}, "spec.env[0].name"),
    ({"queueName": "Team A!"}, "spec.queueName"),
    ({"priorityClass": "-low"}, "spec.priorityClass"),
    ({"numNodes": 0}, "spec.numNodes"),
    ({"gracePeriod": {"headroom": -0.5}}, "spec.gracePeriod.headroom"),
    ({"metricsPort": 70000}, "spec.metricsPort"),
    ({"maxRestarts": -1}, "spec.maxRestarts"),
    ({"numProcPerNode": 0}, "spec.numProcPerNode"),
    ({"numProcPerNode": "eight"}, "spec.numProcPerNode"),
    ({"numProcPerNode": "8"}, "spec.numProcPerNode"),
    ({"numProcPerNode": "auto"}, "spec.numProcPerNode"),
    (
        {"numProcPerNode": "auto", "resourcesPerNode": {"requests": {"cpu": 1}}},
        "spec.numProcPerNode",
    ),
    ({"numProcPerNode": 2, "command": []}, "spec.command"),
    ({"shmSize": "a lot"}, "spec.shmSize"),
    ({"env": [{"name": "PET_NPROC_PER_NODE", "value": "8"}]}, "spec.env[0].name"),
    # the grace fields' bounds: the schema's minimum/maximum and a CEL message naming the fix
    ({"gracePeriod": {"seconds": 7201}}, "spec.gracePeriod.seconds"),
    ({"gracePeriod": {"initialSeconds": 100000}}, "spec.gracePeriod.initialSeconds"),
    ({"gracePeriod": {"max": 1000000000}}, "spec.gracePeriod.max"),
    ({"gracePeriod": {"headroom": 11}}, "spec.gracePeriod.headroom"),
    ({"gracePeriod": {"killWaitSeconds": 300.5}}, "spec.gracePeriod.killWaitSeconds"),
    ({"gracePeriod": {"exitMargin": -1}}, "spec.gracePeriod.exitMargin"),
    ({"gracePeriod": {"nodeNoticeSeconds": 9000}}, "spec.gracePeriod.nodeNoticeSeconds"),
    ({"activeDeadlineSeconds": 0}, "spec.activeDeadlineSeconds"),
    ({"maxPreemptions": -1}, "spec.maxPreemptions"),
    ({"ttlSecondsAfterFinished": -5}, "spec.ttlSecondsAfterFinished"),
    ({"preemption": {"minRunSeconds": -1}}, "spec.preemption.minRunSeconds"),
    # failurePolicy (issue 30): 75 is the runtime's preemption exit, never a failure to match
    (
        {"failurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": [1, 75]}]}},
        "spec.failurePolicy.rules[0].onExitCodes",
    ),
    (
        {"failurePolicy": {"rules": [{"action": "Ignore", "onExitCodes": [0]}]}},
        "spec.failurePolicy.rules[0].onExitCodes[0]",
    ),
    ({"failurePolicy": {"restartWindowSeconds": 0}}, "spec.failurePolicy.restartWindowSeconds"),
    # spec.elastic (issue 40): the range, its default, the queue, the global batch, the bounds
    ({"queueName": "q", "numNodes": 4, **_elastic(3, 2)}, "spec.elastic.minNodes"),
    ({"queueName": "q", "numNodes": 2, **_elastic(3)}, "spec.elastic.minNodes"),
    ({"queueName": "q", **_elastic(0)}, "spec.elastic.minNodes"),
    ({"queueName": "q", "numNodes": 4, **_elastic(1, 1025)}, "spec.elastic.maxNodes"),
    ({"numNodes": 4, **_elastic(1)}, "spec.queueName"),
    ({"queueName": "", "numNodes": 4, **_elastic(1)}, "spec.queueName"),
    ({"queueName": "q", "numNodes": 4, **_elastic(3, 3, steps=2)}, "spec.elastic"),
    ({"queueName": "q", "numNodes": 3000, **_elastic(1001, 1024)}, "spec.elastic"),
    (
        {"queueName": "q", "numNodes": 4, **_elastic(2), "numProcPerNode": "auto"},
        "spec.numProcPerNode",
    ),
]
VALID: list[dict[str, Any]] = [
    {},
    {"gracePeriod": {"min": 50, "max": 50, "initialSeconds": 10, "headroom": 0}},
    {"env": [{"name": "HF_HOME", "value": "/c"}, {"name": "RANKING", "value": "x"}]},
    {"queueName": "team-a.q_1", "priorityClass": "low"},
    {"numNodes": 4, "metricsPort": 65535, "maxRestarts": 0},
    {"numNodes": 2, "numProcPerNode": 8, "shmSize": "64Gi"},
    {"numProcPerNode": 1, "command": []},
    {"numProcPerNode": "auto", "resourcesPerNode": {"limits": {"nvidia.com/gpu": 8}}},
    {"numProcPerNode": "auto", "resourcesPerNode": {"requests": {"nvidia.com/gpu": "4"}}},
    {"activeDeadlineSeconds": 86400, "maxPreemptions": 0, "ttlSecondsAfterFinished": 0},
    {
        "gracePeriod": {
            "seconds": 7200,
            "initialSeconds": 1,
            "min": 1,
            "max": 7200,
            "headroom": 10,
            "killWaitSeconds": 300,
            "exitMargin": 600,
            "nodeNoticeSeconds": 7200,
        }
    },
    {"gracePeriod": {"headroom": 0, "killWaitSeconds": 0.5, "exitMargin": 0}},
    {"preemption": {"minRunSeconds": 0}},
    {
        "failurePolicy": {
            "restartWindowSeconds": 86400,
            "rules": [
                {"name": "bad-config", "action": "FailJob", "onExitCodes": [2, 137]},
                {"action": "Ignore", "onReasons": ["KubeletEvicted", "OOMKilled"]},
                {"action": "Restart"},
            ],
        },
        "unreachableNode": {"escalateAfterSeconds": 0},
    },
    {"queueName": "q", "numNodes": 4, **_elastic(1)},
    {"queueName": "q", "numNodes": 4, **_elastic(4, 4)},
    {
        "queueName": "q",
        "numNodes": 4,
        "elastic": {
            "minNodes": 2,
            "maxNodes": 1024,
            "gradientAccumulationSteps": 2,
            "growCooldownSeconds": 0,
        },
    },
    {"queueName": "q", "numNodes": 3, **_elastic(2, 2, steps=2)},  # 2 divides 3 x 2
    {"queueName": "q", "numNodes": 4, **_elastic(8, 8, steps=2)},  # above numNodes
    {"queueName": "q", "numNodes": 2000, **_elastic(1500)},  # past the list of sizes CEL tries
    {
        "queueName": "q",
        "numNodes": 2,
        **_elastic(1),
        "numProcPerNode": "auto",
        "resourcesPerNode": {"limits": {"nvidia.com/gpu": 8}},
    },
]


def _dry_run_create(tj: TJClient, body: dict[str, Any]) -> None:
    tj.custom.create_namespaced_custom_object(
        models.GROUP, models.VERSION, tj.ns, models.PLURAL, body, dry_run="All"
    )


def _operator_message(spec: dict[str, Any]) -> str:
    """What the operator's models say about ``spec`` (the part after the field path)."""
    with pytest.raises(ValidationError) as info:
        models.parse_spec(spec)
    return models.format_validation_error(info.value).split(": ", 1)[1]


@pytest.mark.parametrize(("overrides", "field"), INVALID)
def test_apiserver_refuses_an_invalid_training_job(
    tj: TJClient, checkpoint_root: Path, overrides: dict[str, Any], field: str
) -> None:
    body = toy_training_job("invalid", checkpoint_root, **overrides)
    with pytest.raises(ApiException) as info:
        _dry_run_create(tj, body)
    assert info.value.status == 422, info.value.body
    assert field in info.value.body, info.value.body
    words = _operator_message(body["spec"])
    if words.startswith("Input should"):
        # A plain schema bound: the apiserver words it its own way, naming the bound.
        assert "should be" in info.value.body, info.value.body
    elif words.startswith("String should match pattern"):
        assert "should match" in info.value.body, info.value.body
    else:
        # A CEL rule: the apiserver's message is the models' message, value included.
        assert words in info.value.body.replace('\\"', '"'), (words, info.value.body)


@pytest.mark.parametrize("overrides", VALID)
def test_apiserver_accepts_a_valid_training_job(
    tj: TJClient, checkpoint_root: Path, overrides: dict[str, Any]
) -> None:
    body = toy_training_job("valid", checkpoint_root, **overrides)
    models.parse_spec(body["spec"])  # the operator accepts it too
    _dry_run_create(tj, body)


def test_an_invalid_edit_is_refused_and_the_stored_object_kept(
    tj: TJClient, checkpoint_root: Path
) -> None:
    """`kubectl edit` of a stored TrainingJob (no operator: it stays as created)."""
    body = toy_training_job("edited", checkpoint_root, suspend=True)
    tj.create(body)
    with pytest.raises(ApiException) as info:
        tj.patch_spec("edited", {"gracePeriod": {"min": 500, "max": 100}})
    assert info.value.status == 422, info.value.body
    assert "min (500) must not exceed max (100); lower min or raise max" in info.value.body
    stored = tj.get("edited")["spec"]["gracePeriod"]
    assert (stored["min"], stored["max"]) == (5, 120), stored
    tj.patch_spec("edited", {"gracePeriod": {"min": 10, "max": 100}})  # a valid edit goes in
    assert tj.get("edited")["spec"]["gracePeriod"]["min"] == 10
