"""Which Jobs and pods belong to one incarnation of a TrainingJob (pure).

Names and labels are not enough: a TrainingJob deleted and re-applied under the same name gets a
new uid while the old Job, pods and Service may still be terminating. Jobs carry a controller
owner reference to the TrainingJob; pods belong through their Job, or through the TrainingJob
uid annotation when their Job is already gone.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from preemptible_operator.render import ANNOTATION_TJ_UID

__all__ = ["controller_uid", "owned_by", "pod_owned", "tj_uid_of"]


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
