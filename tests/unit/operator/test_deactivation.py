"""Deactivating an attempt's Kueue Workload (deactivation.py)."""

from __future__ import annotations

from typing import Any

import pytest

from preemptible_operator.classify import DEACTIVATED_BY_OPERATOR_ANNOTATION
from preemptible_operator.conditions import Reason
from preemptible_operator.deactivation import DEACTIVATE_ON_RECORD, deactivation_patch
from preemptible_operator.victims import BOOST_ANNOTATION


def test_deactivated_on_record() -> None:
    """Kueue's evictions (and a start that never got all pods ready) end the Workload with the
    attempt; a pod eviction or node loss does not (Kueue did not take the quota back)."""
    assert {
        Reason.KUEUE_PREEMPTED,
        Reason.KUEUE_EVICTED,
        Reason.PODS_NEVER_READY,
        Reason.RESUMED_UNSEEN,  # an eviction seen only afterwards (issue 39)
    } == set(DEACTIVATE_ON_RECORD)
    assert Reason.POD_EVICTED not in DEACTIVATE_ON_RECORD


MARK = DEACTIVATED_BY_OPERATOR_ANNOTATION


@pytest.mark.parametrize(
    ("workload", "patch"),
    [
        (
            {"metadata": {"name": "w"}, "spec": {"active": True}},
            {"metadata": {"annotations": {MARK: "true"}}, "spec": {"active": False}},
        ),
        (
            {"metadata": {"name": "w", "annotations": {BOOST_ANNOTATION: "40"}}, "spec": {}},
            {
                "metadata": {"annotations": {MARK: "true", BOOST_ANNOTATION: None}},
                "spec": {"active": False},
            },
        ),
        ({"metadata": {"name": "w"}, "spec": {"active": False}}, None),
    ],
    ids=["active", "boosted-victim", "inactive-already"],
)
def test_deactivation_patch(workload: dict[str, Any], patch: dict[str, Any] | None) -> None:
    assert deactivation_patch(workload) == patch
