"""Children belong to one incarnation of a TrainingJob by uid, never by name or labels alone."""

from __future__ import annotations

from typing import Any

import pytest

from preemptible_operator.ownership import owned_by, pod_owned
from preemptible_operator.render import ANNOTATION_TJ_UID


def _obj(owner_uid: str | None = None, tj_uid: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "x", "labels": {"preemptible.dev/training-job": "tj"}}
    if owner_uid:
        meta["ownerReferences"] = [{"kind": "Job", "uid": owner_uid, "controller": True}]
    if tj_uid:
        meta["annotations"] = {ANNOTATION_TJ_UID: tj_uid}
    return {"metadata": meta}


@pytest.mark.parametrize(
    ("obj", "uid", "owned"),
    [
        (_obj("tj-new"), "tj-new", True),
        (_obj("tj-old"), "tj-new", False),  # same name and labels, earlier incarnation
        (_obj(), "tj-new", False),  # no owner: someone else's object
        (_obj("tj-new"), None, False),
    ],
)
def test_owned_by(obj: dict[str, Any], uid: str | None, owned: bool) -> None:
    assert owned_by(obj, uid) is owned


@pytest.mark.parametrize(
    ("pod", "owned"),
    [
        (_obj("job-new", "tj-new"), True),
        (_obj("job-old", "tj-old"), False),  # the earlier incarnation's pod
        (_obj(None, "tj-new"), True),  # its Job is already gone; the annotation says whose
        (_obj("job-new"), True),  # a pod from before the annotation: through its Job
        (_obj("job-old"), False),
        (_obj(), False),
    ],
)
def test_pod_owned(pod: dict[str, Any], owned: bool) -> None:
    assert pod_owned(pod, "tj-new", {"job-new"}) is owned
