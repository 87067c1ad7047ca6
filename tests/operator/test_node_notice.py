"""A node's notice, inferred from the Node, reaches the runtime's deadline on the real control
plane (issue 32, item 3): the operator (least privilege, held to its admission policy) annotates
the bound pod with its node's notice, the downward-API volume shows it as a file, and the runtime
reads it at SIGTERM. A spot-labelled node gives 15 s; an administrator's annotation of 1 s on the
node then makes a save that cannot fit end as DeadlineTooShort, with no notice in the spec."""

from __future__ import annotations

import time
from pathlib import Path

import kubernetes
import pytest
from kubernetes.client.exceptions import ApiException

from preemptible_operator import render
from preemptible_operator.node_notice import ANNOTATION_NODE_NOTICE
from tests.cluster.controlplane import ControlPlane
from tests.cluster.kubeconfig import api_client_from
from tests.cluster.node_agent import NodeAgent
from tests.operator.harness import OperatorProcess, TJClient, toy_training_job, wait_for
from trainer_runtime import protocol
from trainer_runtime.checkpoint.layout import CheckpointStore

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NODE = "node-2"
SPOT_LABEL = "cloud.google.com/gke-spot"


def test_a_spot_nodes_notice_reaches_the_runtimes_deadline(
    control_plane: ControlPlane,
    node_agent: NodeAgent,
    tj: TJClient,
    operator_identity: Path,
    least_privilege_operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    operator = least_privilege_operator
    name = "spot"
    core = kubernetes.client.CoreV1Api(control_plane.api_client())
    core.patch_node(NODE, {"metadata": {"labels": {SPOT_LABEL: "true"}}})
    try:
        body = toy_training_job(
            name,
            checkpoint_root,
            max_steps=400,
            step_sleep=1.0,
            save_steps=3,
            # Every checkpoint file takes 0.3 s to write: a save takes seconds, more than 1 s.
            extra_args=("--save-sleep", "0.3", "--save-async", "false"),
            grace={"initialSeconds": 30, "min": 5, "max": 120, "killWaitSeconds": 0.2},
            podTemplate={"spec": {"nodeSelector": {"kubernetes.io/hostname": NODE}}},
        )
        tj.create(body)

        def annotation() -> str | None:
            pod = tj.running_pod(name, 1)
            return (pod.metadata.annotations or {}).get(ANNOTATION_NODE_NOTICE) if pod else None

        # The spot label: GKE's 15 s for ordinary pods, written onto the bound pod.
        wait_for(
            "the pod annotated with the spot node's 15 s",
            lambda: annotation() == "15",
            on_timeout=lambda: tj.describe(name) + operator.tail(),
        )
        pod = tj.running_pod(name, 1)
        assert pod.spec.node_name == NODE
        (job,) = tj.jobs(name)
        env = {e.name: e.value for e in job.spec.template.spec.containers[0].env}
        assert protocol.ENV_NODE_NOTICE_SECONDS not in env, env  # nothing in the spec
        assert env[protocol.ENV_NODE_NOTICE_FILE] == render.NODE_NOTICE_FILE

        # The policy lets the operator's identity write that annotation and no other.
        with api_client_from(operator_identity) as sa:
            sa_core = kubernetes.client.CoreV1Api(sa)
            with pytest.raises(ApiException) as info:
                sa_core.patch_namespaced_pod(
                    pod.metadata.name, tj.ns, {"metadata": {"annotations": {"x": "y"}}}
                )
            assert info.value.status == 403 and "may only" in str(info.value.body)

        # The administrator says the node gives 1 s: the annotation follows (the operator's
        # node cache, then its next pass), and so does the pod's downward-API file.
        core.patch_node(NODE, {"metadata": {"annotations": {ANNOTATION_NODE_NOTICE: "1"}}})
        wait_for(
            "the pod annotated with the node's 1 s",
            lambda: annotation() == "1",
            on_timeout=lambda: tj.describe(name) + operator.tail(),
        )
        record = node_agent.record(tj.ns, pod.metadata.name)
        assert record is not None
        notice_file = (
            record.directory
            / "volumes"
            / render.NODE_NOTICE_VOLUME
            / Path(render.NODE_NOTICE_FILE).name
        )
        wait_for("the downward-API file says 1", lambda: notice_file.read_text() == "1")

        # Evict right after a blocking periodic save completed: the JIT save (seconds) cannot
        # fit the node's 1 s, whatever the 30 s grace.
        store = CheckpointStore(str(checkpoint_root / name))
        done = [
            s for s in range(3, 400, 3) if (checkpoint_root / name / f"checkpoint-{s}").exists()
        ]
        target = (max(done) if done else 0) + 3
        wait_for(
            f"checkpoint {target} complete",
            lambda: (
                store.inspect(str(checkpoint_root / name / f"checkpoint-{target}")).complete or None
            ),
            interval=0.1,
            on_timeout=lambda: tj.describe(name),
        )
        time.sleep(0.3)  # into the next step (a SIGTERM right at the save needs none)
        tj.evict(pod.metadata.name)
        first = wait_for(
            "attempt 1 recorded",
            lambda: next(
                (a for a in tj.status(name).get("attempts") or [] if a.get("outcome")), None
            ),
            on_timeout=lambda: tj.describe(name) + operator.tail(),
        )
        assert (first["outcome"], first["reason"]) == ("Preempted", "DeadlineTooShort"), first
        # The runtime's own account of its deadline (its termination message): the node's 1 s.
        assert "deadline too short" in first["message"] and "node notice 1.0 s" in first["message"]
        assert first["checkpoint"].endswith(f"checkpoint-{target}"), first
        assert first["exitCodes"] == [protocol.EXIT_PREEMPTED] and first["killed"] is False
        assert first["sigtermToExitSeconds"] < 5, first
        log = operator.log.read_text(errors="replace")
        assert "Forbidden" not in log and " 403" not in log, operator.tail(200)
    finally:
        core.patch_node(
            NODE,
            {
                "metadata": {
                    "labels": {SPOT_LABEL: None},
                    "annotations": {ANNOTATION_NODE_NOTICE: None},
                }
            },
        )
