"""Pure decisions about an attempt's children (its Service, Job and pods): what a refused create
means, when the attempt's pods are all over, which pods the operator must end, and which
ended attempts' Jobs are deleted or kept for their logs.

Inputs are plain dicts in the apiserver's JSON shape (camelCase).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from preemptible_operator import render
from preemptible_operator.classify import job_condition, pod_finished
from preemptible_operator.conditions import Reason
from preemptible_operator.render import CONTAINER_NAME, JOB_COMPLETION_INDEX_ANNOTATION

__all__ = [
    "JOB_TRACKING_FINALIZER",
    "REFUSAL_RETRY_MAX",
    "REFUSAL_RETRY_MIN",
    "Refusal",
    "api_message",
    "attempt_pods_finished",
    "create_refusal",
    "held_pods",
    "job_terminal",
    "jobs_to_delete",
    "kept_failed_attempt",
    "no_pod_can_follow",
    "pods_refused",
    "pods_to_end",
    "refusal_retry_seconds",
    "restarted_pods",
]

REFUSAL_RETRY_MIN = 5.0
REFUSAL_RETRY_MAX = 300.0


@dataclass(frozen=True)
class Refusal:
    """The apiserver refused to create a child for a reason a retry alone will not fix soon."""

    reason: str
    message: str
    fatal: bool
    """The spec cannot succeed (the object is invalid): the TrainingJob fails. Otherwise the
    create is retried with backoff (a name freed, quota freed, a policy relaxed)."""


def api_message(body: str | bytes | None, fallback: str = "") -> str:
    """The ``message`` of a Kubernetes ``Status`` body, else the body itself (or ``fallback``)."""
    if not body:
        return fallback
    text = body.decode(errors="replace") if isinstance(body, bytes) else str(body)
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:1000] or fallback
    if isinstance(data, dict) and data.get("message"):
        return str(data["message"])
    return fallback or text.strip()[:1000]


def create_refusal(
    kind: str, name: str, http_status: int | None, message: str, *, foreign: bool = False
) -> Refusal | None:
    """What the refused create of child ``kind``/``name`` means, None when it is temporary
    (a server error, a timeout, a conflict with a deleted incarnation's child still being
    collected): those are retried as any failed pass is.

    409 with ``foreign``: the name is taken by an object this TrainingJob does not own (the user
    must delete or rename it). 422: the rendered object is invalid (a podTemplate field the
    apiserver refuses): the TrainingJob cannot succeed. 403: forbidden (a ResourceQuota on the
    object count, Pod Security Admission, the operator's RBAC): retried, the cause may go."""
    what = f"{kind} {name}"
    if http_status == 409 and foreign:
        return Refusal(Reason.NAME_TAKEN, f"{what}: {message}", fatal=False)
    if http_status == 422:
        return Refusal(Reason.CHILD_INVALID, f"{what} is invalid: {message}", fatal=True)
    if http_status == 403:
        return Refusal(Reason.CHILD_FORBIDDEN, f"{what} is forbidden: {message}", fatal=False)
    return None


def refusal_retry_seconds(refused_for: float) -> float:
    """Seconds to the next create after refusals for ``refused_for`` seconds: about as long as it
    has been refused (so the wait doubles each retry), from REFUSAL_RETRY_MIN to
    REFUSAL_RETRY_MAX; quota and names free up, so it never stops."""
    return min(REFUSAL_RETRY_MAX, max(REFUSAL_RETRY_MIN, refused_for))


def pods_refused(
    job: Mapping[str, Any] | None, events: Iterable[Mapping[str, Any]] = ()
) -> str | None:
    """Why the Job controller cannot create the attempt's pods (a ResourceQuota, Pod Security
    Admission, a webhook), from the Job's ``FailedCreate`` Events (the newest) or a
    ``ReplicaFailure`` condition; None when nothing says so. The Job controller retries itself
    with backoff; this only makes the cause visible."""
    newest: tuple[str, str] | None = None
    for event in events:
        if event.get("reason") != "FailedCreate":
            continue
        when = str(event.get("lastTimestamp") or event.get("eventTime") or "")
        if newest is None or when >= newest[0]:
            newest = (when, str(event.get("message") or "FailedCreate"))
    if newest is not None:
        return newest[1]
    cond = job_condition(job, "ReplicaFailure")
    if cond is not None:
        return str(cond.get("message") or cond.get("reason") or "ReplicaFailure")
    return None


def _count(job: Mapping[str, Any] | None, key: str) -> int:
    value = ((job or {}).get("status") or {}).get(key)
    return int(value) if isinstance(value, int) else 0


JOB_TRACKING_FINALIZER = "batch.kubernetes.io/job-tracking"
"""The Job controller's finalizer on each pod it creates, removed once it has counted the pod's
end in the Job's status, or just before it deletes an active pod of a suspended Job (whose end
it then never counts)."""


def attempt_pods_finished(
    job: Mapping[str, Any] | None,
    pods: Iterable[Mapping[str, Any]],
    node_ready: Mapping[str, bool] | None = None,
) -> bool:
    """Whether nothing of the attempt can run or write any more: every pod seen is finished
    (classify.pod_finished) and the Job has no pod we do not see, now or later.

    The watch cache may lag behind the Job controller (a pod created just before an eviction,
    not seen yet), and such a pod could write beside the next attempt. Either no pod can follow
    those seen (no_pod_can_follow: decided from the pods alone, as soon as they end), or else
    the Job's ``status.active`` + ``status.terminating`` (``ready`` is part of ``active``) must
    not exceed the pods seen that are finished but not in a terminal phase (the only ones it
    may still count: containers ended, deleted while unbound or on a removed node). The Job
    controller writes that status about 1 s after a pod ends (it batches pod updates)."""
    pods = list(pods)
    if not all(pod_finished(p, node_ready) for p in pods):
        return False
    if job is None:
        return True
    if no_pod_can_follow(job, pods):
        return True
    counted = max(_count(job, "active"), _count(job, "ready")) + _count(job, "terminating")
    explained = sum(
        1 for p in pods if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
    )
    return counted <= explained


def _completion_index(pod: Mapping[str, Any]) -> int | None:
    meta = pod.get("metadata") or {}
    for where in ("annotations", "labels"):
        raw = (meta.get(where) or {}).get(JOB_COMPLETION_INDEX_ANNOTATION)
        if raw is not None:
            try:
                return int(raw)
            except ValueError:
                return None
    return None


def _holds_index(pod: Mapping[str, Any]) -> bool:
    """A terminal pod whose end the Job controller counts (or has counted), so its index never
    gets another pod: it still holds the tracking finalizer, or it lost it without being
    deleted (only counting removes it then). A pod deleted without the finalizer may be one the
    controller deleted when the Job was suspended: not counted, its index runs again on resume."""
    if (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
        return False
    meta = pod.get("metadata") or {}
    return JOB_TRACKING_FINALIZER in (meta.get("finalizers") or []) or not meta.get(
        "deletionTimestamp"
    )


def no_pod_can_follow(job: Mapping[str, Any], pods: Iterable[Mapping[str, Any]]) -> bool:
    """Whether the Job controller cannot have, nor ever create, a pod beyond ``pods`` (the
    attempt's pods seen): the Job is not suspended, every pod seen is in a terminal phase and
    every completion index has a pod seen that holds it (_holds_index).

    Why no other pod can exist (render_job: Indexed, completions = parallelism, backoffLimit 0,
    podReplacementPolicy Failed, FailJob on the trainer's exit 75 and on DisruptionTarget, no
    Ignore rule): the controller creates a pod for an index only while none of its pods is
    active or not yet terminal, the index has not succeeded and the Job is not failing. A
    counted failure fails the whole Job (FailJob or the backoff limit of 0) and a counted
    success completes its index, so after a pod that holds its index nothing is created for
    that index (a failure: for none). The only ends it never counts are of the active pods it
    deletes when the Job is suspended: it strips their finalizer before the delete, so they are
    seen deleted without it and hold nothing (their index runs again on resume). So a hidden
    pod could only be one of an index with no holding pod seen, which this refuses. Pods on a
    lost node, deleted while unbound or still terminating are not terminal: the count decides.
    A suspended Job is left to the count too, while the controller's deletions are under way.
    Left open, both needing the Job to be suspended just as its pods end, then resumed before
    the operator deletes it (or before the pod cache catches up): a pod seen between the
    controller's finalizer removal and its delete, and a pod that ended as the Job was
    suspended, stripped by a controller that still saw it active (its end is then never
    counted, in Kubernetes too)."""
    spec = job.get("spec") or {}
    completions = spec.get("completions")
    if spec.get("suspend") or job_condition(job, "Suspended") is not None:
        return False
    if not isinstance(completions, int) or completions < 1:
        return False
    pods = list(pods)
    if not all((p.get("status") or {}).get("phase") in ("Succeeded", "Failed") for p in pods):
        return False
    held = {_completion_index(p) for p in pods if _holds_index(p)}
    return all(i in held for i in range(completions))


def _trainer_terminated(pod: Mapping[str, Any]) -> bool:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == CONTAINER_NAME:
            return bool((status.get("state") or {}).get("terminated"))
    return False


def pods_to_end(pods: Iterable[Mapping[str, Any]], attempt_over: bool) -> list[Mapping[str, Any]]:
    """Pods the operator deletes because only other containers keep them running: once the
    attempt is over (judged on the trainer containers), a pod whose ``trainer`` container has
    terminated but which still runs another (a regular sidecar: a log shipper, a proxy) would
    otherwise keep the attempt from ever ending. Its trainer's state stays readable (the
    attempt-record finalizer holds the pod). While the attempt goes on nothing is ended: a rank
    that finished first must not stop its peers (the Job fails once a pod is deleted)."""
    if not attempt_over:
        return []
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        phase = (pod.get("status") or {}).get("phase")
        if meta.get("deletionTimestamp") or phase in ("Succeeded", "Failed"):
            continue
        if _trainer_terminated(pod) and not pod_finished(pod):
            out.append(pod)
    return out


def job_terminal(job: Mapping[str, Any] | None) -> bool:
    """The Job controller will never start a pod of it again (Failed, FailureTarget, Complete,
    SuccessCriteriaMet)."""
    return any(
        job_condition(job, c) is not None
        for c in ("Failed", "FailureTarget", "Complete", "SuccessCriteriaMet")
    )


def kept_failed_attempt(
    jobs: Mapping[int, Mapping[str, Any]],
    outcomes: Mapping[int, str | None],
    pods_by_attempt: Mapping[int, Iterable[Mapping[str, Any]]] | None = None,
) -> int | None:
    """The attempt whose Job (and pods) is kept for its logs: the newest attempt recorded as
    Failed whose Job can never start a pod again (no second writer beside a later attempt):
    the Job is terminal, or its pods (``pods_by_attempt``) show that no pod can follow them
    (no_pod_can_follow: the attempt is recorded as soon as its pods end, before the Job
    controller marks the Job Failed). A failed attempt whose Job is not terminal (Kueue evicted
    it before its pods ran: a suspended Job can be admitted again) is not kept."""
    pods_by_attempt = pods_by_attempt or {}
    failed = [
        n
        for n, job in jobs.items()
        if outcomes.get(n) == "Failed"
        and (job_terminal(job) or no_pod_can_follow(job, pods_by_attempt.get(n) or []))
        and not (job.get("metadata") or {}).get("deletionTimestamp")
    ]
    return max(failed) if failed else None


def jobs_to_delete(
    jobs: Mapping[int, Mapping[str, Any]],
    outcomes: Mapping[int, str | None],
    up_to: int,
    pods_by_attempt: Mapping[int, Iterable[Mapping[str, Any]]] | None = None,
) -> list[Mapping[str, Any]]:
    """Ended attempts' Jobs (attempt <= ``up_to``; an attempt whose record was dropped counts as
    ended) the operator deletes: every one but a Succeeded one (the final result) and the kept
    failed one (kept_failed_attempt). Preempted and suspended attempts' Jobs go at once: a
    preempted Job may be unsuspended by Kueue. Jobs already being deleted are left out."""
    keep = kept_failed_attempt(jobs, outcomes, pods_by_attempt)
    out = []
    for n, job in sorted(jobs.items()):
        if n > up_to or n == keep or outcomes.get(n) == "Succeeded":
            continue
        if (job.get("metadata") or {}).get("deletionTimestamp"):
            continue
        out.append(job)
    return out


def restarted_pods(
    pods: Iterable[Mapping[str, Any]], node_ready: Mapping[str, bool] | None = None
) -> list[Mapping[str, Any]]:
    """Pods of the attempt started after an earlier pod of the same completion index ended:
    the attempt's Job was suspended and resumed (a Kueue eviction and re-admission the
    operator never saw: it was down or lagging). Nothing else gives an index a second pod
    (render_job: backoffLimit 0, podReplacementPolicy Failed, FailJob on exit 75 and
    DisruptionTarget, no Ignore rule): only a suspension ends pods without counting them.
    Such pods resumed from the attempt's old PREEMPTIBLE_RESUME_FROM (steps redone): the attempt
    must end and the next one start from the newest checkpoint. Returns the ones still able to
    run (not finished)."""
    ended: dict[int, str] = {}
    live: list[tuple[int, str, Mapping[str, Any]]] = []
    for pod in pods:
        index = _completion_index(pod)
        if index is None:
            continue
        created = str((pod.get("metadata") or {}).get("creationTimestamp") or "")
        if pod_finished(pod, node_ready):
            ended[index] = min(ended.get(index, created), created)
        else:
            live.append((index, created, pod))
    # RFC 3339 times of one apiserver compare as strings; a missing time never counts as later.
    return [p for i, created, p in live if i in ended and created > ended[i]]


def held_pods(pods_by_attempt: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Pods of any attempt that still hold the attempt-record finalizer."""
    return [
        p
        for pods in pods_by_attempt.values()
        for p in pods
        if render.ATTEMPT_FINALIZER in (p["metadata"].get("finalizers") or [])
    ]
