"""An elastic TrainingJob's attempt (pure): which step the create path takes for its Workload,
the size an admission gives, the size-change Event, status.nodes, and the attempt Job rendered
for that size (no Kueue labels, the elastic env, the admitted flavors)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from preemptible_operator import elastic_attempt as ea
from preemptible_operator import models, render, workload
from preemptible_operator.classify import Interruption
from preemptible_operator.conditions import Reason
from preemptible_operator.phases import Decision
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


# ------------------------------------------------------------------------------ growing
def _slice(index: int, *conditions: dict[str, Any]) -> dict[str, Any]:
    wl = _workload(*conditions)
    wl["metadata"]["name"] = workload.workload_name("tj", index)
    wl["metadata"]["annotations"][workload.ANNOTATION_SLICE] = str(index)
    return wl


FINISHED_REPLACED = cond("Finished", "WorkloadSliceReplaced")


@pytest.mark.parametrize(
    ("present", "running", "current", "pending"),
    [
        ([], None, None, []),
        ([1], None, 1, []),
        ([1], 1, 1, []),
        ([1, 2], 1, 1, [2]),  # a grow asked for, the attempt still on slice 1
        ([1, 2], None, 2, []),  # nothing runs: the newest live one
        ([2, 1], 7, 2, []),  # the Job's slice is gone: the newest live one
    ],
)
def test_slices(
    present: list[int], running: int | None, current: int | None, pending: list[int]
) -> None:
    seen = ea.slices([_slice(i) for i in present], running)
    assert (ea.slice_of(seen.current) if seen.current else None) == current
    assert [ea.slice_of(w) for w in seen.pending] == pending


def test_slices_skip_the_replaced_one_once_the_attempt_ended() -> None:
    seen = ea.slices([_slice(1, *ADMITTED, FINISHED_REPLACED), _slice(2, *ADMITTED)], None)
    assert seen.current is not None and ea.slice_of(seen.current) == 2
    assert [ea.slice_of(w) for w in seen.others] == [1]


def test_a_replaced_workload_stops_the_attempt_as_a_resize() -> None:
    active = Interruption("Active", Reason.STARTED)
    resized = ea.resize_interruption(_slice(1, *ADMITTED, FINISHED_REPLACED), active, 1)
    assert resized is not None
    assert (resized.outcome, resized.reason) == ("Suspended", Reason.RESIZING)
    # Finished for another reason (the operator's own write at the end), or over already.
    assert ea.resize_interruption(_slice(1, cond("Finished", "Succeeded")), active, 1) is None
    over = Interruption("Succeeded", Reason.COMPLETED, "")
    assert ea.resize_interruption(_slice(1, FINISHED_REPLACED), over, 1) is None
    # The operator's stop wins over what its stopped pods show (killed at the grace deadline).
    killed = Interruption("Failed", Reason.TRAINING_FAILED, "exit 137")
    resized = ea.resize_interruption(_slice(1, FINISHED_REPLACED), killed, 1)
    assert resized is not None and resized.reason == Reason.RESIZING
    assert ea.resize_interruption(_slice(1, *ADMITTED), active, 1) is None


T0 = 1_800_000_000.0


def _ts(offset: float) -> str:
    return dt.datetime.fromtimestamp(T0 + offset, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(*records: Any, save: float | None = None) -> Any:
    timings = models.Timings(save_seconds_max=save) if save is not None else None
    return models.TrainingJobStatus(attempts=list(records), timings=timings)


def _record(attempt: int, nodes: int, created: float, running: float | None, **kw: Any) -> Any:
    return models.AttemptRecord(
        attempt=attempt,
        job_name=f"tj-a{attempt}",
        nodes=nodes,
        start_time=_ts(created),
        running_time=_ts(running) if running is not None else None,
        grace_seconds=kw.pop("grace", 60),
        **kw,
    )


@pytest.mark.parametrize(
    ("records", "save", "now", "target"),
    [
        # 1 -> 2 of 4 (accumulation 2: sizes 1, 2, 4), cooldown 600: a pause <= 300 s pays.
        ([_record(1, 1, 0, 10)], 20.0, 700, 2),  # pause 20 + 2 x 10
        ([_record(1, 1, 0, 10)], 20.0, 500, None),  # the size is younger than the cooldown
        ([_record(1, 1, 0, 200)], 20.0, 900, None),  # pause 20 + 2 x 200 > 300
        ([_record(1, 1, 0, 10)], None, 700, 2),  # the save unmeasured: the grace (60)
        ([_record(1, 1, 0, 10, grace=290)], None, 700, None),  # 290 + 20 > 300
        ([_record(1, 1, 0, None)], 20.0, 700, None),  # not all its pods started yet
        ([_record(1, 4, 0, 10)], 20.0, 700, None),  # at the largest size already
        ([_record(1, 2, 0, 10)], 20.0, 700, 4),  # 2 -> 4: pause <= 300 pays
        # The same size since attempt 1 (the cooldown counts from then), not from attempt 2.
        ([_record(1, 1, 0, 10, end_time=_ts(400)), _record(2, 1, 420, 430)], 20.0, 700, 2),
        ([_record(1, 2, 0, 10, end_time=_ts(400)), _record(2, 1, 420, 430)], 20.0, 700, None),
    ],
)
def test_grow_plan(records: list[Any], save: float | None, now: float, target: int | None) -> None:
    spec = _spec(4, minNodes=1, gradientAccumulationSteps=2, growCooldownSeconds=600)
    grow = ea.grow_plan(spec, _status(*records, save=save), records[-1], T0 + now)
    assert (grow.target if grow else None) == target
    if grow is not None:
        assert "growCooldownSeconds (600 s)" in grow.message


def test_grow_plan_without_elastic_or_after_the_end() -> None:
    record = _record(1, 1, 0, 10)
    assert ea.grow_plan(_spec(4), _status(record), record, T0 + 10_000) is None
    ended = _record(1, 1, 0, 10, end_time=_ts(20))
    spec = _spec(4, minNodes=1)
    assert ea.grow_plan(spec, _status(ended), ended, T0 + 10_000) is None


# ------------------------------------------------------------------ the gate holds the create

_CREATE = Decision("Pending", "create_attempt", Reason.ATTEMPT_CREATED)


@pytest.mark.parametrize(
    ("decision", "gate", "want"),
    [
        (_CREATE, ea.ElasticGate("start", "admitted 2", nodes=2), _CREATE),
        (
            _CREATE,
            ea.ElasticGate("create_workload", "creating Kueue Workload tj-w1"),
            Decision("Queued", "none", Reason.QUEUED, "creating Kueue Workload tj-w1"),
        ),
        (
            _CREATE,
            ea.ElasticGate("clear_reservation", "releasing"),
            Decision("Queued", "none", Reason.QUEUED, "releasing"),
        ),
        (
            _CREATE,
            ea.ElasticGate("wait", "waiting for Kueue admission"),
            Decision("Queued", "none", Reason.QUEUED, "waiting for Kueue admission"),
        ),
        # Only a create is gated.
        (
            Decision("Running", "none", Reason.STARTED),
            ea.ElasticGate("wait", "w"),
            Decision("Running", "none", Reason.STARTED),
        ),
    ],
    ids=["start", "create-workload", "clear-reservation", "wait", "not-a-create"],
)
def test_gated_decision(decision: Any, gate: ea.ElasticGate, want: Any) -> None:
    assert ea.gated_decision(decision, gate) == want
