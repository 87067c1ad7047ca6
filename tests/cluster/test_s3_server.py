"""The tier's S3 server (versitygw): the behaviours the runtime relies on, checked against the
real server with the client the runtime uses (s3fs), and a pod that reaches it from its own network
namespace with credentials from a Secret (envFrom), as a TrainingJob's pods do."""

from __future__ import annotations

import json
import os

import kubernetes
import pytest

from .controlplane import ControlPlane
from .helpers import job_manifest, python_container, wait_for_job_condition
from .node_agent import NodeAgent
from .s3 import S3Server

s3fs = pytest.importorskip("s3fs", reason="s3fs is the S3 client: pip install 'preemptible[s3]'")


def _fs(server: S3Server) -> s3fs.S3FileSystem:
    return s3fs.S3FileSystem(**server.storage_options(), skip_instance_cache=True)


def test_conditional_create_abort_and_ranged_reads(s3_server: S3Server, s3_bucket: str) -> None:
    fs = _fs(s3_server)
    key = f"{s3_bucket}/a/manifest.json"
    fs.pipe_file(key, b"first", mode="create")
    # If-None-Match: "*" on a single PUT: the second writer is refused, the first one's bytes stay
    with pytest.raises(FileExistsError):
        fs.pipe_file(key, b"second", mode="create")
    assert fs.cat_file(key) == b"first"

    # ... and on CompleteMultipartUpload (a file of two parts)
    data = os.urandom(11 << 20)
    with fs.open(f"{s3_bucket}/a/big", "xb", block_size=5 << 20) as fh:
        fh.write(data)
    handle = fs.open(f"{s3_bucket}/a/big", "xb", block_size=5 << 20)
    handle.write(data)
    with pytest.raises(FileExistsError):
        handle.close()

    # an aborted multipart upload leaves no object
    handle = fs.open(f"{s3_bucket}/a/aborted", "wb", block_size=5 << 20)
    handle.write(data)
    assert handle.mpu is not None  # parts were uploaded
    handle.discard()
    handle.closed = True  # (close() would try to upload the discarded buffer)
    fs.invalidate_cache()
    assert not fs.exists(f"{s3_bucket}/a/aborted")

    assert fs.cat_file(f"{s3_bucket}/a/big", start=3, end=1 << 20) == data[3 : 1 << 20]


def test_a_restarted_server_keeps_its_objects(s3_server: S3Server, s3_bucket: str) -> None:
    fs = _fs(s3_server)
    fs.pipe_file(f"{s3_bucket}/kept", b"x" * 1000)
    s3_server.kill()
    s3_server.restart()
    fs = _fs(s3_server)
    assert fs.cat_file(f"{s3_bucket}/kept") == b"x" * 1000


POD_CLIENT = """
import json, os, pathlib, s3fs
fs = s3fs.S3FileSystem()  # endpoint and credentials from the environment (the Secret)
bucket = os.environ["BUCKET"]
fs.pipe_file(f"{bucket}/from-pod", b"written by a pod")
out = {"endpoint": os.environ["AWS_ENDPOINT_URL"], "listing": fs.ls(bucket)}
pathlib.Path(os.environ["PREEMPTIBLE_TERMINATION_LOG"]).write_text(json.dumps(out))
"""


@pytest.mark.cluster
@pytest.mark.slow
def test_a_pod_reaches_the_server_with_credentials_from_a_secret(
    control_plane: ControlPlane,
    node_agent: NodeAgent,
    s3_server: S3Server,
    s3_bucket: str,
    namespace: str,
) -> None:
    container = python_container(POD_CLIENT, env={"BUCKET": s3_bucket})
    container["envFrom"] = [{"secretRef": {"name": "s3"}}]
    with control_plane.api_client() as client:
        core = kubernetes.client.CoreV1Api(client)
        core.create_namespaced_secret(
            namespace,
            {"metadata": {"name": "s3"}, "stringData": s3_server.client_env(pod=True)},
        )
        kubernetes.client.BatchV1Api(client).create_namespaced_job(
            namespace, job_manifest("s3-client", [container])
        )
        wait_for_job_condition(client, namespace, "s3-client", "Complete", timeout=120)
        pods = core.list_namespaced_pod(namespace, label_selector="job-name=s3-client").items
    message = json.loads(pods[0].status.container_statuses[0].state.terminated.message)
    if node_agent.network is not None:
        # its own network namespace: the host's loopback is not the pod's, the relay is
        assert not message["endpoint"].startswith("http://127."), message
    assert message["endpoint"] == f"http://{s3_server.pod_endpoint}"
    assert f"{s3_bucket}/from-pod" in message["listing"]
    assert _fs(s3_server).cat_file(f"{s3_bucket}/from-pod") == b"written by a pod"
