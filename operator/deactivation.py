"""Deactivating an attempt's Kueue Workload (pure): which recorded attempts' Workloads are
deactivated, and the patch (tests/unit/operator/test_deactivation.py).
"""

from __future__ import annotations

from typing import Any

from preemptible_operator.classify import DEACTIVATED_BY_OPERATOR_ANNOTATION
from preemptible_operator.conditions import Reason
from preemptible_operator.victims import BOOST_ANNOTATION

__all__ = [
    "DEACTIVATE_ON_RECORD",
    "deactivation_patch",
]


DEACTIVATE_ON_RECORD: frozenset[str] = frozenset(
    {Reason.KUEUE_PREEMPTED, Reason.KUEUE_EVICTED, Reason.PODS_NEVER_READY, Reason.RESUMED_UNSEEN}
)
"""Reasons whose attempt's Workload is deactivated when the attempt is recorded: Kueue must
never re-admit that attempt (the next attempt brings a fresh Workload)."""


def deactivation_patch(workload: dict[str, Any]) -> dict[str, Any] | None:
    """The merge patch that deactivates an attempt's Workload (None: inactive already). Marked
    as ours: an inactive Workload without the mark is an administrator's (or Kueue's) and
    suspends the TrainingJob (classify.workload_deactivated). A victim's priority boost must not
    follow its Workload back into the queue."""
    if (workload.get("spec") or {}).get("active") is False:
        return None
    annotations: dict[str, Any] = {DEACTIVATED_BY_OPERATOR_ANNOTATION: "true"}
    if BOOST_ANNOTATION in (workload["metadata"].get("annotations") or {}):
        annotations[BOOST_ANNOTATION] = None
    return {"metadata": {"annotations": annotations}, "spec": {"active": False}}
