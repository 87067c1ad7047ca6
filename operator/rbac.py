"""Exactly the API access the operator uses (the Helm chart's RBAC is built from this list; the
cluster tests run the operator with a ClusterRole made of these rules), the admission policy that
narrows the operator's cluster-wide writes to its own objects, and the roles that aggregate
TrainingJob access into the built-in edit/admin/view ClusterRoles.

``python -m preemptible_operator.rbac --write`` regenerates the chart's copy of the policy and
the user roles (charts/preemptible/files/generated-access.json); ``--check`` exits 1 when it
drifts (tests/unit/operator/test_rbac_rules.py runs the same check).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from preemptible_operator import models, node_notice, render
from preemptible_operator.classify import DEACTIVATED_BY_OPERATOR_ANNOTATION
from preemptible_operator.victims import BOOST_ANNOTATION

__all__ = [
    "ACCESS_FILE",
    "CLUSTER_RULES",
    "NAMESPACED_RULES",
    "POLICY_VALIDATIONS",
    "admission_policy",
    "admission_policy_binding",
    "chart_access",
    "cluster_role",
    "service_account_username",
    "user_roles",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
ACCESS_FILE = REPO_ROOT / "charts" / "preemptible" / "files" / "generated-access.json"

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
    # Events on TrainingJobs (ours and kopf's warnings); list: the Job controller's FailedCreate
    # Events on an attempt's Job tell why its pods are refused (quota, Pod Security Admission).
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "list"]},
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
    # Priority class values bound the checkpoint-aware priority boost (priority_classes.py):
    # a boost never lifts a Workload level with the next higher class.
    {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloadpriorityclasses"], "verbs": ["list"]},
    {"apiGroups": ["scheduling.k8s.io"], "resources": ["priorityclasses"], "verbs": ["list"]},
]


def cluster_role(name: str = "preemptible-operator") -> dict[str, Any]:
    """A ClusterRole with every rule (for a cluster-wide operator)."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": [*NAMESPACED_RULES, *CLUSTER_RULES],
    }


# ----------------------------------------------------------------------------- user roles
# Labels the clusterrole-aggregation controller (kube-controller-manager) looks for: the rules of
# every ClusterRole carrying one are folded into the built-in admin/edit/view ClusterRoles, so a
# user bound to `edit` in a namespace can manage that namespace's TrainingJobs.
AGGREGATE_TO_ADMIN = "rbac.authorization.k8s.io/aggregate-to-admin"
AGGREGATE_TO_EDIT = "rbac.authorization.k8s.io/aggregate-to-edit"
AGGREGATE_TO_VIEW = "rbac.authorization.k8s.io/aggregate-to-view"

_READ = ["get", "list", "watch"]
EDIT_RULES: list[dict[str, Any]] = [
    {
        "apiGroups": [models.GROUP],
        "resources": [models.PLURAL],
        "verbs": [*_READ, "create", "update", "patch", "delete", "deletecollection"],
    },
    # Status is the operator's to write; users read it (kubectl get/describe, dashboards).
    {"apiGroups": [models.GROUP], "resources": [f"{models.PLURAL}/status"], "verbs": _READ},
]
VIEW_RULES: list[dict[str, Any]] = [
    {
        "apiGroups": [models.GROUP],
        "resources": [models.PLURAL, f"{models.PLURAL}/status"],
        "verbs": _READ,
    },
]


def user_roles(prefix: str = "preemptible") -> list[dict[str, Any]]:
    """``<prefix>-edit`` (aggregated into admin and edit) and ``<prefix>-view`` (into view)."""

    def role(name: str, labels: list[str], rules: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": name, "labels": dict.fromkeys(labels, "true")},
            "rules": rules,
        }

    return [
        role(f"{prefix}-edit", [AGGREGATE_TO_ADMIN, AGGREGATE_TO_EDIT], EDIT_RULES),
        role(f"{prefix}-view", [AGGREGATE_TO_VIEW], VIEW_RULES),
    ]


# ----------------------------------------------------------------------- admission policy
# RBAC cannot say "only this finalizer" or "only pods of TrainingJobs": serving every namespace,
# the operator holds pods patch/delete, jobs create/delete and workloads patch cluster-wide. This
# ValidatingAdmissionPolicy (admissionregistration.k8s.io/v1, Kubernetes >= 1.30) holds the
# operator's ServiceAccount to exactly the writes it makes: see docs/install.md.

_LABEL = render.LABEL_TRAINING_JOB
_FINALIZER = render.ATTEMPT_FINALIZER
_NOTICE = node_notice.ANNOTATION_NODE_NOTICE


def _unchanged(*fields: str) -> str:
    """CEL: these metadata fields of the object equal the stored object's (absent = empty)."""
    empty = {"labels": "{}", "annotations": "{}"}
    return " && ".join(
        f"object.metadata.?{f}.orValue({empty.get(f, '[]')}) == "
        f"oldObject.metadata.?{f}.orValue({empty.get(f, '[]')})"
        for f in fields
    )


def _unchanged_except(field: str, keys: tuple[str, ...]) -> str:
    """CEL: the map ``field`` of metadata equals the stored one except for ``keys``."""
    new, old = (
        f"object.metadata.?{field}.orValue({{}})",
        f"oldObject.metadata.?{field}.orValue({{}})",
    )
    allowed = "[" + ", ".join(f"'{k}'" for k in keys) + "]"
    return (
        f"{new}.all(k, k in {allowed} || (k in {old} && {new}[k] == {old}[k])) && "
        f"{old}.all(k, k in {allowed} || k in {new})"
    )


# What the operator writes on a Workload besides spec.active: its deactivation mark and the
# checkpoint-aware priority boost (victims.py).
_WORKLOAD_ANNOTATIONS = (DEACTIVATED_BY_OPERATOR_ANNOTATION, BOOST_ANNOTATION)


POLICY_MATCH_CONSTRAINTS: dict[str, Any] = {
    "resourceRules": [
        {
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "resources": ["pods"],
            "operations": ["UPDATE", "DELETE"],
        },
        {
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "resources": ["services"],
            "operations": ["CREATE", "UPDATE", "DELETE"],
        },
        {
            "apiGroups": ["batch"],
            "apiVersions": ["v1"],
            "resources": ["jobs"],
            "operations": ["CREATE", "UPDATE", "DELETE"],
        },
        {
            "apiGroups": ["kueue.x-k8s.io"],
            "apiVersions": ["*"],
            "resources": ["workloads"],
            "operations": ["UPDATE", "DELETE"],
        },
    ]
}

POLICY_VARIABLES: list[dict[str, str]] = [
    # The object the request acts on: the stored one for a delete (object is null then).
    {
        "name": "target",
        "expression": "request.operation == 'DELETE' ? oldObject : object",
    },
    # Rendered by the operator: pods (through the Job's template), Jobs and the Service carry it.
    {
        "name": "labelled",
        "expression": f"'{_LABEL}' in variables.target.metadata.?labels.orValue({{}})",
    },
    {
        "name": "ownedByTrainingJob",
        "expression": (
            "variables.target.metadata.?ownerReferences.orValue([]).exists(r, "
            f"r.kind == '{models.KIND}' && r.apiVersion.startsWith('{models.GROUP}/'))"
        ),
    },
]

POLICY_VALIDATIONS: list[dict[str, str]] = [
    # Pod patches: only the removal of the attempt-record finalizer once the pod's outcome is
    # recorded, or the node-notice annotation on a training pod (node_notice.py). Spec, labels,
    # owners, every other annotation and every other finalizer stay as they are.
    {
        "expression": (
            "request.resource.resource != 'pods' || request.operation != 'UPDATE' || ("
            "object.spec == oldObject.spec && "
            + _unchanged("labels", "ownerReferences")
            + " && (("
            + _unchanged("annotations")
            + " && object.metadata.?finalizers.orValue([]) == "
            f"oldObject.metadata.?finalizers.orValue([]).filter(f, f != '{_FINALIZER}')"
            ") || (variables.labelled && "
            + _unchanged("finalizers")
            + " && "
            + _unchanged_except("annotations", (_NOTICE,))
            + ")))"
        ),
        "message": (
            f"the preemptible operator may only remove its finalizer {_FINALIZER} from a pod, "
            f"or set {_NOTICE} on a pod labelled {_LABEL}"
        ),
        "reason": "Forbidden",
    },
    # Pod deletes (graceful stop of a suspended TrainingJob's pods): training pods only.
    {
        "expression": (
            "request.resource.resource != 'pods' || request.operation != 'DELETE' || "
            "variables.labelled"
        ),
        "message": f"the preemptible operator may only delete pods labelled {_LABEL}",
        "reason": "Forbidden",
    },
    # Jobs and Services: created for a TrainingJob (its label and a TrainingJob owner reference,
    # so garbage collection removes them with it); deleted or changed only when they are such.
    {
        "expression": (
            "!(request.resource.resource in ['jobs', 'services']) || "
            "(variables.labelled && variables.ownedByTrainingJob && "
            "(request.operation != 'UPDATE' || "
            f"'{_LABEL}' in oldObject.metadata.?labels.orValue({{}})))"
        ),
        "message": (
            f"the preemptible operator may only write Jobs and Services labelled {_LABEL} "
            f"and owned by a {models.KIND}"
        ),
        "reason": "Forbidden",
    },
    # Kueue Workloads of batch Jobs (Kueue created them for attempt Jobs): only deactivation
    # (spec.active may go to false, nothing else in spec changes) and the operator's two
    # annotations (its deactivation mark, the priority boost); never a delete.
    {
        "expression": (
            "request.resource.resource != 'workloads' || (request.operation == 'UPDATE' && "
            "oldObject.metadata.?ownerReferences.orValue([]).exists(r, "
            "r.kind == 'Job' && r.apiVersion == 'batch/v1') && "
            "(object.spec.?active.orValue(true) == false || "
            "object.spec.?active.orValue(true) == oldObject.spec.?active.orValue(true)) && "
            "object.spec.all(k, k == 'active' || (k in oldObject.spec && "
            "object.spec[k] == oldObject.spec[k])) && "
            "oldObject.spec.all(k, k == 'active' || k in object.spec) && "
            + _unchanged_except("annotations", _WORKLOAD_ANNOTATIONS)
            + " && "
            + _unchanged("labels", "ownerReferences", "finalizers")
            + ")"
        ),
        "message": (
            "the preemptible operator may only deactivate (spec.active=false) a batch Job's "
            "Kueue Workload and set its annotations " + ", ".join(_WORKLOAD_ANNOTATIONS)
        ),
        "reason": "Forbidden",
    },
]


def service_account_username(namespace: str, service_account: str) -> str:
    return f"system:serviceaccount:{namespace}:{service_account}"


def _match_condition(namespace: str, service_account: str) -> dict[str, str]:
    # Namespace and ServiceAccount names are DNS labels/subdomains: no quote can occur.
    username = service_account_username(namespace, service_account)
    return {
        "name": "operator-service-account",
        "expression": f"request.userInfo.username == '{username}'",
    }


def admission_policy(name: str, namespace: str, service_account: str) -> dict[str, Any]:
    """The ValidatingAdmissionPolicy for the operator running as ``namespace/service_account``."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": POLICY_MATCH_CONSTRAINTS,
            "matchConditions": [_match_condition(namespace, service_account)],
            "variables": POLICY_VARIABLES,
            "validations": POLICY_VALIDATIONS,
        },
    }


def admission_policy_binding(name: str, policy_name: str | None = None) -> dict[str, Any]:
    """Binds the policy cluster-wide (its match condition picks the operator's requests)."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {"policyName": policy_name or name, "validationActions": ["Deny"]},
    }


def chart_access() -> dict[str, Any]:
    """What the chart reads from files/generated-access.json (names and the ServiceAccount are
    the chart's own): the aggregated user roles' rules and the policy's match and checks."""
    return {
        "userRoles": {"edit": EDIT_RULES, "view": VIEW_RULES},
        "operatorPolicy": {
            "matchConstraints": POLICY_MATCH_CONSTRAINTS,
            "variables": POLICY_VARIABLES,
            "validations": POLICY_VALIDATIONS,
        },
    }


def render_access() -> str:
    return json.dumps(chart_access(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m preemptible_operator.rbac",
        description="Generate the chart's user roles and operator admission policy.",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help=f"rewrite {ACCESS_FILE.name}")
    group.add_argument("--check", action="store_true", help="fail when the file drifts")
    args = parser.parse_args(argv)
    text = render_access()
    if args.write:
        ACCESS_FILE.write_text(text, encoding="utf-8")
        print(f"wrote {ACCESS_FILE.relative_to(REPO_ROOT)}")
        return 0
    if args.check:
        if not ACCESS_FILE.exists() or ACCESS_FILE.read_text(encoding="utf-8") != text:
            print(f"{ACCESS_FILE} is stale: run python -m preemptible_operator.rbac --write")
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
