"""The Kueue protocol that the elastic design (docs/elastic.md, option 3) rests on, run on the real
control plane with Kueue v0.19.2 (tests/cluster/kueue.py: the session ClusterQueue, 2 CPU of
quota, "low" = 100 and "high" = 1000). Only Workloads are created, directly, by the test playing
the operator's part: a ConfigMap stands in for the TrainingJob as their owner. No pod runs.

Each pod of a pod set asks for 1 CPU, so the ClusterQueue holds 2 pods.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest
from kubernetes.client.exceptions import ApiException

from tests.cluster.controlplane import ControlPlane
from tests.cluster.helpers import condition, eventually
from tests.cluster.kubeconfig import api_client_from
from tests.cluster.kueue import KUEUE_API, KUEUE_GROUP, KUEUE_VERSION, Kueue

pytestmark = [pytest.mark.cluster, pytest.mark.kueue]

ELASTIC = "kueue.x-k8s.io/elastic-job"
REPLACEMENT_FOR = "kueue.x-k8s.io/workload-slice-replacement-for"
MERGE = "application/merge-patch+json"


class Workloads:
    """Workloads of one namespace through one identity (admin unless told otherwise)."""

    def __init__(self, client: kubernetes.client.ApiClient, namespace: str, kueue: Kueue) -> None:
        self.api = kubernetes.client.CustomObjectsApi(client)
        self.core = kubernetes.client.CoreV1Api(client)
        self.ns = namespace
        self.kueue = kueue

    def owner(self, name: str) -> dict[str, Any]:
        """A ConfigMap standing in for the TrainingJob; its ownerReference for a Workload."""
        cm = self.core.create_namespaced_config_map(self.ns, {"metadata": {"name": name}})
        return {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "name": name,
            "uid": cm.metadata.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }

    def manifest(
        self,
        name: str,
        owner: dict[str, Any],
        *,
        count: int,
        min_count: int | None = None,
        priority: str = "low",
        annotations: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        pod_set: dict[str, Any] = {
            "name": "workers",
            "count": count,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [
                        {"name": "trainer", "image": "unused",
                         "resources": {"requests": {"cpu": "1"}}}
                    ],
                }
            },
        }  # fmt: skip
        if min_count is not None:
            pod_set["minCount"] = min_count
        return {
            "apiVersion": KUEUE_API,
            "kind": "Workload",
            "metadata": {
                "name": name,
                "namespace": self.ns,
                "ownerReferences": [owner],
                "annotations": annotations or {},
            },
            "spec": {
                "queueName": self.kueue.local_queue,
                # The owner resolves the class to its value itself: Kueue's webhook does not
                # (the CRD only insists that priority is set when priorityClassRef is).
                "priorityClassRef": {
                    "group": KUEUE_GROUP,
                    "kind": "WorkloadPriorityClass",
                    "name": priority,
                },
                "priority": self.kueue.priorities[priority],
                "podSets": [pod_set],
            },
        }

    def create(self, name: str, owner: dict[str, Any], **kw: Any) -> dict[str, Any]:
        return self.api.create_namespaced_custom_object(
            KUEUE_GROUP, KUEUE_VERSION, self.ns, "workloads", self.manifest(name, owner, **kw)
        )

    def get(self, name: str) -> dict[str, Any]:
        return self.api.get_namespaced_custom_object(
            KUEUE_GROUP, KUEUE_VERSION, self.ns, "workloads", name
        )

    def exists(self, name: str) -> bool:
        try:
            self.get(name)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def delete(self, name: str) -> None:
        self.api.delete_namespaced_custom_object(
            KUEUE_GROUP, KUEUE_VERSION, self.ns, "workloads", name
        )

    def patch_status(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.api.patch_namespaced_custom_object_status(
            KUEUE_GROUP, KUEUE_VERSION, self.ns, "workloads", name, body, _content_type=MERGE
        )

    def is_true(self, name: str, kind: str) -> dict[str, Any] | None:
        wl = self.get(name)
        cond = condition(wl, kind)
        return wl if cond is not None and cond["status"] == "True" else None

    def reserved(self, name: str) -> dict[str, Any] | None:
        return self.is_true(name, "QuotaReserved")

    def wait_reserved(self, name: str) -> dict[str, Any]:
        return eventually(f"Workload {self.ns}/{name} QuotaReserved", lambda: self.reserved(name))

    def stays_unreserved(self, name: str, seconds: float = 3.0) -> None:
        """Kueue's scheduler runs a cycle per change: a few seconds without a reservation after
        the change that could have admitted it is a refusal."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            assert self.reserved(name) is None, f"{name} was admitted: {self.get(name)['status']}"
            time.sleep(0.25)


def assigned(wl: dict[str, Any]) -> int:
    return wl["status"]["admission"]["podSetAssignments"][0]["count"]


def cq_status(kueue: Kueue, client: kubernetes.client.ApiClient) -> dict[str, Any]:
    cq = kubernetes.client.CustomObjectsApi(client).get_cluster_custom_object(
        KUEUE_GROUP, KUEUE_VERSION, "clusterqueues", kueue.cluster_queue
    )
    return cq.get("status") or {}


def reserved_cpu(kueue: Kueue, client: kubernetes.client.ApiClient) -> str:
    status = cq_status(kueue, client)
    for flavor in status.get("flavorsReservation") or []:
        for res in flavor["resources"]:
            if res["name"] == "cpu":
                return res["total"]
    return "0"


def reserving_elsewhere(kueue: Kueue, client: kubernetes.client.ApiClient) -> list[str]:
    """Workloads of any namespace holding quota in the session ClusterQueue."""
    items = kubernetes.client.CustomObjectsApi(client).list_cluster_custom_object(
        KUEUE_GROUP, KUEUE_VERSION, "workloads"
    )["items"]
    return [
        f"{wl['metadata']['namespace']}/{wl['metadata']['name']}"
        for wl in items
        if ((wl.get("status") or {}).get("admission") or {}).get("clusterQueue")
        == kueue.cluster_queue
        and (condition(wl, "QuotaReserved") or {}).get("status") == "True"
    ]


@pytest.fixture
def wls(control_plane: ControlPlane, kueue: Kueue, kueue_namespace: str) -> Iterator[Workloads]:
    """Workloads in a fresh namespace, once no Workload anywhere holds quota in the shared
    ClusterQueue; its Workloads are deleted (and gone) before its namespace is. Seen once: a
    pending Workload was not retried for 120 s after an admitted one went away with its
    namespace (its LocalQueue deleted first), so no test leaves that to namespace deletion."""
    with control_plane.api_client() as client:
        eventually(
            "no Workload reserving quota in the ClusterQueue",
            lambda: not reserving_elsewhere(kueue, client),
            timeout=120,
        )
        wls = Workloads(client, kueue_namespace, kueue)
        try:
            yield wls
        finally:
            api = wls.api
            for wl in api.list_namespaced_custom_object(
                KUEUE_GROUP, KUEUE_VERSION, wls.ns, "workloads"
            )["items"]:
                with contextlib.suppress(ApiException):
                    wls.delete(wl["metadata"]["name"])
            eventually(
                "the test's Workloads deleted",
                lambda: (
                    not api.list_namespaced_custom_object(
                        KUEUE_GROUP, KUEUE_VERSION, wls.ns, "workloads"
                    )["items"]
                ),
                timeout=60,
            )


# ------------------------------------------------------------------------------------ fact 1
def test_direct_workload_is_partially_admitted_and_left_alone(
    wls: Workloads, kueue: Kueue, control_plane: ControlPlane
) -> None:
    """A Workload owned by a kind that is no Kueue integration: admitted at the count that fits
    (3 asked, minCount 1, quota for 2); Kueue adds no finalizer and no label, and the
    ownerReference alone ties its life to the owner (garbage collection frees the quota)."""
    owner = wls.owner("tj")
    wls.create("tj", owner, count=3, min_count=1)
    wl = wls.wait_reserved("tj")
    assert assigned(wl) == 2
    assert wl["status"]["admission"]["podSetAssignments"][0]["resourceUsage"]["cpu"] == "2"
    assert wls.is_true("tj", "Admitted"), "no admission checks: Admitted follows the reservation"
    assert not wl["metadata"].get("finalizers"), wl["metadata"].get("finalizers")
    assert not wl["metadata"].get("labels"), wl["metadata"].get("labels")
    assert [r["uid"] for r in wl["metadata"]["ownerReferences"]] == [owner["uid"]]
    # A while later Kueue still has not touched the spec or finished/evicted it (no orphan
    # handling for an owner kind it does not know).
    time.sleep(2)
    later = wls.get("tj")
    assert later["spec"]["podSets"][0]["count"] == 3
    assert later["metadata"]["generation"] == wl["metadata"]["generation"]
    assert condition(later, "Finished") is None and condition(later, "Evicted") is None

    wls.core.delete_namespaced_config_map("tj", wls.ns)
    eventually("the Workload garbage-collected with its owner", lambda: not wls.exists("tj"))
    with control_plane.api_client() as client:
        eventually(
            "the quota released", lambda: reserved_cpu(kueue, client) in ("0", "0m"), timeout=30
        )


# ------------------------------------------------------------------------------------ fact 2
def _owner_identity(
    control_plane: ControlPlane, namespace: str, rules: list[dict[str, Any]]
) -> tuple[str, kubernetes.client.ApiClient]:
    """A user with exactly ``rules`` in ``namespace`` (a Role bound to it)."""
    user = f"elastic-owner-{uuid.uuid4().hex[:6]}"
    with control_plane.api_client() as admin:
        rbac_api = kubernetes.client.RbacAuthorizationV1Api(admin)
        rbac_api.create_namespaced_role(
            namespace, {"metadata": {"name": "workload-owner"}, "rules": rules}
        )
        rbac_api.create_namespaced_role_binding(
            namespace,
            {
                "metadata": {"name": "workload-owner"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                            "name": "workload-owner"},
                "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                              "name": user}],
            },
        )  # fmt: skip
    return user, api_client_from(control_plane.client_kubeconfig(user))


WORKLOAD_RULE = {
    "apiGroups": [KUEUE_GROUP],
    "resources": ["workloads"],
    "verbs": ["get", "list", "watch", "create", "patch", "delete"],
}
STATUS_RULE = {"apiGroups": [KUEUE_GROUP], "resources": ["workloads/status"], "verbs": ["patch"]}


def requeue_patch(wl: dict[str, Any], now: str) -> dict[str, Any]:
    """The owner's write once its attempt is stopped: what Kueue's job reconciler writes for an
    integration (jobframework step 6: workload.SetRequeuedCondition +
    UnsetQuotaReservationWithCondition), as a JSON merge patch of the status subresource. A merge
    patch replaces the whole conditions list, so the list is sent in full; resourceVersion makes
    it conditional (a concurrent Kueue write gives 409 and the owner re-reads)."""
    evicted = condition(wl, "Evicted")
    assert evicted is not None
    replaced = {
        "QuotaReserved": {"status": "False", "reason": "Pending", "message": evicted["message"]},
        "Admitted": {"status": "False", "reason": "NoReservation",
                     "message": "The workload has no reservation"},
        "Requeued": {"status": "True", "reason": evicted["reason"],
                     "message": evicted["message"]},
    }  # fmt: skip
    conditions = []
    for cond in wl["status"]["conditions"]:
        new = replaced.pop(cond["type"], None)
        if new is None:
            conditions.append(cond)
        else:
            changed = new["status"] != cond["status"]
            conditions.append(
                {
                    **cond,
                    **new,
                    "lastTransitionTime": now if changed else cond["lastTransitionTime"],
                }
            )
    for kind, new in replaced.items():
        conditions.append({"type": kind, **new, "lastTransitionTime": now,
                           "observedGeneration": wl["metadata"]["generation"]})  # fmt: skip
    return {
        "metadata": {"resourceVersion": wl["metadata"]["resourceVersion"]},
        "status": {"admission": None, "conditions": conditions},
    }


def test_evicted_workload_requeues_in_place_and_keeps_its_queue_position(
    wls: Workloads, kueue: Kueue, control_plane: ControlPlane
) -> None:
    """Preempted by a higher class, the Workload holds its quota until its owner clears the
    reservation (Kueue does not do it for an unknown owner kind); after the owner's status write
    the same Workload requeues with its creationTimestamp and, once the preemptor is gone, is
    admitted (partially) before an equal-priority Workload created after it."""
    user, owner_client = _owner_identity(control_plane, wls.ns, [WORKLOAD_RULE])
    with owner_client:
        as_owner = Workloads(owner_client, wls.ns, kueue)
        tj = wls.owner("tj")
        created = as_owner.create("tj", tj, count=3, min_count=1)  # the owner's RBAC suffices
        assert assigned(wls.wait_reserved("tj")) == 2

        wls.create("high", wls.owner("high"), count=2, priority="high")
        evicted = eventually("tj Evicted", lambda: wls.is_true("tj", "Evicted"))
        cond = condition(evicted, "Evicted")
        assert cond is not None and cond["reason"] == "Preempted", cond
        assert condition(evicted, "Preempted")["status"] == "True"
        # Kueue only marks it: the reservation and admission stay until the owner acts.
        assert wls.reserved("tj") and evicted["status"].get("admission")
        wls.stays_unreserved("high")

        wl = wls.get("tj")
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        with pytest.raises(ApiException) as refused:
            as_owner.patch_status("tj", requeue_patch(wl, now))
        assert refused.value.status == 403, "workloads/status patch is a separate grant"
        with control_plane.api_client() as admin:
            kubernetes.client.RbacAuthorizationV1Api(admin).patch_namespaced_role(
                "workload-owner", wls.ns, {"rules": [WORKLOAD_RULE, STATUS_RULE]}
            )

        def requeue() -> dict[str, Any] | None:
            try:
                return as_owner.patch_status("tj", requeue_patch(wls.get("tj"), now))
            except ApiException as exc:
                if exc.status in (403, 409):  # RBAC cache; Kueue wrote meanwhile
                    return None
                raise

        patched = eventually("the owner's requeue write accepted", requeue, timeout=30)
        assert "admission" not in patched["status"]
        assert condition(patched, "QuotaReserved")["status"] == "False"

        high = wls.wait_reserved("high")  # the quota is free only now
        assert assigned(high) == 2
        time.sleep(1.1)  # creationTimestamp has 1 s resolution: "later" must be visible
        wls.create("later", wls.owner("later"), count=2, min_count=1)
        wls.stays_unreserved("tj", 2)
        wls.stays_unreserved("later", 0.5)

        wls.delete("high")
        readmitted = wls.wait_reserved("tj")
        assert assigned(readmitted) == 2
        wls.stays_unreserved("later")
        assert readmitted["metadata"]["uid"] == created["metadata"]["uid"]
        assert (
            readmitted["metadata"]["creationTimestamp"] == created["metadata"]["creationTimestamp"]
        )
        assert (
            readmitted["metadata"]["creationTimestamp"]
            < wls.get("later")["metadata"]["creationTimestamp"]
        )
        # Kueue's own reservation resets Evicted and Preempted.
        assert condition(readmitted, "Evicted")["status"] == "False"
        assert condition(readmitted, "Preempted")["status"] == "False"
        assert user


def test_a_new_workload_per_attempt_queues_behind_later_ones(wls: Workloads) -> None:
    """Today's behaviour, for contrast: each attempt is a new Workload, so a job whose attempt
    ended while a same-priority Workload was created queues behind that one."""
    tj = wls.owner("tj")
    wls.create("high", wls.owner("high"), count=2, priority="high")
    wls.wait_reserved("high")
    first = wls.create("tj-attempt-1", tj, count=2, min_count=1)
    time.sleep(1.1)  # creationTimestamp has 1 s resolution
    later = wls.create("later", wls.owner("later"), count=2, min_count=1)
    wls.delete("tj-attempt-1")  # the attempt ends; the next attempt is a new Workload
    time.sleep(1.1)
    second = wls.create("tj-attempt-2", tj, count=2, min_count=1)
    created = [w["metadata"]["creationTimestamp"] for w in (first, later, second)]
    assert created == sorted(created) and len(set(created)) == 3, created

    wls.delete("high")
    assert assigned(wls.wait_reserved("later")) == 2
    wls.stays_unreserved("tj-attempt-2")


# ------------------------------------------------------------------------------------ fact 3
def test_replacement_slice_grows_counting_the_old_slice(
    wls: Workloads, kueue: Kueue, control_plane: ControlPlane
) -> None:
    """An elastic Workload (count 1) and a blocker fill the quota; a replacement slice of count 2
    waits, and is admitted when the blocker goes: only 1 CPU more was needed (the old slice's
    CPU counts), and Kueue finishes the old slice with WorkloadSliceReplaced."""
    tj = wls.owner("tj")
    wls.create("blocker", wls.owner("blocker"), count=1)
    wls.wait_reserved("blocker")
    wls.create("tj-1", tj, count=1, annotations={ELASTIC: "true"})
    wls.wait_reserved("tj-1")

    wls.create(
        "tj-2", tj, count=2, annotations={ELASTIC: "true", REPLACEMENT_FOR: f"{wls.ns}/tj-1"}
    )
    wls.stays_unreserved("tj-2")
    assert wls.reserved("tj-1") and condition(wls.get("tj-1"), "Finished") is None

    wls.delete("blocker")
    grown = wls.wait_reserved("tj-2")
    assert assigned(grown) == 2
    old = eventually("tj-1 Finished", lambda: wls.is_true("tj-1", "Finished"))
    assert condition(old, "Finished")["reason"] == "WorkloadSliceReplaced"
    assert condition(old, "Evicted") is None, "replaced, not preempted"
    with control_plane.api_client() as client:
        eventually(
            "the ClusterQueue reserving 2 CPU for the grown slice only",
            lambda: (
                (reserved_cpu(kueue, client), cq_status(kueue, client)["reservingWorkloads"])
                == ("2", 1)
            ),
            timeout=30,
        )


def test_partial_admission_and_the_elastic_annotation_are_refused_together(
    wls: Workloads,
) -> None:
    """Kueue's Workload webhook refuses minCount on a Workload annotated elastic-job, on create
    and when the annotation is added later."""
    tj = wls.owner("tj")
    with pytest.raises(ApiException) as refused:
        wls.create("tj-2", tj, count=3, min_count=1, annotations={ELASTIC: "true"})
    assert "partial admission and elastic job cannot be used together" in refused.value.body

    wls.create("tj", tj, count=3, min_count=1)
    with pytest.raises(ApiException) as refused:
        wls.api.patch_namespaced_custom_object(
            KUEUE_GROUP, KUEUE_VERSION, wls.ns, "workloads", "tj",
            {"metadata": {"annotations": {ELASTIC: "true"}}}, _content_type=MERGE,
        )  # fmt: skip
    assert "partial admission and elastic job cannot be used together" in refused.value.body


def test_replacement_without_elastic_annotation_is_partially_admitted(
    wls: Workloads, kueue: Kueue, control_plane: ControlPlane
) -> None:
    """The scheduler reads only the replacement-for annotation (the webhook only elastic-job):
    a partially admitted Workload (minCount, no elastic-job) and a replacement of it with minCount
    and no elastic-job. The replacement is admitted at the size that fits counting the old
    slice, and the old one is finished."""
    tj = wls.owner("tj")
    wls.create("blocker", wls.owner("blocker"), count=1)
    wls.wait_reserved("blocker")
    wls.create("tj-1", tj, count=3, min_count=1)
    assert assigned(wls.wait_reserved("tj-1")) == 1
    wls.delete("blocker")
    eventually("the blocker gone", lambda: not wls.exists("blocker"))
    with control_plane.api_client() as client:
        eventually("1 CPU reserved", lambda: reserved_cpu(kueue, client) == "1", timeout=30)

    wls.create("tj-2", tj, count=3, min_count=1, annotations={REPLACEMENT_FOR: f"{wls.ns}/tj-1"})
    grown = wls.wait_reserved("tj-2")
    assert assigned(grown) == 2
    old = eventually("tj-1 Finished", lambda: wls.is_true("tj-1", "Finished"))
    assert condition(old, "Finished")["reason"] == "WorkloadSliceReplaced"
    with control_plane.api_client() as client:
        eventually(
            "the ClusterQueue reserving 2 CPU",
            lambda: (
                (reserved_cpu(kueue, client), cq_status(kueue, client)["reservingWorkloads"])
                == ("2", 1)
            ),
            timeout=30,
        )
