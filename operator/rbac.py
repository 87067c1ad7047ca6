"""Exactly the API access the operator uses (the Helm chart's RBAC is built from this list; the
cluster tests run the operator with a ClusterRole made of these rules)."""

from __future__ import annotations

from typing import Any

from preemptible_operator import models

__all__ = ["CLUSTER_RULES", "NAMESPACED_RULES", "cluster_role"]

# Rules that can be granted per namespace (a Role) when the operator watches given namespaces.
NAMESPACED_RULES: list[dict[str, Any]] = [
    # Watch TrainingJobs; patch for kopf's finalizer and bookkeeping annotations; delete a
    # finished one whose spec.ttlSecondsAfterFinished passed.
    {
        "apiGroups": [models.GROUP],
        "resources": [models.PLURAL],
        "verbs": ["get", "list", "watch", "patch", "delete"],
    },
    # Owner references on Jobs and the Service set blockOwnerDeletion: with the
    # OwnerReferencesPermissionEnforcement admission plugin (OpenShift) that needs update on
    # the owner's finalizers subresource, or every create is refused.
    {
        "apiGroups": [models.GROUP],
        "resources": [f"{models.PLURAL}/finalizers"],
        "verbs": ["update"],
    },
    # The status subresource is written once per reconcile pass (PUT with resourceVersion).
    {
        "apiGroups": [models.GROUP],
        "resources": [f"{models.PLURAL}/status"],
        "verbs": ["get", "update"],
    },
    # One Job per attempt: created, watched, deleted once the attempt is recorded.
    {
        "apiGroups": ["batch"],
        "resources": ["jobs"],
        "verbs": ["get", "list", "watch", "create", "delete"],
    },
    # Pods: watched; patched to remove the attempt-record finalizer; deleted on user suspend.
    {
        "apiGroups": [""],
        "resources": ["pods"],
        "verbs": ["get", "list", "watch", "patch", "delete"],
    },
    # The headless rendezvous Service: created once; on AlreadyExists read to check it is
    # ours (one left by a deleted TrainingJob of the same name is left to garbage collection).
    {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "create"]},
    # Events on TrainingJobs (ours and kopf's warnings).
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    # Kueue Workloads: watched (a cache by job-uid label) to tell eviction from failure,
    # patched to deactivate (spec.active=false) an interrupted attempt.
    {
        "apiGroups": ["kueue.x-k8s.io"],
        "resources": ["workloads"],
        "verbs": ["get", "list", "watch", "patch"],
    },
]

# Cluster-scoped reads: node readiness for node-loss detection (without it a 403 counts as ready
# and the operator relies on pod conditions), and namespaces and CRDs for kopf.
CLUSTER_RULES: list[dict[str, Any]] = [
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
    # kopf follows namespaces (given --namespace) and CRDs (resources appearing/disappearing).
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
    {
        "apiGroups": ["apiextensions.k8s.io"],
        "resources": ["customresourcedefinitions"],
        "verbs": ["list", "watch"],
    },
]


def cluster_role(name: str = "preemptible-operator") -> dict[str, Any]:
    """A ClusterRole with every rule (for a cluster-wide operator)."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": [*NAMESPACED_RULES, *CLUSTER_RULES],
    }
