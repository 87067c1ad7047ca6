"""Exactly the API access the operator uses (the Helm chart's RBAC is built from this list; the
cluster tests run the operator with a ClusterRole made of these rules), the admission policies
that narrow the operator's writes to its own objects and its Jobs to what their TrainingJob asks
for, and the roles that aggregate TrainingJob access into the built-in edit/admin/view
ClusterRoles.

``python -m preemptible_operator.rbac --write`` regenerates the chart's copy of the policies and
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
from preemptible_operator.workload import ANNOTATION_SLICE

__all__ = [
    "ACCESS_FILE",
    "CLUSTER_RULES",
    "NAMESPACED_RULES",
    "POLICY_VALIDATIONS",
    "admission_policy",
    "admission_policy_binding",
    "boost_max_variable",
    "chart_access",
    "children_policy",
    "children_policy_binding",
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
    # patched to deactivate (spec.active=false) an interrupted attempt. An elastic TrainingJob's
    # own Workload (docs/elastic.md): created, and deleted when the job is suspended.
    {
        "apiGroups": ["kueue.x-k8s.io"],
        "resources": ["workloads"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    # Its status: the reservation released once an evicted attempt stopped (the same Workload
    # requeues), Finished when the training ends: what Kueue's job integration writes.
    {
        "apiGroups": ["kueue.x-k8s.io"],
        "resources": ["workloads/status"],
        "verbs": ["patch"],
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
    # get: an elastic job's Workload carries its class's value (Kueue does not fill it in).
    {
        "apiGroups": ["kueue.x-k8s.io"],
        "resources": ["workloadpriorityclasses"],
        "verbs": ["get", "list"],
    },
    # The admitted ResourceFlavors' node labels and tolerations go onto an elastic attempt's pods.
    {"apiGroups": ["kueue.x-k8s.io"], "resources": ["resourceflavors"], "verbs": ["get"]},
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
_SLICE = ANNOTATION_SLICE


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
# render.job_name: <TrainingJob>-a<attempt>; TrainingJob names are DNS-1035 labels.
_ATTEMPT_JOB_NAME = "^[a-z]([-a-z0-9]*[a-z0-9])?-a[0-9]+$"
# Every field of a TrainingJob's spec (the CRD's structural schema prunes any other).
_TRAINING_JOB_SPEC_FIELDS = tuple(
    f.alias or n for n, f in models.TrainingJobSpec.model_fields.items()
)


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
            "resources": ["workloads", "workloads/status"],
            "operations": ["CREATE", "UPDATE", "DELETE"],
        },
        # The main resource only: status and finalizers are subresources, not matched.
        {
            "apiGroups": [models.GROUP],
            "apiVersions": ["*"],
            "resources": [models.PLURAL],
            "operations": ["UPDATE", "DELETE"],
        },
    ]
}

# The boost band's top (operator.priorityBoost.max): the chart and admission_policy() put this
# variable first with the configured value.
BOOST_MAX_VARIABLE = "boostMax"

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
    # Kueue Workloads of attempt Jobs (Kueue created them for the Jobs named <TrainingJob>-a<N>):
    # only deactivation (spec.active may go to false, nothing else in spec changes) and the
    # operator's two annotations (its deactivation mark, the priority boost, a whole number in
    # [0, operator.priorityBoost.max]); never a delete.
    # An elastic TrainingJob's own Workload (docs/elastic.md, the slice annotation marks it):
    # created, its status written, deleted, only when labelled and owned by a TrainingJob, and
    # an update keeps its labels and owners.
    {
        "expression": (
            "request.resource.resource != 'workloads' || "
            f"!('{_SLICE}' in variables.target.metadata.?annotations.orValue({{}})) || "
            "(variables.labelled && variables.ownedByTrainingJob && "
            "(request.operation != 'UPDATE' || " + _unchanged("labels", "ownerReferences") + "))"
        ),
        "message": (
            f"the preemptible operator may only write Workloads carrying {_SLICE} when they are "
            f"labelled {_LABEL} and owned by a {models.KIND}, their labels and owners unchanged"
        ),
        "reason": "Forbidden",
    },
    {
        "expression": (
            "request.resource.resource != 'workloads' || "
            f"('{_SLICE}' in variables.target.metadata.?annotations.orValue({{}}) && "
            f"(request.operation != 'UPDATE' || '{_SLICE}' in "
            "oldObject.metadata.?annotations.orValue({}))) || "
            "(request.?subResource.orValue('') == '' && request.operation == 'UPDATE' && "
            "oldObject.metadata.?ownerReferences.orValue([]).exists(r, "
            "r.kind == 'Job' && r.apiVersion == 'batch/v1' && "
            f"r.name.matches('{_ATTEMPT_JOB_NAME}')) && "
            "(object.spec.?active.orValue(true) == false || "
            "object.spec.?active.orValue(true) == oldObject.spec.?active.orValue(true)) && "
            "object.spec.all(k, k == 'active' || (k in oldObject.spec && "
            "object.spec[k] == oldObject.spec[k])) && "
            "oldObject.spec.all(k, k == 'active' || k in object.spec) && "
            + _unchanged_except("annotations", _WORKLOAD_ANNOTATIONS)
            + " && "
            + _unchanged("labels", "ownerReferences", "finalizers")
            + f" && (!('{BOOST_ANNOTATION}' in object.metadata.?annotations.orValue({{}})) || "
            f"(object.metadata.annotations['{BOOST_ANNOTATION}'].matches('^[0-9]{{1,9}}$') && "
            f"int(object.metadata.annotations['{BOOST_ANNOTATION}']) <= "
            f"variables.{BOOST_MAX_VARIABLE})))"
        ),
        "message": (
            "the preemptible operator may only deactivate (spec.active=false) the Kueue Workload "
            "of an attempt Job (<TrainingJob>-a<N>) and set its annotations "
            + ", ".join(_WORKLOAD_ANNOTATIONS)
            + f" ({BOOST_ANNOTATION} a whole number from 0 to operator.priorityBoost.max)"
        ),
        "reason": "Forbidden",
    },
    # TrainingJobs: kopf's finalizer and bookkeeping annotations, and spec.suspend set to true
    # (a Workload deactivated by someone else); nothing else of the spec, labels or owners.
    # Deleted only once finished with spec.ttlSecondsAfterFinished set.
    {
        "expression": (
            f"request.resource.resource != '{models.PLURAL}' || "
            "(request.operation == 'UPDATE' && "
            + _unchanged("labels", "ownerReferences")
            + " && (object.spec == oldObject.spec || ("
            "object.spec.?suspend.orValue(false) == true && "
            + " && ".join(
                f"has(object.spec.{f}) == has(oldObject.spec.{f}) && "
                f"(!has(object.spec.{f}) || object.spec.{f} == oldObject.spec.{f})"
                for f in _TRAINING_JOB_SPEC_FIELDS
                if f != "suspend"
            )
            + "))) || (request.operation == 'DELETE' && "
            "has(oldObject.spec.ttlSecondsAfterFinished) && "
            "oldObject.?status.?phase.orValue('') in ['Succeeded', 'Failed'])"
        ),
        "message": (
            f"the preemptible operator may only change a {models.KIND}'s finalizers, "
            "annotations and spec.suspend (to true), and delete one that finished with "
            "spec.ttlSecondsAfterFinished set"
        ),
        "reason": "Forbidden",
    },
]


# ------------------------------------------------------------- children admission policy
# What the operator creates must be what a TrainingJob of that namespace asks for. CEL cannot look
# other objects up, but a binding's params can: this policy's params are the TrainingJobs of the
# request's namespace (paramRef with an empty selector and no namespace), evaluated once per
# TrainingJob, denied when there is none (parameterNotFoundAction: Deny). So a Job or Service is
# created only in a namespace that holds a TrainingJob, and when it names an existing
# TrainingJob as its owner, only as that TrainingJob asks: its service account, images, Secrets,
# ConfigMaps, volumes and host namespaces. The evaluations are ANDed, so none can prove that the
# owner a Job names exists (docs/install.md, "What holds").

_SHM = render.SHM_VOLUME
_NOTICE_VOLUME = render.NODE_NOTICE_VOLUME

# The TrainingJob's pod template override (spec.podTemplate.spec) and what it names.
_PT = "params.spec.?podTemplate.?spec.orValue({})"
_PT_CONTAINERS = f"({_PT}.?containers.orValue([]) + {_PT}.?initContainers.orValue([]))"
_TJ_VOLUMES = f"(params.spec.?volumes.orValue([]) + {_PT}.?volumes.orValue([]))"

# Where a pod spec names a Secret or ConfigMap: (envFrom key, env valueFrom key, volume source
# field holding the name, projected source key).
_REF_FIELDS = {
    "secret": ("secretRef", "secretKeyRef", "secretName"),
    "configMap": ("configMapRef", "configMapKeyRef", "name"),
}


def _ref_allowed(kind: str, name: str) -> str:
    """CEL: the TrainingJob ``params`` names the Secret/ConfigMap ``name`` somewhere: its
    credentials Secret, its env, its pod template's containers' env/envFrom, its volumes."""
    env_from, key_ref, volume_field = _REF_FIELDS[kind]
    own = (
        [f"{name} == params.spec.?checkpoint.?credentialsSecret.orValue('')"]
        if kind == "secret"
        else []
    )
    env = f"u.?valueFrom.?{key_ref}.?name.orValue('') == {name}"
    return (
        "("
        + " || ".join(
            [
                *own,
                f"params.spec.?env.orValue([]).exists(u, {env})",
                f"{_PT_CONTAINERS}.exists(c, "
                f"c.?envFrom.orValue([]).exists(u, u.?{env_from}.?name.orValue('') == {name}) || "
                f"c.?env.orValue([]).exists(u, {env}))",
                f"{_TJ_VOLUMES}.exists(u, u.?{kind}.?{volume_field}.orValue('') == {name} || "
                f"u.?projected.?sources.orValue([]).exists(s, "
                f"s.?{kind}.?name.orValue('') == {name}))",
            ]
        )
        + ")"
    )


# Volume sources other than emptyDir, downwardAPI, secret, configMap and persistentVolumeClaim:
# allowed only as a volume of the same name and the same source kind in the TrainingJob.
_OTHER_VOLUME_KINDS = (
    "hostPath", "projected", "csi", "ephemeral", "nfs", "iscsi", "rbd", "cephfs", "cinder",
    "fc", "flexVolume", "flocker", "glusterfs", "gcePersistentDisk", "awsElasticBlockStore",
    "azureDisk", "azureFile", "vsphereVolume", "quobyte", "portworxVolume", "scaleIO",
    "storageos", "photonPersistentDisk", "gitRepo", "image",
)  # fmt: skip


def _volume_allowed(v: str) -> str:
    same_kind = " && ".join(f"has({v}.{k}) == has(u.{k})" for k in _OTHER_VOLUME_KINDS)
    return (
        f"(has({v}.emptyDir) || has({v}.downwardAPI) || "
        f"(has({v}.secret) && {_ref_allowed('secret', f'{v}.secret.secretName')}) || "
        f"(has({v}.configMap) && {_ref_allowed('configMap', f'{v}.configMap.name')}) || "
        f"(has({v}.persistentVolumeClaim) && {_TJ_VOLUMES}.exists(u, "
        f"u.?persistentVolumeClaim.?claimName.orValue('') == "
        f"{v}.persistentVolumeClaim.claimName)) || "
        f"({_TJ_VOLUMES}.exists(u, u.?name.orValue('') == {v}.name && {same_kind} && "
        f"(!has({v}.hostPath) || u.?hostPath.?path.orValue('') == {v}.hostPath.path) && "
        f"(!has({v}.projected) || {v}.projected.sources.all(s, "
        f"(!has(s.secret) || {_ref_allowed('secret', 's.secret.name')}) && "
        f"(!has(s.configMap) || {_ref_allowed('configMap', 's.configMap.name')})))"
        "))"
        ")"
    )


def _container_allowed(c: str) -> str:
    secret_env = _ref_allowed("secret", "e.valueFrom.secretKeyRef.name")
    config_env = _ref_allowed("configMap", "e.valueFrom.configMapKeyRef.name")
    return (
        f"({c}.image in variables.allowedImages && "
        f"{c}.?envFrom.orValue([]).all(e, "
        f"(!has(e.secretRef) || {_ref_allowed('secret', 'e.secretRef.name')}) && "
        f"(!has(e.configMapRef) || {_ref_allowed('configMap', 'e.configMapRef.name')})) && "
        f"{c}.?env.orValue([]).all(e, !has(e.valueFrom) || ("
        f"(!has(e.valueFrom.secretKeyRef) || {secret_env}) && "
        f"(!has(e.valueFrom.configMapKeyRef) || {config_env}))) && "
        f"(!{c}.?securityContext.?privileged.orValue(false) || {_PT_CONTAINERS}.exists(u, "
        f"u.?name.orValue('') == {c}.name && u.?securityContext.?privileged.orValue(false))))"
    )


CHILDREN_MATCH_CONSTRAINTS: dict[str, Any] = {
    "resourceRules": [
        {
            "apiGroups": ["batch"],
            "apiVersions": ["v1"],
            "resources": ["jobs"],
            "operations": ["CREATE"],
        },
        {
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "resources": ["services"],
            "operations": ["CREATE"],
        },
    ]
}

CHILDREN_PARAM_KIND: dict[str, str] = {"apiVersion": models.API_VERSION, "kind": models.KIND}

_TEMPLATE = "object.spec.template.spec"

CHILDREN_VARIABLES: list[dict[str, str]] = [
    {
        "name": "owners",
        "expression": (
            "object.metadata.?ownerReferences.orValue([]).filter(r, "
            f"r.kind == '{models.KIND}' && r.apiVersion.startsWith('{models.GROUP}/'))"
        ),
    },
    {
        "name": "ownerName",
        "expression": "size(variables.owners) == 1 ? variables.owners[0].name : ''",
    },
    # This evaluation's TrainingJob is the one the object names as its owner.
    {"name": "isOwner", "expression": "variables.ownerName == params.metadata.name"},
    {
        "name": "allowedImages",
        "expression": (f"[params.spec.image] + {_PT_CONTAINERS}.map(c, c.?image.orValue(''))"),
    },
]

# The deprecated spec.serviceAccount still names the account where serviceAccountName is unset.
_SA = f"{_PT}.?serviceAccountName.orValue({_PT}.?serviceAccount.orValue('default'))"

CHILDREN_VALIDATIONS: list[dict[str, str]] = [
    {
        "expression": (
            "size(variables.owners) == 1 && "
            f"object.metadata.?labels.orValue({{}})[?'{_LABEL}'].orValue('') == "
            "variables.ownerName"
        ),
        "message": (
            f"the preemptible operator may only create Jobs and Services labelled {_LABEL} "
            f"with the name of the one {models.KIND} that owns them"
        ),
        "reason": "Forbidden",
    },
    {
        "expression": "!variables.isOwner || variables.owners[0].uid == params.metadata.uid",
        "message": f"the owner reference's uid is not the {models.KIND}'s",
        "reason": "Forbidden",
    },
    {
        "expression": (
            "request.resource.resource != 'jobs' || ("
            "object.metadata.name.startsWith(variables.ownerName + '-a') && "
            "object.metadata.name.substring(size(variables.ownerName) + 2).matches('^[0-9]+$'))"
        ),
        "message": f"an attempt Job is named <{models.KIND}>-a<attempt>",
        "reason": "Forbidden",
    },
    {
        "expression": (
            "request.resource.resource != 'services' || ("
            "object.metadata.name == variables.ownerName && "
            "object.spec.?clusterIP.orValue('') == 'None' && "
            "object.spec.?type.orValue('ClusterIP') == 'ClusterIP' && "
            "size(object.spec.?externalIPs.orValue([])) == 0 && "
            f"object.spec.?selector.orValue({{}}) == {{'{_LABEL}': variables.ownerName}})"
        ),
        "message": (
            f"the preemptible operator's Service is headless, named after its {models.KIND} "
            f"and selects its pods ({_LABEL})"
        ),
        "reason": "Forbidden",
    },
    {
        "expression": (
            "request.resource.resource != 'jobs' || !variables.isOwner || ("
            f"{_TEMPLATE}.?serviceAccountName.orValue('default') == {_SA} && "
            f"{_TEMPLATE}.?serviceAccount.orValue({_SA}) == {_SA})"
        ),
        "message": (
            f"the Job's pods must run as the service account its {models.KIND} names "
            "(spec.podTemplate.spec.serviceAccountName, or default)"
        ),
        "reason": "Forbidden",
    },
    {
        "expression": (
            "request.resource.resource != 'jobs' || !variables.isOwner || ("
            + " && ".join(
                f"(!{_TEMPLATE}.?{f}.orValue(false) || {_PT}.?{f}.orValue(false) == true)"
                for f in ("hostNetwork", "hostPID", "hostIPC")
            )
            + f" && ({_TEMPLATE}.?hostUsers.orValue(true) == "
            f"{_PT}.?hostUsers.orValue(true) || !{_TEMPLATE}.?hostUsers.orValue(true)))"
        ),
        "message": (
            f"the Job's pods may use the host's network, PID or IPC namespace only where its "
            f"{models.KIND} asks for it"
        ),
        "reason": "Forbidden",
    },
    {
        "expression": (
            "request.resource.resource != 'jobs' || !variables.isOwner || ("
            f"({_TEMPLATE}.containers + {_TEMPLATE}.?initContainers.orValue([])).all(c, "
            + _container_allowed("c")
            + "))"
        ),
        "message": (
            f"the Job's containers may only use images, Secrets and ConfigMaps its {models.KIND} "
            "names, and be privileged only where it asks"
        ),
        "reason": "Forbidden",
    },
    {
        "expression": (
            "request.resource.resource != 'jobs' || !variables.isOwner || "
            f"{_TEMPLATE}.?volumes.orValue([]).all(v, " + _volume_allowed("v") + ")"
        ),
        "message": f"the Job's pods may only mount volumes its {models.KIND} asks for",
        "reason": "Forbidden",
    },
]


def children_policy(name: str, namespace: str, service_account: str) -> dict[str, Any]:
    """The ValidatingAdmissionPolicy over the Jobs and Services the operator creates."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "paramKind": CHILDREN_PARAM_KIND,
            "matchConstraints": CHILDREN_MATCH_CONSTRAINTS,
            "matchConditions": [_match_condition(namespace, service_account)],
            "variables": CHILDREN_VARIABLES,
            "validations": CHILDREN_VALIDATIONS,
        },
    }


# The apiserver looks the params up before it evaluates the match conditions: without this
# selector a namespace with no TrainingJob would refuse everyone's Jobs and Services. Objects
# without the label are not the operator's anyway (the operator policy refuses it those).
CHILDREN_OBJECT_SELECTOR: dict[str, Any] = {
    "matchExpressions": [{"key": _LABEL, "operator": "Exists"}]
}


def children_policy_binding(name: str, policy_name: str | None = None) -> dict[str, Any]:
    """Params: every TrainingJob of the request's namespace; none there: denied. Only objects
    labelled as a TrainingJob's are matched."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {
            "policyName": policy_name or name,
            "validationActions": ["Deny"],
            "paramRef": {"selector": {}, "parameterNotFoundAction": "Deny"},
            "matchResources": {"objectSelector": CHILDREN_OBJECT_SELECTOR},
        },
    }


def service_account_username(namespace: str, service_account: str) -> str:
    return f"system:serviceaccount:{namespace}:{service_account}"


def _match_condition(namespace: str, service_account: str) -> dict[str, str]:
    # Namespace and ServiceAccount names are DNS labels/subdomains: no quote can occur.
    username = service_account_username(namespace, service_account)
    return {
        "name": "operator-service-account",
        "expression": f"request.userInfo.username == '{username}'",
    }


def boost_max_variable(boost_max: int) -> dict[str, str]:
    return {"name": BOOST_MAX_VARIABLE, "expression": str(int(boost_max))}


def admission_policy(
    name: str, namespace: str, service_account: str, boost_max: int = 100
) -> dict[str, Any]:
    """The ValidatingAdmissionPolicy for the operator running as ``namespace/service_account``
    (``boost_max``: operator.priorityBoost.max, the chart's default 100)."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": POLICY_MATCH_CONSTRAINTS,
            "matchConditions": [_match_condition(namespace, service_account)],
            "variables": [boost_max_variable(boost_max), *POLICY_VARIABLES],
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
        "childrenPolicy": {
            "paramKind": CHILDREN_PARAM_KIND,
            "matchConstraints": CHILDREN_MATCH_CONSTRAINTS,
            "variables": CHILDREN_VARIABLES,
            "validations": CHILDREN_VALIDATIONS,
            "objectSelector": CHILDREN_OBJECT_SELECTOR,
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
