"""An elastic TrainingJob's Kueue Workload: rendering, the owner's status writes, reading the
admission (pure). The same functions run against Kueue in
tests/operator/test_kueue_workload_protocol.py."""

from __future__ import annotations

from typing import Any

import pytest

from preemptible_operator import render, workload
from tests.unit.operator.builders import META, cond, make_spec

NOW = "2026-01-02T03:04:05Z"
EARLIER = "2026-01-01T00:00:00Z"
PARAMS = render.AttemptParams(
    attempt=1, grace_seconds=60, resume_from="/ckpt/run/checkpoint-5", suspended=False
)


def _spec(**kw: Any) -> Any:
    return make_spec(queueName="lq", resourcesPerNode={"requests": {"cpu": "1"}}, numNodes=2, **kw)


def _workload(
    *conditions: dict[str, Any],
    count: int = 3,
    assigned: int | None = 2,
    flavors: dict[str, str] | None = None,
    generation: int = 1,
) -> dict[str, Any]:
    """A Workload as the apiserver returns it, with ``conditions`` (at EARLIER) and, when
    ``assigned`` is not None, an admission of that many pods."""
    status: dict[str, Any] = {
        "conditions": [{**c, "lastTransitionTime": EARLIER, "observedGeneration": 1}
                       for c in conditions],
    }  # fmt: skip
    if assigned is not None:
        status["admission"] = {
            "clusterQueue": "cq",
            "podSetAssignments": [
                {
                    "name": workload.POD_SET_NAME,
                    "count": assigned,
                    "flavors": flavors if flavors is not None else {"cpu": "default"},
                    "resourceUsage": {"cpu": str(assigned)},
                }
            ],
        }
    wl = workload.render_workload(META, _spec(), PARAMS, min_nodes=1, max_nodes=count)
    wl["metadata"].update(resourceVersion="42", generation=generation, uid="wl-uid")
    wl["status"] = status
    return wl


ADMITTED = (cond("QuotaReserved", "QuotaReserved"), cond("Admitted", "Admitted"))
PREEMPTED_MSG = "Preempted to accommodate a workload (UID: u) due to prioritization"
EVICTED = (
    cond("Evicted", "Preempted", PREEMPTED_MSG),
    cond("Preempted", "InClusterQueue", PREEMPTED_MSG),
)


# ----------------------------------------------------------------------------- naming
@pytest.mark.parametrize(
    ("name", "slice_index", "expected"),
    [
        ("tj", 1, "tj-w1"),
        ("tj", 12, "tj-w12"),
        ("a" * 52, 1, "a" * 52 + "-w1"),  # the longest TrainingJob name fits as it is
    ],
)
def test_workload_name_is_deterministic(name: str, slice_index: int, expected: str) -> None:
    assert workload.workload_name(name, slice_index) == expected


@pytest.mark.parametrize("name", ["b" * 61, "c" * 70, "d" * 58 + "-" + "e" * 10])
def test_workload_name_is_cut_to_a_dns_label_keeping_it_unique(name: str) -> None:
    first, second = workload.workload_name(name, 1), workload.workload_name(name, 2)
    for got in (first, second):
        assert len(got) <= workload.MAX_WORKLOAD_NAME_LENGTH
        assert got[0].isalnum() and got[-1].isalnum() and "--" not in got
    assert first != second and first.endswith("-w1")
    assert workload.workload_name(name + "x", 1) != first


def test_workload_name_refuses_slice_zero() -> None:
    with pytest.raises(ValueError, match="slice_index"):
        workload.workload_name("tj", 0)


# ----------------------------------------------------------------------------- render_workload
def test_render_workload_identity_owner_queue_and_pod_set() -> None:
    spec = _spec(priorityClass="low")
    wl = workload.render_workload(META, spec, PARAMS, min_nodes=1, max_nodes=3, priority=100)
    assert wl["apiVersion"] == "kueue.x-k8s.io/v1beta2" and wl["kind"] == "Workload"
    meta = wl["metadata"]
    assert (meta["name"], meta["namespace"]) == ("tj-w1", "ns")
    assert meta["labels"] == {render.LABEL_TRAINING_JOB: "tj"}
    assert meta["annotations"] == {
        workload.ANNOTATION_SLICE: "1",
        render.ANNOTATION_TJ_UID: "uid-1",
    }
    assert meta["ownerReferences"] == [render.owner_reference(META)]
    assert meta["ownerReferences"][0]["controller"] is True
    assert meta["ownerReferences"][0]["blockOwnerDeletion"] is True
    assert wl["spec"]["queueName"] == "lq"
    assert wl["spec"]["priorityClassRef"] == {
        "group": "kueue.x-k8s.io",
        "kind": "WorkloadPriorityClass",
        "name": "low",
    }
    assert wl["spec"]["priority"] == 100
    (pod_set,) = wl["spec"]["podSets"]
    assert (pod_set["name"], pod_set["count"], pod_set["minCount"]) == ("workers", 3, 1)
    # The attempt Job's own pod template, not a copy of it.
    assert pod_set["template"] == render.render_job(META, spec, PARAMS)["spec"]["template"]
    assert pod_set["template"]["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "1"}}


@pytest.mark.parametrize(
    ("min_nodes", "max_nodes", "min_count"),
    [(1, 4, 1), (2, 4, 2), (3, 3, None), (1, 1, None)],
)
def test_render_workload_min_count_only_when_partial(
    min_nodes: int, max_nodes: int, min_count: int | None
) -> None:
    wl = workload.render_workload(META, _spec(), PARAMS, min_nodes=min_nodes, max_nodes=max_nodes)
    (pod_set,) = wl["spec"]["podSets"]
    assert pod_set["count"] == max_nodes
    assert pod_set.get("minCount") == min_count


def test_render_workload_without_class_has_no_priority() -> None:
    wl = workload.render_workload(META, _spec(), PARAMS, min_nodes=1, max_nodes=2)
    assert "priorityClassRef" not in wl["spec"] and "priority" not in wl["spec"]


def test_render_workload_carries_the_training_jobs_own_metadata_not_others_bookkeeping() -> None:
    meta = {
        **META,
        "labels": {"team": "nlp", "kueue.x-k8s.io/queue-name": "other"},
        "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}", "cost": "7"},
    }
    wl = workload.render_workload(meta, _spec(), PARAMS, min_nodes=1, max_nodes=2)
    assert wl["metadata"]["labels"] == {"team": "nlp", render.LABEL_TRAINING_JOB: "tj"}
    assert wl["metadata"]["annotations"]["cost"] == "7"
    assert not any(k.startswith("kubectl") for k in wl["metadata"]["annotations"])


@pytest.mark.parametrize(
    ("spec_kw", "kw", "match"),
    [
        ({}, {"min_nodes": 0, "max_nodes": 2}, "min_nodes"),
        ({}, {"min_nodes": 3, "max_nodes": 2}, "min_nodes"),
        ({"priorityClass": "low"}, {"min_nodes": 1, "max_nodes": 2}, "priority"),
        ({}, {"min_nodes": 1, "max_nodes": 2, "priority": 5}, "priorityClass"),
        ({"queueName": None}, {"min_nodes": 1, "max_nodes": 2}, "queueName"),
    ],
)
def test_render_workload_refuses(spec_kw: dict[str, Any], kw: dict[str, Any], match: str) -> None:
    spec = make_spec(**{"queueName": "lq", **spec_kw})
    with pytest.raises(ValueError, match=match):
        workload.render_workload(META, spec, PARAMS, **kw)


# ----------------------------------------------------------------------------- render_replacement
@pytest.mark.parametrize(
    ("current", "max_nodes", "sizes", "min_count"),
    [
        (1, 3, None, 2),  # the next size up
        (2, 3, None, None),  # the next size is the full size: no partial admission
        (2, 8, (1, 2, 4, 8), 4),  # 3 does not keep the global batch: never asked for
        (1, 4, (4, 2, 1), 2),
    ],
)
def test_render_replacement_grows_from_the_next_size(
    current: int, max_nodes: int, sizes: tuple[int, ...] | None, min_count: int | None
) -> None:
    old = _workload(*ADMITTED, count=max_nodes, assigned=current)
    new = workload.render_replacement(old, current_nodes=current, max_nodes=max_nodes, sizes=sizes)
    meta = new["metadata"]
    assert meta["name"] == "tj-w2"
    assert meta["annotations"][workload.ANNOTATION_REPLACEMENT_FOR] == "ns/tj-w1"
    assert meta["annotations"][workload.ANNOTATION_SLICE] == "2"
    assert "kueue.x-k8s.io/elastic-job" not in meta["annotations"]
    assert meta["ownerReferences"] == old["metadata"]["ownerReferences"]
    assert meta["labels"] == old["metadata"]["labels"]
    assert not {"resourceVersion", "uid", "generation"} & set(meta)
    assert "status" not in new
    (pod_set,) = new["spec"]["podSets"]
    assert pod_set["count"] == max_nodes and pod_set.get("minCount") == min_count
    assert pod_set["template"] == old["spec"]["podSets"][0]["template"]
    assert new["spec"]["queueName"] == old["spec"]["queueName"]


def test_render_replacement_of_a_replacement_names_the_next_slice() -> None:
    first = _workload(*ADMITTED, count=4, assigned=1)
    second = workload.render_replacement(first, current_nodes=1, max_nodes=4)
    second["metadata"].update(resourceVersion="7", uid="u2", generation=1)
    third = workload.render_replacement(second, current_nodes=2, max_nodes=4)
    assert third["metadata"]["name"] == "tj-w3"
    assert third["metadata"]["annotations"][workload.ANNOTATION_REPLACEMENT_FOR] == "ns/tj-w2"


@pytest.mark.parametrize(
    ("current", "max_nodes", "sizes"), [(3, 3, None), (2, 3, (1, 2, 4)), (4, 8, (1, 2, 4))]
)
def test_render_replacement_refuses_when_there_is_no_bigger_size(
    current: int, max_nodes: int, sizes: tuple[int, ...] | None
) -> None:
    old = _workload(*ADMITTED, count=max_nodes, assigned=current)
    with pytest.raises(ValueError, match="no size"):
        workload.render_replacement(old, current_nodes=current, max_nodes=max_nodes, sizes=sizes)


# ----------------------------------------------------------------------------- eviction
@pytest.mark.parametrize(
    ("conditions", "expected"),
    [
        ((), None),
        (ADMITTED, None),
        ((*ADMITTED, *EVICTED), workload.Eviction("Preempted", PREEMPTED_MSG)),
        ((*ADMITTED, cond("Evicted", "Preempted", "m", status="False")), None),
        (
            (cond("Evicted", "PodsReadyTimeout", "not ready"),),
            workload.Eviction("PodsReadyTimeout", "not ready"),
        ),
    ],
)
def test_eviction(
    conditions: tuple[dict[str, Any], ...], expected: workload.Eviction | None
) -> None:
    assert workload.eviction(_workload(*conditions)) == expected


# ----------------------------------------------------------------------------- admitted_size
FLAVORS = {
    "default": {"metadata": {"name": "default"}, "spec": {}},
    "spot": {
        "metadata": {"name": "spot"},
        "spec": {
            "nodeLabels": {"pool": "spot"},
            "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
        },
    },
    "gpu": {
        "metadata": {"name": "gpu"},
        "spec": {
            "nodeLabels": {"accelerator": "h100"},
            "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"},
                            {"key": "gpu", "operator": "Exists"}],
        },
    },
}  # fmt: skip


@pytest.mark.parametrize(
    ("conditions", "flavors", "expected"),
    [
        (ADMITTED, {"cpu": "default"}, workload.Admission(2, {}, [], ("default",))),
        (
            ADMITTED,
            {"cpu": "spot", "memory": "spot"},
            workload.Admission(
                2,
                {"pool": "spot"},
                [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
                ("spot",),
            ),
        ),
        (
            ADMITTED,
            {"cpu": "spot", "nvidia.com/gpu": "gpu"},
            workload.Admission(
                2,
                {"accelerator": "h100", "pool": "spot"},
                [
                    {"key": "spot", "operator": "Exists", "effect": "NoSchedule"},
                    {"key": "gpu", "operator": "Exists"},
                ],
                ("gpu", "spot"),
            ),
        ),
        # Reserved but not admitted (admission checks pending): no attempt yet.
        ((cond("QuotaReserved", "QuotaReserved"), cond("Admitted", "NoChecks", status="False")),
         {"cpu": "default"}, None),
        ((*ADMITTED, *EVICTED), {"cpu": "default"}, None),
        ((*ADMITTED, cond("Finished", "Succeeded")), {"cpu": "default"}, None),
        ((), {"cpu": "default"}, None),
    ],
)  # fmt: skip
def test_admitted_size(
    conditions: tuple[dict[str, Any], ...],
    flavors: dict[str, str],
    expected: workload.Admission | None,
) -> None:
    assert workload.admitted_size(_workload(*conditions, flavors=flavors), FLAVORS) == expected


def test_admitted_size_without_count_is_the_whole_pod_set() -> None:
    wl = _workload(*ADMITTED, count=3)
    del wl["status"]["admission"]["podSetAssignments"][0]["count"]
    got = workload.admitted_size(wl, FLAVORS)
    assert got is not None and got.count == 3


def test_admitted_size_needs_no_admission_object_to_say_none() -> None:
    assert workload.admitted_size(_workload(*ADMITTED, assigned=None), FLAVORS) is None


def test_admitted_size_refuses_an_unknown_flavor() -> None:
    with pytest.raises(KeyError, match="nope"):
        workload.admitted_size(_workload(*ADMITTED, flavors={"cpu": "nope"}), FLAVORS)


# ----------------------------------------------------------------------------- status writes
def _by_type(conditions: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in conditions}


def test_clear_reservation_patch_is_kueues_requeue_write() -> None:
    wl = _workload(*ADMITTED, *EVICTED, generation=3)
    patch = workload.clear_reservation_patch(wl, NOW)
    assert patch["metadata"] == {"resourceVersion": "42"}
    assert patch["status"]["admission"] is None
    conditions = patch["status"]["conditions"]
    assert [c["type"] for c in conditions] == [
        "QuotaReserved", "Admitted", "Evicted", "Preempted", "Requeued",
    ]  # fmt: skip
    got = _by_type(conditions)
    assert got["QuotaReserved"] == {
        "type": "QuotaReserved", "status": "False", "reason": "Pending",
        "message": PREEMPTED_MSG, "lastTransitionTime": NOW, "observedGeneration": 3,
    }  # fmt: skip
    assert got["Admitted"] == {
        "type": "Admitted", "status": "False", "reason": "NoReservation",
        "message": "The workload has no reservation", "lastTransitionTime": NOW,
        "observedGeneration": 3,
    }  # fmt: skip
    assert got["Requeued"] == {
        "type": "Requeued", "status": "True", "reason": "Preempted", "message": PREEMPTED_MSG,
        "lastTransitionTime": NOW, "observedGeneration": 3,
    }  # fmt: skip
    # Kept as they were: Kueue's next reservation resets them.
    for kind in ("Evicted", "Preempted"):
        assert got[kind] == _by_type(wl["status"]["conditions"])[kind]
    # The input is not changed.
    assert (
        wl["status"]["admission"]
        and _by_type(wl["status"]["conditions"])["QuotaReserved"]["status"] == "True"
    )


@pytest.mark.parametrize(
    ("requeued", "moved"),
    [
        (cond("Requeued", "Preempted", "old", status="False"), True),
        (cond("Requeued", "Preempted", "old"), False),  # already True: the time stays
    ],
)
def test_clear_reservation_patch_moves_a_transition_time_only_on_a_status_change(
    requeued: dict[str, Any], moved: bool
) -> None:
    wl = _workload(*ADMITTED, *EVICTED, requeued)
    got = _by_type(workload.clear_reservation_patch(wl, NOW)["status"]["conditions"])
    assert got["Requeued"]["lastTransitionTime"] == (NOW if moved else EARLIER)
    assert got["Requeued"]["message"] == PREEMPTED_MSG and got["Requeued"]["status"] == "True"


def test_clear_reservation_patch_takes_another_evictions_reason() -> None:
    wl = _workload(*ADMITTED, cond("Evicted", "PodsReadyTimeout", "pods not ready"))
    got = _by_type(workload.clear_reservation_patch(wl, NOW)["status"]["conditions"])
    assert (got["Requeued"]["reason"], got["Requeued"]["message"]) == (
        "PodsReadyTimeout",
        "pods not ready",
    )
    assert got["QuotaReserved"]["message"] == "pods not ready"


def test_clear_reservation_patch_refuses_a_workload_not_evicted() -> None:
    with pytest.raises(ValueError, match="not evicted"):
        workload.clear_reservation_patch(_workload(*ADMITTED), NOW)


@pytest.mark.parametrize(("succeeded", "reason"), [(True, "Succeeded"), (False, "Failed")])
def test_finished_patch(succeeded: bool, reason: str) -> None:
    wl = _workload(*ADMITTED, generation=2)
    patch = workload.finished_patch(wl, NOW, succeeded=succeeded, message="training ended")
    assert patch["metadata"] == {"resourceVersion": "42"}
    assert "admission" not in patch["status"], "the admission stays as a record"
    got = _by_type(patch["status"]["conditions"])
    assert got["Finished"] == {
        "type": "Finished", "status": "True", "reason": reason, "message": "training ended",
        "lastTransitionTime": NOW, "observedGeneration": 2,
    }  # fmt: skip
    assert got["Admitted"] == _by_type(wl["status"]["conditions"])["Admitted"]
