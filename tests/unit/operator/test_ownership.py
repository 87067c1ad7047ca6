"""Children belong to one incarnation of a TrainingJob by uid, never by name or labels alone."""

from __future__ import annotations

from typing import Any

import pytest

from preemptible_operator import render
from preemptible_operator.ownership import (
    by_attempt,
    left_by_earlier_incarnation,
    owned_by,
    owned_children,
    pod_owned,
)
from preemptible_operator.render import ANNOTATION_TJ_UID
from tests.unit.operator.builders import make_pod


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


def _owned_job(attempt: int, owner: str, uid: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"tj-a{attempt}",
            "uid": uid,
            "labels": {render.LABEL_ATTEMPT: str(attempt)},
            "ownerReferences": [{"uid": owner, "controller": True}],
        }
    }


def _labelled_pod(
    name: str, attempt: int, *, job_uid: str | None = None, tj_uid: str | None = None
) -> dict[str, Any]:
    pod = make_pod(name)
    pod["metadata"]["labels"][render.LABEL_ATTEMPT] = str(attempt)
    if job_uid is not None:
        pod["metadata"]["ownerReferences"] = [{"uid": job_uid, "controller": True}]
    if tj_uid is not None:
        pod["metadata"]["annotations"][render.ANNOTATION_TJ_UID] = tj_uid
    return pod


def test_owned_children_only_by_owner_uid() -> None:
    """A TrainingJob re-created under the same name never adopts the old incarnation's
    children: Jobs by owner reference, pods by the uid annotation or through their Job."""
    jobs = [
        _owned_job(1, "new", "j-new-1"),
        _owned_job(1, "old", "j-old-1"),
        _owned_job(2, "new", "j-new-2"),
    ]
    pods = [
        _labelled_pod("by-job", 1, job_uid="j-new-1"),
        _labelled_pod("by-annotation", 2, tj_uid="new"),
        _labelled_pod("old-by-job", 1, job_uid="j-old-1"),
        _labelled_pod("old-by-annotation", 1, job_uid="j-new-1", tj_uid="old"),
    ]
    got = owned_children("new", jobs, pods)
    assert {n: j["metadata"]["uid"] for n, j in got.jobs.items()} == {1: "j-new-1", 2: "j-new-2"}
    assert {n: [p["metadata"]["name"] for p in ps] for n, ps in got.pods_by_attempt.items()} == {
        1: ["by-job"],
        2: ["by-annotation"],
    }
    assert [p["metadata"]["name"] for p in got.foreign_pods] == ["old-by-job", "old-by-annotation"]


def test_by_attempt_skips_unlabelled() -> None:
    unlabelled = make_pod("x")
    del unlabelled["metadata"]["labels"][render.LABEL_ATTEMPT]
    assert by_attempt([unlabelled, _labelled_pod("y", 3)]) == {3: [_labelled_pod("y", 3)]}


@pytest.mark.parametrize(
    ("refs", "earlier"),
    [
        ([{"kind": "TrainingJob", "name": "tj", "uid": "old"}], True),
        ([{"kind": "TrainingJob", "name": "other", "uid": "x"}], False),
        ([{"kind": "ConfigMap", "name": "tj", "uid": "x"}], False),
        ([], False),
    ],
    ids=["earlier-incarnation", "another-trainingjob", "another-kind", "unowned"],
)
def test_left_by_earlier_incarnation(refs: list[dict[str, str]], earlier: bool) -> None:
    existing = {"metadata": {"name": "tj-a1", "ownerReferences": refs}}
    assert left_by_earlier_incarnation(existing, "tj") is earlier
