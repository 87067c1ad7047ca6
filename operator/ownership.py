"""Which Jobs and pods belong to one incarnation of a TrainingJob (pure).

Names and labels are not enough: a TrainingJob deleted and re-applied under the same name gets a
new uid while the old Job, pods and Service may still be terminating. Jobs carry a controller
owner reference to the TrainingJob; pods belong through their Job, or through the TrainingJob
uid annotation when their Job is already gone.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from preemptible_operator import models, render
from preemptible_operator.render import ANNOTATION_TJ_UID

__all__ = [
    "Children",
    "by_attempt",
    "controller_uid",
    "left_by_earlier_incarnation",
    "owned_by",
    "owned_children",
    "pod_owned",
    "tj_uid_of",
]


def controller_uid(obj: Mapping[str, Any]) -> str | None:
    """The uid of ``obj``'s controller owner (None without one)."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return ref.get("uid")
    return None


def owned_by(obj: Mapping[str, Any], uid: str | None) -> bool:
    """Whether ``obj`` (a Job, a Service) has an owner reference to uid ``uid``."""
    if not uid:
        return False
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(ref.get("uid") == uid for ref in refs)


def tj_uid_of(pod: Mapping[str, Any]) -> str | None:
    """The TrainingJob uid recorded on a pod by the operator (None on older pods)."""
    return ((pod.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_TJ_UID)


def pod_owned(pod: Mapping[str, Any], tj_uid: str | None, job_uids: Collection[str]) -> bool:
    """Whether ``pod`` belongs to the TrainingJob ``tj_uid`` whose Jobs have ``job_uids``."""
    recorded = tj_uid_of(pod)
    if recorded is not None:
        return recorded == tj_uid
    return controller_uid(pod) in job_uids


def by_attempt(objs: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Objects by the attempt number of their label (unlabelled ones left out)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for obj in objs:
        raw = (obj["metadata"].get("labels") or {}).get(render.LABEL_ATTEMPT, "")
        if raw.isdigit():
            out.setdefault(int(raw), []).append(obj)
    return out


@dataclass(frozen=True)
class Children:
    """The TrainingJob's children among those labelled with its name."""

    jobs: dict[int, dict[str, Any]]
    """Its Jobs by attempt."""
    pods_by_attempt: dict[int, list[dict[str, Any]]]
    foreign_pods: list[dict[str, Any]]
    """Pods labelled with its name that are not its own: an earlier incarnation's."""


def owned_children(
    uid: str | None, jobs: list[dict[str, Any]], pods: list[dict[str, Any]]
) -> Children:
    """Children are ours only by owner uid: a TrainingJob re-created under the same name must
    never adopt the previous incarnation's Jobs or pods (still being deleted)."""
    owned_jobs = [j for j in jobs if owned_by(j, uid)]
    job_uids = {j["metadata"].get("uid") for j in owned_jobs}
    ours = [p for p in pods if pod_owned(p, uid, job_uids)]
    return Children(
        jobs={n: js[0] for n, js in by_attempt(owned_jobs).items()},
        pods_by_attempt=by_attempt(ours),
        foreign_pods=[p for p in pods if not pod_owned(p, uid, job_uids)],
    )


def left_by_earlier_incarnation(existing: dict[str, Any], tj_name: str) -> bool:
    """A child name is taken by an object owned by a TrainingJob of the same name (another
    uid): a deleted incarnation's, which garbage collection removes (waited for, never a
    refusal)."""
    refs = existing["metadata"].get("ownerReferences") or []
    return any(r.get("kind") == models.KIND and r.get("name") == tj_name for r in refs)
