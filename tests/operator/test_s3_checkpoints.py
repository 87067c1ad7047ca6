"""TrainingJobs checkpointing to the tier's real S3 server, end to end on the real control plane.

- manifests/examples/s3.yaml (numNodes: 2, credentials from a Secret named in
  spec.checkpoint.credentialsSecret) as written, except its steps, CPU, the Secret's values (the
  tier's server, reached from the pods' network namespaces through the agent's relay), the bucket
  and the Kueue queue: Kueue preempts it mid-run, both ranks upload their shares of the JIT
  checkpoint to S3 and exit 75 at the same step, the operator (reading the bucket with its own
  credentials, as the chart's checkpointStorage values give it) shows that checkpoint and resumes
  attempt 2 from it, 0 lost steps, final weights bit-identical to an uninterrupted 2-node run;
- a bucket that does not exist fails the attempt before training, and the TrainingJob's status
  names the URL.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from tests.cluster.controlplane import ControlPlane
from tests.cluster.helpers import job_manifest, python_container
from tests.cluster.kueue import Kueue
from tests.cluster.node_agent import NodeAgent
from tests.cluster.s3 import S3Server
from tests.operator.harness import (
    OperatorProcess,
    TJClient,
    delete_training_jobs,
    free_port,
    wait_for,
)
from tests.packaging.tools import REPO_ROOT
from tests.s3.helpers import client as s3_client
from tests.s3.helpers import download
from trainer_runtime.protocol import read_termination_message
from trainer_runtime.testing import load_model_tensors

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.s3, pytest.mark.kueue]

STEPS = 36
EXAMPLE = REPO_ROOT / "manifests" / "examples" / "s3.yaml"


@pytest.fixture
def netns_agent(node_agent: NodeAgent) -> NodeAgent:
    if node_agent.network is None:
        pytest.skip(f"multi-node pods need network namespaces: {node_agent.network_unavailable}")
    return node_agent


def _example(name: str, bucket: str, cpu: str, **spec: Any) -> tuple[dict, dict]:
    secret, tj = (d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d)
    tj = copy.deepcopy(tj)
    tj["metadata"]["name"] = name
    body = tj["spec"]
    body["args"] = [f"--max-steps={STEPS}", f"--save-steps={STEPS}", "--step-sleep=0.3"]
    body["resourcesPerNode"]["requests"] = {"cpu": cpu, "memory": "256Mi"}
    body["checkpoint"]["uri"] = f"s3://{bucket}/runs/{name}"
    body["gracePeriod"] = {"initialSeconds": 60, "min": 5, "max": 120}
    labels = body["podTemplate"]["spec"]["topologySpreadConstraints"][0]["labelSelector"]
    labels["matchLabels"]["preemptible.dev/training-job"] = name
    body["podTemplate"]["spec"]["topologySpreadConstraints"][0]["whenUnsatisfiable"] = (
        "DoNotSchedule"
    )
    body.update(spec)
    return secret, tj


@pytest.fixture
def s3_operator(
    control_plane: ControlPlane,
    tj_crd: None,
    namespace: str,
    s3_bucket: str,
    s3_env: dict,
    checkpoint_root: Path,
    tmp_path: Path,
) -> Any:
    """The operator on the host, reading the bucket with its own credentials (the environment
    s3_env set: what the chart's checkpointStorage.credentialsSecret gives its pod) through the
    path map the chart's checkpointStorage.pathMap renders."""
    prefix = f"s3://{s3_bucket}/runs"
    op = OperatorProcess(
        control_plane.kubeconfig,
        namespace,
        checkpoint_root,
        tmp_path / "operator.log",
        extra=("--checkpoint-path-map", f"{prefix}={prefix}"),
        metrics_port=free_port(),
    )
    op.start()
    try:
        yield op
    finally:
        with control_plane.api_client() as client:
            delete_training_jobs(client, namespace, op)
        op.kill()


def _create_secret(tj: TJClient, secret: dict, server: S3Server) -> None:
    body = copy.deepcopy(secret)
    body["stringData"] = server.client_env(pod=True)  # the endpoint pods reach, the credentials
    tj.core.create_namespaced_secret(tj.ns, body)


def test_two_node_job_on_s3_preempted_by_kueue_resumes_bit_identical(
    control_plane: ControlPlane,
    netns_agent: NodeAgent,
    kueue: Kueue,
    s3_server: S3Server,
    s3_bucket: str,
    tj: TJClient,
    s3_operator: OperatorProcess,
    tmp_path: Path,
) -> None:
    kueue.create_local_queue(tj.ns)
    per_node = str(int(kueue.quota["cpu"]) // 2)  # the two pods take the whole quota
    secret, mn = _example(
        "mn", s3_bucket, per_node, queueName=kueue.local_queue, priorityClass=kueue.low_priority
    )
    _, ref = _example("ref", s3_bucket, "200m")  # the uninterrupted reference, outside Kueue
    _create_secret(tj, secret, s3_server)
    tj.create(ref)
    tj.create(mn)

    def describe() -> str:
        return "\n".join(tj.describe(n) for n in ("mn", "ref")) + s3_operator.tail()

    wait_for(
        "mn training (step >= 4)",
        lambda: (tj.status("mn").get("progress") or {}).get("step", 0) >= 4,
        on_timeout=describe,
    )
    high = job_manifest(
        "high",
        [python_container("import time; time.sleep(3)", cpu=kueue.quota["cpu"])],
        labels=kueue.job_labels(kueue.high_priority),
        suspend=True,
    )
    with control_plane.api_client() as client:
        kubernetes.client.BatchV1Api(client).create_namespaced_job(tj.ns, high)
    for name in ("mn", "ref"):
        status = wait_for(
            f"{name} finished",
            lambda name=name: tj.phase_is(name, "Succeeded", "Failed"),
            on_timeout=describe,
        )
        assert status["phase"] == "Succeeded", describe()

    status = tj.status("mn")
    first, second = status["attempts"]
    assert (first["outcome"], first["reason"]) == ("Preempted", "KueuePreempted"), describe()
    assert first["exitCodes"] == [75, 75] and first["lostSteps"] == 0, describe()
    jit = f"s3://{s3_bucket}/runs/mn/checkpoint-{first['endStep']}"
    assert first["checkpoint"] == jit, first
    # Both ranks stopped at the step of that checkpoint and uploaded their shares of it.
    prefix = "mn-a1-"
    records = [
        r for r in netns_agent.records() if r.namespace == tj.ns and r.name.startswith(prefix)
    ]
    steps = []
    for record in records:
        record.done.wait(120)
        run = record.last_run()
        assert run is not None and run.exit is not None and run.exit.exit_code == 75, record
        message = read_termination_message(run.message)
        assert message is not None and message.complete, run.message
        steps.append(message.step)
    assert steps == [first["endStep"]] * 2, steps
    listed = {f.rsplit("/", 1)[-1] for f in s3_client(s3_server).find(jit.removeprefix("s3://"))}
    assert {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"} <= listed
    # The operator read the bucket: it chose attempt 2's resume point from storage and shows the
    # newest complete checkpoint (kubectl get tj's CHECKPOINT column).
    assert second["resumeFrom"] == jit and second["startStep"] == first["endStep"], describe()
    assert status["lastCompleteCheckpoint"]["path"] == (
        f"s3://{s3_bucket}/runs/mn/checkpoint-{STEPS}"
    ), status
    assert (status["preemptions"], status.get("lostSteps", 0)) == (1, 0), describe()
    table = control_plane.kubectl("get", "tj", "mn", "-n", tj.ns).stdout
    header, row = table.strip().splitlines()
    assert row.split()[header.split().index("CHECKPOINT")] == str(STEPS), table

    ours = load_model_tensors(
        download(s3_server, f"s3://{s3_bucket}/runs/mn/checkpoint-{STEPS}", tmp_path / "mn")
    )
    theirs = load_model_tensors(
        download(s3_server, f"s3://{s3_bucket}/runs/ref/checkpoint-{STEPS}", tmp_path / "ref")
    )
    assert sorted(ours) == sorted(theirs)
    assert all(ours[k].equal(theirs[k]) for k in ours), "weights differ from the reference"


def test_a_missing_bucket_fails_the_attempt_and_the_status_names_the_url(
    node_agent: NodeAgent,
    s3_server: S3Server,
    s3_bucket: str,
    tj: TJClient,
    s3_operator: OperatorProcess,
) -> None:
    secret, body = _example("nb", s3_bucket, "200m", numNodes=1, maxRestarts=0)
    del body["spec"]["podTemplate"]
    body["spec"]["checkpoint"]["uri"] = "s3://no-such-bucket-29/runs/nb"
    _create_secret(tj, secret, s3_server)
    tj.create(body)
    status = wait_for(
        "nb failed",
        lambda: tj.phase_is("nb", "Failed", "Succeeded"),
        on_timeout=lambda: tj.describe("nb") + s3_operator.tail(),
    )
    assert status["phase"] == "Failed", tj.describe("nb")
    (attempt,) = status["attempts"]
    message = attempt["message"]
    assert "s3://no-such-bucket-29/runs/nb" in message, message
    assert "bucket 'no-such-bucket-29' does not exist" in message, message
    assert attempt.get("startStep") in (None, 0), attempt
