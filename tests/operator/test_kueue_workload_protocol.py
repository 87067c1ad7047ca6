"""The Kueue protocol that the elastic design (docs/elastic.md, option 3) rests on, run on the real
control plane with Kueue v0.19.2 (tests/cluster/kueue.py: the session ClusterQueue, 2 CPU of
quota, "low" = 100 and "high" = 1000). Only Workloads are created, directly, by the test playing
the operator's part with the operator's own building blocks (preemptible_operator.workload:
render_workload, render_replacement, clear_reservation_patch, finished_patch, admitted_size,
eviction): each Workload's owner is a real TrainingJob (the CRD installed, no operator running).
No pod runs.

Each pod of a pod set asks for 1 CPU (the TrainingJob's resourcesPerNode), so the ClusterQueue
holds 2 pods.
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

from preemptible_operator import models, render
from preemptible_operator import workload as wlib
from tests.cluster.controlplane import ControlPlane
from tests.cluster.helpers import condition, eventually
from tests.cluster.kubeconfig import api_client_from
from tests.cluster.kueue import KUEUE_GROUP, KUEUE_VERSION, Kueue

pytestmark = [pytest.mark.cluster, pytest.mark.kueue]

ELASTIC = "kueue.x-k8s.io/elastic-job"
REPLACEMENT_FOR = wlib.ANNOTATION_REPLACEMENT_FOR
MERGE = wlib.MERGE_PATCH
PARAMS = render.AttemptParams(attempt=1, grace_seconds=30, resume_from="", suspended=False)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class Workloads:
    """Workloads of one namespace through one identity (admin unless told otherwise)."""

    def __init__(self, client: kubernetes.client.ApiClient, namespace: str, kueue: Kueue) -> None:
        self.api = kubernetes.client.CustomObjectsApi(client)
        self.core = kubernetes.client.CoreV1Api(client)
        self.ns = namespace
        self.kueue = kueue

    def owner(self, name: str, priority: str = "low") -> dict[str, Any]:
        """A TrainingJob (no operator runs: it only owns Workloads); its metadata and spec."""
        body = {
            "apiVersion": models.API_VERSION,
            "kind": models.KIND,
            "metadata": {"name": name, "namespace": self.ns},
            "spec": {
                "image": "unused",
                "command": ["python", "-c", "pass"],
                "checkpoint": {"uri": "/ckpt/unused"},
                "resourcesPerNode": {"requests": {"cpu": "1"}},
                "queueName": self.kueue.local_queue,
                "priorityClass": priority,
            },
        }
        return self.api.create_namespaced_custom_object(
            models.GROUP, models.VERSION, self.ns, models.PLURAL, body
        )

    def delete_owner(self, name: str) -> None:
        self.api.delete_namespaced_custom_object(
            models.GROUP, models.VERSION, self.ns, models.PLURAL, name
        )

    def manifest(
        self,
        owner: dict[str, Any],
        *,
        count: int,
        min_count: int | None = None,
        name: str | None = None,
        annotations: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """The operator's Workload for ``owner`` (workload.render_workload); ``name`` renames it
        (today's per-attempt Workloads), ``annotations`` are added (Kueue's elastic-job)."""
        spec = models.parse_spec(owner["spec"])
        assert spec.priority_class is not None
        # The owner resolves the class to its value itself: Kueue's webhook does not (the CRD
        # only insists that priority is set when priorityClassRef is).
        manifest = wlib.render_workload(
            owner["metadata"],
            spec,
            PARAMS,
            min_nodes=min_count or count,
            max_nodes=count,
            priority=self.kueue.priorities[spec.priority_class],
        )
        if name is not None:
            manifest["metadata"]["name"] = name
        manifest["metadata"]["annotations"].update(annotations or {})
        return manifest

    def create(self, owner: dict[str, Any], **kw: Any) -> dict[str, Any]:
        return self.create_manifest(self.manifest(owner, **kw))

    def create_manifest(self, manifest: dict[str, Any]) -> dict[str, Any]:
        return self.api.create_namespaced_custom_object(
            KUEUE_GROUP, KUEUE_VERSION, self.ns, wlib.WORKLOAD_PLURAL, manifest
        )

    def flavors(self) -> dict[str, dict[str, Any]]:
        items = self.api.list_cluster_custom_object(KUEUE_GROUP, KUEUE_VERSION, "resourceflavors")[
            "items"
        ]
        return {f["metadata"]["name"]: f for f in items}

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
def wls(
    control_plane: ControlPlane, kueue: Kueue, kueue_namespace: str, tj_crd: None
) -> Iterator[Workloads]:
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
    """The operator's Workload (render_workload), owned by a TrainingJob, a kind that is no Kueue
    integration: admitted at the count that fits (3 asked, minCount 1, quota for 2), which
    admitted_size reads with the flavor; Kueue adds no finalizer and no label, and the
    ownerReference alone ties its life to the owner (garbage collection frees the quota)."""
    tj = wls.owner("tj")
    name = wls.create(tj, count=3, min_count=1)["metadata"]["name"]
    assert name == wlib.workload_name("tj") == "tj-w1"
    wl = wls.wait_reserved(name)
    assert assigned(wl) == 2
    assert wl["status"]["admission"]["podSetAssignments"][0]["resourceUsage"]["cpu"] == "2"
    wl = eventually("Admitted", lambda: wls.is_true(name, "Admitted"))
    # no admission checks: Admitted follows the reservation
    assert wlib.admitted_size(wl, wls.flavors()) == wlib.Admission(
        count=2, node_selector={}, tolerations=[], flavors=(kueue.resource_flavor,)
    )
    assert wlib.eviction(wl) is None
    assert not wl["metadata"].get("finalizers"), wl["metadata"].get("finalizers")
    assert wl["metadata"]["labels"] == {render.LABEL_TRAINING_JOB: "tj"}, "ours only"
    (ref,) = wl["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["uid"], ref["controller"]) == (
        "TrainingJob",
        tj["metadata"]["uid"],
        True,
    )
    # A while later Kueue still has not touched the spec or finished/evicted it (no orphan
    # handling for an owner kind it does not know).
    time.sleep(2)
    later = wls.get(name)
    assert later["spec"]["podSets"][0]["count"] == 3
    assert later["metadata"]["generation"] == wl["metadata"]["generation"]
    assert condition(later, "Finished") is None and condition(later, "Evicted") is None

    wls.delete_owner("tj")
    eventually("the Workload garbage-collected with its owner", lambda: not wls.exists(name))
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


def test_evicted_workload_requeues_in_place_and_keeps_its_queue_position(
    wls: Workloads, kueue: Kueue, control_plane: ControlPlane
) -> None:
    """Preempted by a higher class, the Workload holds its quota until its owner clears the
    reservation (Kueue does not do it for an unknown owner kind); after the owner's status write
    (clear_reservation_patch) the same Workload requeues with its creationTimestamp and, once the
    preemptor is gone, is admitted (partially) before an equal-priority Workload created after
    it. At the end the owner's finished_patch releases the quota to that one."""
    user, owner_client = _owner_identity(control_plane, wls.ns, [WORKLOAD_RULE])
    with owner_client:
        as_owner = Workloads(owner_client, wls.ns, kueue)
        created = as_owner.create(wls.owner("tj"), count=3, min_count=1)  # the owner's RBAC
        name = created["metadata"]["name"]
        assert assigned(wls.wait_reserved(name)) == 2

        high = wls.create(wls.owner("high", "high"), count=2)["metadata"]["name"]
        evicted = eventually("tj Evicted", lambda: wls.is_true(name, "Evicted"))
        got = wlib.eviction(evicted)
        assert got is not None and got.reason == "Preempted", got
        assert got.message.startswith("Preempted to accommodate a workload"), got
        assert condition(evicted, "Preempted")["status"] == "True"
        # Kueue only marks it: the reservation and admission stay until the owner acts; the
        # owner starts no attempt on it.
        assert wls.reserved(name) and evicted["status"].get("admission")
        assert wlib.admitted_size(evicted, wls.flavors()) is None
        wls.stays_unreserved(high)

        now = _now()
        with pytest.raises(ApiException) as refused:
            as_owner.patch_status(name, wlib.clear_reservation_patch(wls.get(name), now))
        assert refused.value.status == 403, "workloads/status patch is a separate grant"
        with control_plane.api_client() as admin:
            kubernetes.client.RbacAuthorizationV1Api(admin).patch_namespaced_role(
                "workload-owner", wls.ns, {"rules": [WORKLOAD_RULE, STATUS_RULE]}
            )

        def write(patch: Any) -> Any:
            def attempt() -> dict[str, Any] | None:
                try:
                    return as_owner.patch_status(name, patch(wls.get(name)))
                except ApiException as exc:
                    if exc.status in (403, 409):  # RBAC cache; Kueue wrote meanwhile
                        return None
                    raise

            return attempt

        patched = eventually(
            "the owner's requeue write accepted",
            write(lambda wl: wlib.clear_reservation_patch(wl, now)),
            timeout=30,
        )
        assert "admission" not in patched["status"]
        assert condition(patched, "QuotaReserved")["status"] == "False"
        assert condition(patched, "Requeued")["reason"] == "Preempted"

        assert assigned(wls.wait_reserved(high)) == 2  # the quota is free only now
        time.sleep(1.1)  # creationTimestamp has 1 s resolution: "later" must be visible
        later = wls.create(wls.owner("later"), count=2, min_count=1)["metadata"]["name"]
        wls.stays_unreserved(name, 2)
        wls.stays_unreserved(later, 0.5)

        wls.delete(high)
        readmitted = wls.wait_reserved(name)
        assert assigned(readmitted) == 2
        wls.stays_unreserved(later)
        assert readmitted["metadata"]["uid"] == created["metadata"]["uid"]
        assert (
            readmitted["metadata"]["creationTimestamp"] == created["metadata"]["creationTimestamp"]
        )
        assert (
            readmitted["metadata"]["creationTimestamp"]
            < wls.get(later)["metadata"]["creationTimestamp"]
        )
        # Kueue's own reservation resets Evicted and Preempted.
        assert condition(readmitted, "Evicted")["status"] == "False"
        assert condition(readmitted, "Preempted")["status"] == "False"
        readmitted = eventually("Admitted again", lambda: wls.is_true(name, "Admitted"))
        admission = wlib.admitted_size(readmitted, wls.flavors())
        assert admission is not None and admission.count == 2

        # The training ends: Finished releases the quota (the Workload stays, admission and all).
        finished = eventually(
            "the owner's finished write accepted",
            write(lambda wl: wlib.finished_patch(wl, _now(), succeeded=True, message="done")),
            timeout=30,
        )
        assert condition(finished, "Finished")["reason"] == "Succeeded"
        assert assigned(wls.wait_reserved(later)) == 2
        assert wls.is_true(name, "Finished") and wlib.admitted_size(wls.get(name), {}) is None
        assert user


def test_a_new_workload_per_attempt_queues_behind_later_ones(wls: Workloads) -> None:
    """Today's behaviour, for contrast: each attempt is a new Workload, so a job whose attempt
    ended while a same-priority Workload was created queues behind that one."""
    tj = wls.owner("tj")
    wls.wait_reserved(wls.create(wls.owner("high", "high"), count=2)["metadata"]["name"])
    first = wls.create(tj, count=2, min_count=1, name="tj-attempt-1")
    time.sleep(1.1)  # creationTimestamp has 1 s resolution
    later = wls.create(wls.owner("later"), count=2, min_count=1)
    wls.delete("tj-attempt-1")  # the attempt ends; the next attempt is a new Workload
    time.sleep(1.1)
    second = wls.create(tj, count=2, min_count=1, name="tj-attempt-2")
    created = [w["metadata"]["creationTimestamp"] for w in (first, later, second)]
    assert created == sorted(created) and len(set(created)) == 3, created

    wls.delete("high-w1")
    assert assigned(wls.wait_reserved(later["metadata"]["name"])) == 2
    wls.stays_unreserved("tj-attempt-2")


# ------------------------------------------------------------------------------------ fact 3
def test_replacement_slice_grows_counting_the_old_slice(
    wls: Workloads, kueue: Kueue, control_plane: ControlPlane
) -> None:
    """An elastic Workload (count 1) and a blocker fill the quota; a replacement slice of count 2
    (render_replacement, plus Kueue's elastic-job annotation as an elastic batch Job's slices
    carry) waits, and is admitted when the blocker goes: only 1 CPU more was needed (the old
    slice's CPU counts), and Kueue finishes the old slice with WorkloadSliceReplaced."""
    tj = wls.owner("tj")
    blocker = wls.create(wls.owner("blocker"), count=1)["metadata"]["name"]
    wls.wait_reserved(blocker)
    wls.create(tj, count=1, annotations={ELASTIC: "true"})
    first = wls.wait_reserved("tj-w1")

    grow = wlib.render_replacement(first, current_nodes=1, max_nodes=2)
    assert "minCount" not in grow["spec"]["podSets"][0], "the next size is the full size"
    grow["metadata"]["annotations"][ELASTIC] = "true"
    assert wls.create_manifest(grow)["metadata"]["name"] == "tj-w2"
    wls.stays_unreserved("tj-w2")
    assert wls.reserved("tj-w1") and condition(wls.get("tj-w1"), "Finished") is None

    wls.delete(blocker)
    grown = wls.wait_reserved("tj-w2")
    assert assigned(grown) == 2
    old = eventually("tj-w1 Finished", lambda: wls.is_true("tj-w1", "Finished"))
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
        wls.create(tj, count=3, min_count=1, name="tj-2", annotations={ELASTIC: "true"})
    assert "partial admission and elastic job cannot be used together" in refused.value.body

    name = wls.create(tj, count=3, min_count=1)["metadata"]["name"]
    with pytest.raises(ApiException) as refused:
        wls.api.patch_namespaced_custom_object(
            KUEUE_GROUP, KUEUE_VERSION, wls.ns, "workloads", name,
            {"metadata": {"annotations": {ELASTIC: "true"}}}, _content_type=MERGE,
        )  # fmt: skip
    assert "partial admission and elastic job cannot be used together" in refused.value.body


def test_replacement_without_elastic_annotation_is_partially_admitted(
    wls: Workloads, kueue: Kueue, control_plane: ControlPlane
) -> None:
    """The scheduler reads only the replacement-for annotation (the webhook only elastic-job):
    the operator's Workload partially admitted (minCount, no elastic-job) and its grow
    (render_replacement: count 3, minCount 2, no elastic-job). The replacement is admitted at the
    size that fits counting the old slice, and the old one is finished."""
    tj = wls.owner("tj")
    blocker = wls.create(wls.owner("blocker"), count=1)["metadata"]["name"]
    wls.wait_reserved(blocker)
    wls.create(tj, count=3, min_count=1)
    first = wls.wait_reserved("tj-w1")
    assert assigned(first) == 1
    wls.delete(blocker)
    eventually("the blocker gone", lambda: not wls.exists(blocker))
    with control_plane.api_client() as client:
        eventually("1 CPU reserved", lambda: reserved_cpu(kueue, client) == "1", timeout=30)

    grow = wlib.render_replacement(first, current_nodes=1, max_nodes=3)
    assert grow["spec"]["podSets"][0]["minCount"] == 2
    assert grow["metadata"]["annotations"][REPLACEMENT_FOR] == f"{wls.ns}/tj-w1"
    wls.create_manifest(grow)
    grown = wls.wait_reserved("tj-w2")
    assert assigned(grown) == 2
    old = eventually("tj-w1 Finished", lambda: wls.is_true("tj-w1", "Finished"))
    assert condition(old, "Finished")["reason"] == "WorkloadSliceReplaced"
    grown = eventually("tj-w2 Admitted", lambda: wls.is_true("tj-w2", "Admitted"))
    admission = wlib.admitted_size(grown, wls.flavors())
    assert admission is not None and admission.count == 2
    with control_plane.api_client() as client:
        eventually(
            "the ClusterQueue reserving 2 CPU",
            lambda: (
                (reserved_cpu(kueue, client), cq_status(kueue, client)["reservingWorkloads"])
                == ("2", 1)
            ),
            timeout=30,
        )
