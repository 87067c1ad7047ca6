"""Pure rendering of an attempt: its Indexed Job and the TrainingJob's headless Service.

No API calls here: inputs are the TrainingJob's metadata, its parsed spec and the attempt's
parameters; outputs are plain dicts ready for the Kubernetes client.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any

from preemptible_operator import models, node_notice, shape
from trainer_runtime import protocol
from trainer_runtime.deadline import torchrun_shutdown_timeout

__all__ = [
    "ANNOTATION_GRACE",
    "ANNOTATION_RESUME_FROM",
    "ANNOTATION_SPEC",
    "ANNOTATION_START_STEP",
    "ANNOTATION_TJ_UID",
    "ATTEMPT_FINALIZER",
    "CONTAINER_NAME",
    "JOB_COMPLETION_INDEX_ANNOTATION",
    "KUEUE_PRIORITY_LABEL",
    "KUEUE_QUEUE_LABEL",
    "LABEL_ATTEMPT",
    "LABEL_TRAINING_JOB",
    "MAX_NAME_LENGTH",
    "AttemptParams",
    "attempt_nodes",
    "job_name",
    "merge_pod_template",
    "owner_reference",
    "propagated_metadata",
    "render_job",
    "render_service",
    "service_name",
    "validate_name",
]

CONTAINER_NAME = "trainer"
LABEL_TRAINING_JOB = "preemptible.dev/training-job"
LABEL_ATTEMPT = "preemptible.dev/attempt"
ANNOTATION_GRACE = "preemptible.dev/grace-seconds"
ANNOTATION_RESUME_FROM = "preemptible.dev/resume-from"
ANNOTATION_START_STEP = "preemptible.dev/start-step"
# The TrainingJob's uid on its Jobs and pods: children of a deleted incarnation under the same
# name are never taken for the new one's (see ownership.py).
ANNOTATION_TJ_UID = "preemptible.dev/training-job-uid"
# The (valid) spec an attempt's Job was created from: an invalid edit of the TrainingJob while the
# attempt runs is rejected and the attempt goes on with this one.
ANNOTATION_SPEC = "preemptible.dev/spec"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
JOB_COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
# Keeps a finished attempt's pods (exit codes, termination messages) readable until the operator
# has recorded the attempt, even when Kueue or an eviction deleted them; removed right after.
ATTEMPT_FINALIZER = "preemptible.dev/attempt-record"
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
# The memory-backed /dev/shm of a pod of several processes (shape.shm_size_limit).
SHM_VOLUME = "preemptible-shm"
SHM_PATH = "/dev/shm"
# The node's notice (node_notice.py) as a file: a downward-API volume of the pod's annotation,
# which kubelet keeps up to date, so the runtime reads at SIGTERM what the operator wrote after
# the pod was bound (the env is fixed before the node is chosen).
NODE_NOTICE_VOLUME = "preemptible-node-notice"
NODE_NOTICE_DIR = "/etc/preemptible/node"
NODE_NOTICE_FILE = f"{NODE_NOTICE_DIR}/notice-seconds"

# Pod hostnames are "<job>-<index>" and must be DNS labels (<= 63): "<name>-a9999-9999" fits.
MAX_NAME_LENGTH = 52
_DEFAULT_UID = 1000


@dataclass(frozen=True)
class AttemptParams:
    """What changes from one attempt to the next."""

    attempt: int
    grace_seconds: int
    resume_from: str
    suspended: bool
    start_step: int | None = None
    """Step of the checkpoint resumed from (recorded on the Job so a restarted operator that
    adopts the Job knows it)."""
    fence: int | None = None
    """PREEMPTIBLE_ATTEMPT (resume.attempt_fence); None: the attempt number."""
    save_interval_seconds: int | None = None
    """spec.checkpoint.interval auto: the recommended seconds between saves for this attempt."""
    nodes: int | None = None
    """Pods of this attempt; None: spec.numNodes. An elastic attempt (spec.elastic) runs on
    the size its Workload's admission allows (elastic_attempt.start_gate)."""
    elastic: bool = False
    """The attempt of an elastic job: its pods run what the TrainingJob's own Workload admitted,
    so the Job carries no Kueue labels (Kueue must not manage it), and the runtime gets the
    reference size and accumulation (protocol.ENV_ELASTIC_*) to keep the global batch."""
    node_selector: dict[str, str] | None = None
    """The admitted flavors' nodeLabels (an elastic attempt: the operator plays Kueue's part)."""
    tolerations: list[dict[str, Any]] | None = None
    """The admitted flavors' tolerations (likewise)."""


def validate_name(name: str) -> str | None:
    """Why ``name`` cannot name a TrainingJob (its Jobs, pods, Service derive from it), or None."""

    if len(name) > MAX_NAME_LENGTH:
        return (
            f"metadata.name: {name!r} is {len(name)} characters; at most {MAX_NAME_LENGTH} "
            "(pod hostnames <name>-a<attempt>-<index> must fit in 63)"
        )
    if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name):
        return (
            f"metadata.name: {name!r} must be a DNS-1035 label (lowercase letters, digits and '-', "
            "starting with a letter) because it names the rendezvous Service"
        )
    return None


def job_name(name: str, attempt: int) -> str:
    """Deterministic Job name of an attempt: a second create of the same attempt is a no-op."""
    return f"{name}-a{attempt}"


def service_name(name: str) -> str:
    """The headless Service shared by all attempts (pods resolve as <job>-<index>.<service>)."""
    return name


def owner_reference(meta: dict[str, Any]) -> dict[str, Any]:
    """Controller owner reference to the TrainingJob (garbage collection, event routing)."""
    return {
        "apiVersion": models.API_VERSION,
        "kind": models.KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _labels(name: str, attempt: int | None) -> dict[str, str]:
    labels = {LABEL_TRAINING_JOB: name}
    if attempt is not None:
        labels[LABEL_ATTEMPT] = str(attempt)
    return labels


# What of the TrainingJob's own labels and annotations is not copied to its Jobs and pods: other
# tools' bookkeeping about the TrainingJob object itself, which on a child would be false (kubectl's
# last-applied spec, ArgoCD's tracking: a child carrying the Application's tracking label or
# annotation is taken for part of the Application and shown out of sync or pruned), keys the
# operator owns (preemptible.dev/), Kueue's (kueue.x-k8s.io/: the queue comes from
# spec.queueName; on a pod such a label would make Kueue's pod integration adopt it) and the
# Job controller's (batch.kubernetes.io/, job-name, controller-uid).
_NOT_PROPAGATED_PREFIXES = (
    "kubectl.kubernetes.io/",
    "argocd.argoproj.io/",
    "meta.helm.sh/",
    "preemptible.dev/",
    "kueue.x-k8s.io/",
    "batch.kubernetes.io/",
)
_NOT_PROPAGATED_KEYS = frozenset(
    {
        "app.kubernetes.io/instance",  # ArgoCD's default tracking label
        "job-name",
        "controller-uid",
    }
)


def _propagated(values: dict[str, str] | None) -> dict[str, str]:
    return {
        k: v
        for k, v in (values or {}).items()
        if k not in _NOT_PROPAGATED_KEYS and not k.startswith(_NOT_PROPAGATED_PREFIXES)
    }


def propagated_metadata(meta: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """The TrainingJob's labels and annotations its Jobs and pods carry (team, cost center,
    monitoring selectors...), less other tools' bookkeeping and keys the operator, Kueue or the
    Job controller own. On the children the operator's own keys win, and on the pods
    podTemplate.metadata wins too."""
    return _propagated(meta.get("labels")), _propagated(meta.get("annotations"))


def _kueue_labels(spec: models.TrainingJobSpec) -> dict[str, str]:
    labels = {}
    if spec.queue_name:
        labels[KUEUE_QUEUE_LABEL] = spec.queue_name
    if spec.priority_class:
        labels[KUEUE_PRIORITY_LABEL] = spec.priority_class
    return labels


def _runtime_env(
    name: str, namespace: str, spec: models.TrainingJobSpec, params: AttemptParams
) -> list[dict[str, Any]]:
    jname = job_name(name, params.attempt)
    index_ref = {
        "fieldRef": {"fieldPath": f"metadata.annotations['{JOB_COMPLETION_INDEX_ANNOTATION}']"}
    }
    env: list[dict[str, Any]] = [
        {"name": protocol.ENV_OUTPUT_DIR, "value": spec.checkpoint.uri},
        {"name": protocol.ENV_RESUME_FROM, "value": params.resume_from},
        {"name": protocol.ENV_GRACE_SECONDS, "value": str(params.grace_seconds)},
        # torchrun SIGKILLs its workers this long after SIGTERM (default 30 s): the pod's grace
        # less the margin in which the pod's termination message is written (the same value
        # `trainer-runtime launch` uses; the workers read it as their deadline).
        {
            "name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
            "value": str(torchrun_shutdown_timeout(params.grace_seconds)),
        },
        {
            "name": protocol.ENV_KILL_WAIT_SECONDS,
            "value": f"{spec.grace_period.kill_wait_seconds:g}",
        },
        {"name": protocol.ENV_ATTEMPT, "value": str(params.fence or params.attempt)},
        {"name": protocol.ENV_METRICS_PORT, "value": str(spec.metrics_port)},
        {
            "name": protocol.ENV_METRICS_HOST,
            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
        },
    ]
    env.extend(_deadline_env(spec, params))
    if params.elastic and spec.elastic is not None:
        env += [
            {"name": protocol.ENV_ELASTIC_REFERENCE_NODES, "value": str(spec.num_nodes)},
            {
                "name": protocol.ENV_ELASTIC_ACCUMULATION,
                "value": str(spec.elastic.gradient_accumulation_steps),
            },
        ]
    procs = shape.procs_per_node(spec)
    nodes = attempt_nodes(spec, params)
    if nodes == 1 and procs == 1:
        # One process needs no process group; LOCAL_RANK alone would make accelerate start one
        # (and wait on MASTER_ADDR).
        return env
    master_addr = f"{jname}-0.{service_name(name)}.{namespace}.svc"
    master = [
        {"name": "MASTER_ADDR", "value": master_addr},
        {"name": "MASTER_PORT", "value": str(spec.master_port)},
    ]
    if procs == 1:
        return [
            *env,
            *master,
            {"name": "WORLD_SIZE", "value": str(nodes)},
            {"name": "NODE_RANK", "valueFrom": index_ref},
            # One process per pod: the global rank is the node rank.
            {"name": "RANK", "valueFrom": index_ref},
            {"name": "LOCAL_RANK", "value": "0"},
        ]
    # Several processes per pod: the launcher (ours, torchrun or accelerate's) gives each worker
    # its RANK and LOCAL_RANK, so the pod sets neither. torchrun reads every option it is not
    # given from PET_<OPTION>: with these a plain `torchrun train.py` (and `trainer-runtime
    # launch`) starts the right number of workers in the right place.
    return [
        *env,
        *(master if nodes > 1 else []),
        {"name": "WORLD_SIZE", "value": str(nodes * procs)},
        {"name": "NODE_RANK", "valueFrom": index_ref},
        {"name": "PET_NNODES", "value": str(nodes)},
        {"name": "PET_NPROC_PER_NODE", "value": str(procs)},
        {"name": "PET_NODE_RANK", "valueFrom": index_ref},
        *(
            [
                {"name": "PET_MASTER_ADDR", "value": master_addr},
                {"name": "PET_MASTER_PORT", "value": str(spec.master_port)},
            ]
            if nodes > 1
            else []
        ),
    ]


def _deadline_env(spec: models.TrainingJobSpec, params: AttemptParams) -> list[dict[str, Any]]:
    """Stop policy, node notice and checkpoint interval: only when they differ from the runtime's
    defaults, so a job that sets none of them renders as before."""
    gp = spec.grace_period
    env: list[dict[str, Any]] = []
    if gp.stop_policy != "finish_step":
        env.append({"name": protocol.ENV_STOP_POLICY, "value": gp.stop_policy})
    if gp.node_notice_seconds is not None:
        env.append({"name": protocol.ENV_NODE_NOTICE_SECONDS, "value": str(gp.node_notice_seconds)})
    if params.save_interval_seconds is not None:
        env.append(
            {"name": protocol.ENV_SAVE_INTERVAL_SECONDS, "value": str(params.save_interval_seconds)}
        )
    return env


def _merge_named(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Union of two lists of named items; ours win on a name clash."""
    names = {item.get("name") for item in ours}
    return [*ours, *(item for item in theirs if item.get("name") not in names)]


def merge_pod_template(
    ours: dict[str, Any], override: models.PodTemplateOverride | None
) -> dict[str, Any]:
    """Merge the user's partial pod template into ours without losing what the runtime needs.

    User keys we do not set are taken as they are. Maps (nodeSelector, securityContext, labels,
    annotations) merge with the user's values winning, except our own labels. Lists of named
    items (volumes, containers, env, volumeMounts, ports) merge by name; for the training
    container the user may add env, mounts, resources and securityContext, but image, command,
    args, the runtime env and the termination-message settings stay ours.
    """
    result = copy.deepcopy(ours)
    if override is None:
        return result
    user_meta = copy.deepcopy(override.metadata or {})
    user_spec = copy.deepcopy(override.spec or {})

    meta = result.setdefault("metadata", {})
    for key in ("labels", "annotations"):
        merged = {**(user_meta.get(key) or {}), **(meta.get(key) or {})}
        if merged:
            meta[key] = merged
    # Finalizers are the operator's bookkeeping; the user's are kept alongside.
    if user_meta.get("finalizers"):
        meta["finalizers"] = sorted({*meta.get("finalizers", []), *user_meta["finalizers"]})

    spec = result["spec"]
    owned = {"restartPolicy", "subdomain", "terminationGracePeriodSeconds", "hostname"}
    for key, value in user_spec.items():
        if key in owned:
            continue
        if key == "containers":
            spec["containers"] = _merge_containers(spec["containers"], value)
        elif key in ("volumes", "initContainers"):
            spec[key] = _merge_named(spec.get(key, []), value)
        elif key in ("nodeSelector", "securityContext") and isinstance(value, dict):
            spec[key] = {**spec.get(key, {}), **value}
        elif key == "tolerations":
            spec[key] = [*spec.get(key, []), *value]
        else:
            spec[key] = value
    return result


def _merge_containers(
    ours: list[dict[str, Any]], theirs: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    merged = [copy.deepcopy(c) for c in ours]
    by_name = {c["name"]: c for c in merged}
    for container in theirs:
        target = by_name.get(container.get("name"))
        if target is None:
            merged.append(container)  # a sidecar
            continue
        for key, value in container.items():
            if key in ("env", "volumeMounts", "ports"):
                key_name = "mountPath" if key == "volumeMounts" else "name"
                have = {item.get(key_name) for item in target.get(key, [])}
                target[key] = [
                    *target.get(key, []),
                    *(v for v in value if v.get(key_name) not in have),
                ]
            elif key == "envFrom" and isinstance(value, list):
                # the user's sources after ours (the credentials Secret): env sources add up
                have = target.get(key, [])
                target[key] = [*have, *(v for v in value if v not in have)]
            elif key in ("resources", "securityContext") and isinstance(value, dict):
                base = target.get(key, {})
                if key == "resources":
                    target[key] = {
                        sub: {**base.get(sub, {}), **value.get(sub, {})} for sub in {*base, *value}
                    }
                else:
                    context = {**base, **value}
                    # `capabilities: {add: [IPC_LOCK]}` (RDMA) keeps our `drop: [ALL]`: drop
                    # everything, add back what is named; a `drop` of the user's replaces ours.
                    our_caps, their_caps = base.get("capabilities"), value.get("capabilities")
                    if isinstance(our_caps, dict) and isinstance(their_caps, dict):
                        context["capabilities"] = {**our_caps, **their_caps}
                    target[key] = context
            elif key in target:
                continue  # image, command, args, terminationMessage*: ours
            else:
                target[key] = value
    return merged


def render_pod_template(
    meta: dict[str, Any], spec: models.TrainingJobSpec, params: AttemptParams
) -> dict[str, Any]:
    """The Job's pod template (before user overrides)."""
    name, namespace = meta["name"], meta["namespace"]
    env = _runtime_env(name, namespace, spec, params)
    env.append({"name": protocol.ENV_NODE_NOTICE_FILE, "value": NODE_NOTICE_FILE})
    env += [e.to_k8s() for e in spec.env or []]
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": spec.image,
        "env": env,
        "ports": [
            {"name": "metrics", "containerPort": spec.metrics_port, "protocol": "TCP"},
            {"name": "rendezvous", "containerPort": spec.master_port, "protocol": "TCP"},
        ],
        "terminationMessagePath": TERMINATION_MESSAGE_PATH,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    if spec.checkpoint.credentials_secret:
        # the object store's credentials, as every S3/GCS/Azure client reads them: from env
        container["envFrom"] = [{"secretRef": {"name": spec.checkpoint.credentials_secret}}]
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    command = shape.pod_command(spec)
    if command:
        container["command"] = command
    if spec.args:
        container["args"] = list(spec.args)
    if spec.working_dir:
        container["workingDir"] = spec.working_dir
    if spec.resources_per_node:
        container["resources"] = spec.resources_per_node.to_k8s()
    if spec.volume_mounts:
        container["volumeMounts"] = copy.deepcopy(spec.volume_mounts)
    shm = shape.shm_size_limit(spec)
    if shm:
        # Before the user's mounts (merged by mountPath, ours first): one /dev/shm.
        container["volumeMounts"] = [
            {"name": SHM_VOLUME, "mountPath": SHM_PATH},
            *(m for m in container.get("volumeMounts", []) if m.get("mountPath") != SHM_PATH),
        ]
    container["volumeMounts"] = [
        *container.get("volumeMounts", []),
        {"name": NODE_NOTICE_VOLUME, "mountPath": NODE_NOTICE_DIR, "readOnly": True},
    ]
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "subdomain": service_name(name),
        "terminationGracePeriodSeconds": params.grace_seconds,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": _DEFAULT_UID,
            "runAsGroup": _DEFAULT_UID,
            "fsGroup": _DEFAULT_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
    }
    if spec.volumes:
        pod_spec["volumes"] = copy.deepcopy(spec.volumes)
    if shm:
        pod_spec["volumes"] = [
            {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": shm}},
            *pod_spec.get("volumes", []),
        ]
    labels, annotations = propagated_metadata(meta)
    pod_spec["volumes"] = [*pod_spec.get("volumes", []), _node_notice_volume()]
    template = {
        "metadata": {
            # No Kueue labels on pods: Kueue manages the Job, and labelled pods could be taken
            # for plain-pod workloads by its pod integration.
            "labels": _labels(name, params.attempt),
            "annotations": {
                ANNOTATION_GRACE: str(params.grace_seconds),
                ANNOTATION_RESUME_FROM: params.resume_from,
                **({ANNOTATION_TJ_UID: meta["uid"]} if meta.get("uid") else {}),
            },
            "finalizers": [ATTEMPT_FINALIZER],
        },
        "spec": pod_spec,
    }
    merged = merge_pod_template(template, spec.pod_template)
    if params.node_selector:
        # The admitted flavors' labels win, as Kueue's own integrations apply them.
        merged["spec"]["nodeSelector"] = {
            **(merged["spec"].get("nodeSelector") or {}),
            **params.node_selector,
        }
    if params.tolerations:
        tolerations = list(merged["spec"].get("tolerations") or [])
        merged["spec"]["tolerations"] = tolerations + [
            t for t in params.tolerations if t not in tolerations
        ]
    # The TrainingJob's own keys go under both ours and podTemplate.metadata's.
    pod_meta = merged["metadata"]
    for key, inherited in zip(("labels", "annotations"), (labels, annotations), strict=True):
        if inherited:
            pod_meta[key] = {**inherited, **(pod_meta.get(key) or {})}
    return merged


def _node_notice_volume() -> dict[str, Any]:
    field = f"metadata.annotations['{node_notice.ANNOTATION_NODE_NOTICE}']"
    return {
        "name": NODE_NOTICE_VOLUME,
        "downwardAPI": {"items": [{"path": "notice-seconds", "fieldRef": {"fieldPath": field}}]},
    }


def attempt_nodes(spec: models.TrainingJobSpec, params: AttemptParams) -> int:
    """The attempt's pod count: ``params.nodes`` (an elastic attempt) or spec.numNodes."""
    return params.nodes if params.nodes is not None else spec.num_nodes


def render_job(
    meta: dict[str, Any], spec: models.TrainingJobSpec, params: AttemptParams
) -> dict[str, Any]:
    """The attempt's Indexed Job (``<name>-a<N>``)."""
    name = meta["name"]
    user_labels, user_annotations = propagated_metadata(meta)
    labels = {**user_labels, **_labels(name, params.attempt)}
    if not params.elastic:  # an elastic attempt runs what the TrainingJob's Workload admitted
        labels.update(_kueue_labels(spec))
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": job_name(name, params.attempt),
            "namespace": meta["namespace"],
            "labels": labels,
            "annotations": {
                **user_annotations,
                ANNOTATION_GRACE: str(params.grace_seconds),
                ANNOTATION_RESUME_FROM: params.resume_from,
                ANNOTATION_SPEC: json.dumps(spec.to_k8s(), sort_keys=True, separators=(",", ":")),
                **(
                    {ANNOTATION_START_STEP: str(params.start_step)}
                    if params.start_step is not None
                    else {}
                ),
            },
            "ownerReferences": [owner_reference(meta)],
        },
        "spec": {
            "completionMode": "Indexed",
            "completions": attempt_nodes(spec, params),
            "parallelism": attempt_nodes(spec, params),
            # One attempt = one try; retries are new attempts decided by the operator.
            "backoffLimit": 0,
            # Never start a replacement while the old pod may still be writing its checkpoint.
            "podReplacementPolicy": "Failed",
            "podFailurePolicy": {
                "rules": [
                    {
                        "action": "FailJob",
                        "onExitCodes": {
                            "containerName": CONTAINER_NAME,
                            "operator": "In",
                            "values": [protocol.EXIT_PREEMPTED],
                        },
                    },
                    {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget"}]},
                ]
            },
            "suspend": params.suspended,
            "template": render_pod_template(meta, spec, params),
        },
    }


def render_service(meta: dict[str, Any], spec: models.TrainingJobSpec) -> dict[str, Any]:
    """Headless Service for rendezvous: gives pods DNS names <job>-<index>.<service>."""
    name = meta["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": service_name(name),
            "namespace": meta["namespace"],
            "labels": _labels(name, None),
            "ownerReferences": [owner_reference(meta)],
        },
        "spec": {
            "clusterIP": "None",
            "selector": {LABEL_TRAINING_JOB: name},
            # Rank 0 must resolve before it is Ready (rendezvous happens before readiness).
            "publishNotReadyAddresses": True,
            "ports": [{"name": "rendezvous", "port": spec.master_port, "protocol": "TCP"}],
        },
    }
