"""An elastic TrainingJob's attempt (pure): which step the create path takes for its Workload,
the size an admission gives, the size-change Event, status.nodes, and the attempt Job rendered
for that size (no Kueue labels, the elastic env, the admitted flavors)."""

from __future__ import annotations

from typing import Any

import pytest

from preemptible_operator import elastic_attempt as ea
from preemptible_operator import render, workload
from preemptible_operator.conditions import Reason
from tests.unit.operator.builders import META, cond, make_spec
from trainer_runtime import protocol

PARAMS = render.AttemptParams(attempt=1, grace_seconds=60, resume_from="", suspended=False)


def _spec(num_nodes: int = 4, **elastic: Any) -> Any:
    return make_spec(
        queueName="lq",
        priorityClass="low",
        resourcesPerNode={"requests": {"cpu": "1"}},
        numNodes=num_nodes,
        **({"elastic": elastic} if elastic else {}),
    )


def _workload(*conditions: dict[str, Any], assigned: int | None = None) -> dict[str, Any]:
    wl = workload.render_workload(META, _spec(), PARAMS, min_nodes=1, max_nodes=4, priority=1)
    wl["metadata"].update(resourceVersion="7", generation=1, uid="wl-uid")
    wl["status"] = {"conditions": list(conditions)}
    if assigned is not None:
        wl["status"]["admission"] = {
            "clusterQueue": "cq",
            "podSetAssignments": [
                {"name": "workers", "count": assigned, "flavors": {"cpu": "default"}}
            ],
        }
    return wl


ADMITTED = (cond("QuotaReserved", "QuotaReserved"), cond("Admitted", "Admitted"))
EVICTED = (cond("Evicted", "Preempted", "Preempted to accommodate a workload"),)
RELEASED = (
    cond("QuotaReserved", "Pending", status="False"),
    cond("Admitted", "NoReservation", status="False"),
)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (_spec(4), (4,)),  # not elastic: numNodes only
        (_spec(4, minNodes=1, gradientAccumulationSteps=2), (1, 2, 4)),  # 3 cannot keep it
        (_spec(4, minNodes=1, maxNodes=8, gradientAccumulationSteps=2), (1, 2, 4, 8)),
        (_spec(2, minNodes=1), (1, 2)),
        (_spec(6, minNodes=4), (6,)),  # 4 and 5 do not divide 6
    ],
)
def test_sizes_keep_the_global_batch(spec: Any, expected: tuple[int, ...]) -> None:
    assert ea.elastic_sizes(spec) == expected


@pytest.mark.parametrize(
    ("admitted", "sizes", "expected"),
    [(3, (1, 2, 4), 2), (4, (1, 2, 4), 4), (1, (1, 2, 4), 1), (1, (2, 4), None), (9, (1,), 1)],
)
def test_attempt_size_is_the_largest_that_fits(
    admitted: int, sizes: tuple[int, ...], expected: int | None
) -> None:
    assert ea.attempt_size(admitted, sizes) == expected


@pytest.mark.parametrize(
    ("wl", "admitted", "action", "nodes", "unused"),
    [
        (None, None, "create_workload", None, 0),
        (_workload(), None, "wait", None, 0),  # pending
        (_workload(*ADMITTED, assigned=3), 3, "start", 2, 1),  # 3 cannot keep the batch
        (_workload(*ADMITTED, assigned=4), 4, "start", 4, 0),
        (_workload(*ADMITTED, assigned=1), 1, "start", 1, 0),
        # Evicted while the attempt ran; now its pods are gone: release, the same one requeues.
        (_workload(*ADMITTED, *EVICTED, assigned=4), None, "clear_reservation", None, 0),
        # Released already (our write, or a pass redone): wait for Kueue.
        (_workload(*RELEASED, *EVICTED), None, "wait", None, 0),
        (_workload(*ADMITTED, cond("Finished", "Succeeded"), assigned=4), None, "wait", None, 0),
    ],
)
def test_start_gate(
    wl: dict[str, Any] | None, admitted: int | None, action: str, nodes: int | None, unused: int
) -> None:
    admission = None
    if admitted is not None:
        admission = workload.Admission(admitted, {}, [], ("default",))
    gate = ea.start_gate(wl, admission, (1, 2, 4), "tj-w1")
    assert (gate.action, gate.nodes, gate.unused) == (action, nodes, unused)
    assert "tj-w1" in gate.message


def test_start_gate_agrees_with_the_admission_read() -> None:
    """admitted_size of an admitted Workload is what the gate starts from."""
    wl = _workload(*ADMITTED, assigned=2)
    admission = workload.admitted_size(wl, {"default": {"spec": {}}})
    assert ea.admitted_flavors(wl) == ("default",)
    assert ea.start_gate(wl, admission, (1, 2, 4), "tj-w1").nodes == 2


@pytest.mark.parametrize(
    ("previous", "nodes", "reason"),
    [
        (None, 1, Reason.SCALED_DOWN),  # the first attempt, against numNodes (4)
        (None, 4, None),
        (1, 4, Reason.SCALED_UP),
        (4, 2, Reason.SCALED_DOWN),
        (2, 2, None),
    ],
)
def test_size_event(previous: int | None, nodes: int, reason: str | None) -> None:
    spec = _spec(4, minNodes=1, gradientAccumulationSteps=2)
    event = ea.size_event(previous, nodes, spec, 3, (1, 2, 4))
    if reason is None:
        assert event is None
        return
    assert event is not None and event[1] == reason
    assert "Kueue admitted 3" in event[2] and "1, 2, 4" in event[2]
    assert f"accumulates {8 // nodes} step(s)" in event[2]


@pytest.mark.parametrize(
    ("nodes", "spec", "shown"),
    [
        (4, _spec(4), "4/4"),
        (1, _spec(2, minNodes=1), "1/2"),
        (3, _spec(2, minNodes=1, maxNodes=4), "3/4"),
        (None, _spec(2), None),
    ],
)
def test_nodes_shown(nodes: int | None, spec: Any, shown: str | None) -> None:
    assert ea.nodes_shown(nodes, spec) == shown


def _env(job: dict[str, Any]) -> dict[str, Any]:
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_elastic_attempt_job_runs_the_admitted_size_without_kueue_labels() -> None:
    spec = _spec(2, minNodes=1, gradientAccumulationSteps=3)
    params = render.AttemptParams(
        attempt=2,
        grace_seconds=60,
        resume_from="",
        suspended=False,
        nodes=1,
        elastic=True,
        node_selector={"pool": "spot"},
        tolerations=[{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
    )
    job = render.render_job(META, spec, params)
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 1
    assert job["spec"]["suspend"] is False
    assert render.KUEUE_QUEUE_LABEL not in job["metadata"]["labels"]
    assert render.KUEUE_PRIORITY_LABEL not in job["metadata"]["labels"]
    env = _env(job)
    assert env[protocol.ENV_ELASTIC_REFERENCE_NODES] == "2"
    assert env[protocol.ENV_ELASTIC_ACCUMULATION] == "3"
    pod = job["spec"]["template"]["spec"]
    assert pod["nodeSelector"]["pool"] == "spot"
    assert {"key": "spot", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]


def test_elastic_attempt_of_two_pods_gets_the_world_of_two() -> None:
    spec = _spec(4, minNodes=1)
    params = render.AttemptParams(
        attempt=1, grace_seconds=60, resume_from="", suspended=False, nodes=2, elastic=True
    )
    env = _env(render.render_job(META, spec, params))
    assert env["WORLD_SIZE"] == "2"


def test_a_job_without_elastic_renders_as_before() -> None:
    spec = _spec(2)
    job = render.render_job(META, spec, PARAMS)
    assert job["metadata"]["labels"][render.KUEUE_QUEUE_LABEL] == "lq"
    assert job["spec"]["completions"] == 2
    assert protocol.ENV_ELASTIC_REFERENCE_NODES not in _env(job)
