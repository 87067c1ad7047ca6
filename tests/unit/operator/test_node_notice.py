"""A node's notice from its Node object, the pod annotation that carries it, and the downward-API
file the runtime reads it from (issue 32, item 3)."""

from __future__ import annotations

from typing import Any

import pytest

from preemptible_operator import node_notice, render
from preemptible_operator.node_notice import ANNOTATION_NODE_NOTICE, NodeNotice
from tests.unit.operator.builders import META, make_pod, make_spec
from trainer_runtime import protocol


def _node(
    labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    return {"metadata": {"name": "n", "labels": labels or {}, "annotations": annotations or {}}}


@pytest.mark.parametrize(
    ("labels", "annotations", "seconds", "source"),
    [
        # Nothing says: no notice (an on-demand node, or a shutdown we cannot see coming).
        ({}, {}, None, None),
        ({"kubernetes.io/hostname": "n"}, {}, None, None),
        (None, None, None, None),
        # The clouds' spot labels and their documented notices.
        ({"cloud.google.com/gke-spot": "true"}, {}, 15, "cloud.google.com/gke-spot"),
        ({"cloud.google.com/gke-preemptible": "true"}, {}, 15, "gke-preemptible"),
        # EC2's 120 s start at the interruption warning, not at the pod's SIGTERM: a handler
        # must see the warning and drain the node first (issue 39).
        ({"eks.amazonaws.com/capacityType": "SPOT"}, {}, 90, "120 s from its warning, 30 s"),
        ({"karpenter.sh/capacity-type": "spot"}, {}, 90, "karpenter.sh/capacity-type"),
        # a cluster that measured its own drain says so on the node
        (
            {"karpenter.sh/capacity-type": "spot"},
            {ANNOTATION_NODE_NOTICE: "110"},
            110,
            "annotation",
        ),
        ({"kubernetes.azure.com/scalesetpriority": "spot"}, {}, 30, "scalesetpriority"),
        # The same labels with on-demand values: no notice.
        ({"cloud.google.com/gke-spot": "false"}, {}, None, None),
        ({"eks.amazonaws.com/capacityType": "ON_DEMAND"}, {}, None, None),
        ({"karpenter.sh/capacity-type": "on-demand"}, {}, None, None),
        ({"kubernetes.azure.com/scalesetpriority": "regular"}, {}, None, None),
        # Several apply: the shortest.
        (
            {"karpenter.sh/capacity-type": "spot", "kubernetes.azure.com/scalesetpriority": "spot"},
            {},
            30,
            "scalesetpriority",
        ),
        # The administrator's annotation wins, longer (GKE's extended 120 s) or shorter.
        ({"cloud.google.com/gke-spot": "true"}, {ANNOTATION_NODE_NOTICE: "120"}, 120, "annotation"),
        ({}, {ANNOTATION_NODE_NOTICE: "20"}, 20, "annotation"),
        ({ANNOTATION_NODE_NOTICE: "25"}, {}, 25, "label"),
        # A bad value is ignored: the table applies.
        ({"cloud.google.com/gke-spot": "true"}, {ANNOTATION_NODE_NOTICE: "soon"}, 15, "gke-spot"),
        ({}, {ANNOTATION_NODE_NOTICE: "0"}, None, None),
        ({}, {ANNOTATION_NODE_NOTICE: "-5"}, None, None),
    ],
)
def test_node_notice_from_the_node(
    labels: dict[str, str] | None,
    annotations: dict[str, str] | None,
    seconds: int | None,
    source: str | None,
) -> None:
    node = None if labels is None and annotations is None else _node(labels, annotations)
    notice = node_notice.node_notice(node)
    if seconds is None:
        assert notice is None
        return
    assert notice is not None and notice.seconds == seconds
    assert source is not None and source in notice.source


def _pod(annotation: str | None = None, **kw: Any) -> dict[str, Any]:
    pod = make_pod(**kw)
    if annotation is not None:
        pod["metadata"]["annotations"][ANNOTATION_NODE_NOTICE] = annotation
    return pod


@pytest.mark.parametrize(
    ("pod", "notice", "want"),
    [
        # A bound, running pod gets its node's notice, once.
        (_pod(), NodeNotice(15, "x"), "15"),
        (_pod("15"), NodeNotice(15, "x"), None),
        (_pod("120"), NodeNotice(15, "x"), "15"),
        # The node no longer says (its label was removed): the annotation goes.
        (_pod("15"), None, "remove"),
        (_pod(), None, None),
        # Not bound yet, being deleted, or ended: nothing to write (too early, or too late).
        (_pod(node=None), NodeNotice(15, "x"), None),
        (_pod(deleting=True), NodeNotice(15, "x"), None),
        (_pod(phase="Failed", exit_code=75), NodeNotice(15, "x"), None),
        (_pod(phase="Succeeded", exit_code=0), NodeNotice(15, "x"), None),
        # Pending on its node (image pull): written before it starts.
        (_pod(phase="Pending"), NodeNotice(30, "x"), "30"),
    ],
)
def test_pod_notice_patch(pod: dict[str, Any], notice: NodeNotice | None, want: str | None) -> None:
    patch = node_notice.pod_notice_patch(pod, notice)
    if want is None:
        assert patch is None
    else:
        value = None if want == "remove" else want
        assert patch == {"metadata": {"annotations": {ANNOTATION_NODE_NOTICE: value}}}


def test_every_pod_reads_the_notice_annotation_through_a_downward_api_file() -> None:
    params = render.AttemptParams(attempt=1, grace_seconds=60, resume_from="", suspended=False)
    pod = render.render_job(META, make_spec(), params)["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == render.NODE_NOTICE_VOLUME]
    (item,) = volume["downwardAPI"]["items"]
    assert item["fieldRef"]["fieldPath"] == f"metadata.annotations['{ANNOTATION_NODE_NOTICE}']"
    (container,) = pod["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == render.NODE_NOTICE_VOLUME]
    assert mount["readOnly"] is True
    assert f"{mount['mountPath']}/{item['path']}" == render.NODE_NOTICE_FILE
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env[protocol.ENV_NODE_NOTICE_FILE] == render.NODE_NOTICE_FILE
    # The spec's fixed notice is still passed as before, for nodes that say nothing.
    assert protocol.ENV_NODE_NOTICE_SECONDS not in env
