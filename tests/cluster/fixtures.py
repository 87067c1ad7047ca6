"""pytest fixtures of the real control plane (loaded by tests/conftest.py for every test dir).

- ``control_plane`` (session): etcd, kube-apiserver, kube-controller-manager, kube-scheduler.
- ``node_agent`` (session): nodes ``node-1`` and ``node-2`` whose pods run as local processes.
- ``kueue`` (session, opt-in): Kueue with a ClusterQueue, flavor and priority classes.
- ``namespace`` (function): a fresh namespace, deleted afterwards.
- ``kueue_namespace`` (function): a fresh namespace with the LocalQueue ``kueue.local_queue``.
- ``s3_server`` (session): the S3-compatible server (versitygw, tests/cluster/s3.py) on loopback;
  it starts with the control plane when the node agent runs (which relays it into the pod
  network: ``s3_server.pod_endpoint``), and on its own for the runtime tests.
- ``s3_bucket`` (function): a fresh, empty bucket of ``s3_server``.
- ``s3_env`` (function): the server's endpoint and credentials in this process's environment
  (the ``AWS_*`` variables every S3 client reads; child processes inherit them), as a pod gets
  them from a Secret.

Binaries missing: the tests fail when $CI is set and are skipped otherwise. Component logs go to
a temporary directory whose path is shown with every failing cluster test and kept after a failed
session (removed after a clean one unless PREEMPTIBLE_KEEP_CLUSTER_LOGS=1).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from kubernetes.client.exceptions import ApiException

from .binaries import Binaries, MissingBinariesError, find_binaries, find_versitygw
from .controlplane import START_TIMEOUT, ControlPlane
from .kueue import Kueue
from .node_agent import NodeAgent
from .processes import wait_until
from .s3 import S3Server

__all__ = [
    "control_plane",
    "kueue",
    "kueue_namespace",
    "namespace",
    "node_agent",
    "s3_bucket",
    "s3_env",
    "s3_server",
]

NODE_NAMES = ("node-1", "node-2")
_CLUSTER_FIXTURES = {
    "s3_env",
    "control_plane",
    "node_agent",
    "kueue",
    "namespace",
    "kueue_namespace",
    "s3_server",
    "s3_bucket",
}


class _Session:
    workdir: Path | None = None
    s3_workdir: Path | None = None
    failures = 0


def _say(config: pytest.Config, message: str) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"[cluster] {message}")
    else:
        print(f"[cluster] {message}", flush=True)


def _binaries() -> Binaries:
    try:
        return find_binaries()
    except MissingBinariesError as exc:
        if os.environ.get("CI"):
            pytest.fail(str(exc), pytrace=False)
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def control_plane(request: pytest.FixtureRequest) -> Iterator[ControlPlane]:
    binaries = _binaries()
    workdir = Path(tempfile.mkdtemp(prefix="preemptible-cluster-"))
    _Session.workdir = workdir
    plane = ControlPlane(binaries, workdir, say=lambda m: _say(request.config, m))
    try:
        plane.start()
    except BaseException as exc:
        plane.stop()
        _Session.failures += 1
        raise RuntimeError(
            f"control plane failed to start ({exc}); logs in {plane.logs_dir}"
        ) from exc
    try:
        yield plane
    finally:
        plane.stop()
        keep = _Session.failures or os.environ.get("PREEMPTIBLE_KEEP_CLUSTER_LOGS")
        if keep:
            _say(request.config, f"cluster logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def _s3_optional(request: pytest.FixtureRequest) -> Iterator[S3Server | None]:
    """The S3 server, or None where it is not built (the cluster tests that do not need it
    still run; ``s3_server`` skips or fails)."""
    binary, version = find_versitygw()
    if binary is None:
        _say(request.config, f"S3 server: versitygw {version} not built, not started")
        yield None
        return
    workdir = Path(tempfile.mkdtemp(prefix="preemptible-s3-"))
    _Session.s3_workdir = workdir
    server = S3Server(binary, workdir)
    try:
        server.start()
    except BaseException as exc:
        server.stop()
        _Session.failures += 1
        raise RuntimeError(f"S3 server failed to start ({exc}); log {server.log}") from exc
    _say(
        request.config,
        f"S3 server: versitygw {version} at {server.endpoint} in "
        f"{server.started_seconds:.1f} s (data {server.data_dir})",
    )
    try:
        yield server
    finally:
        server.stop()
        if _Session.failures or os.environ.get("PREEMPTIBLE_KEEP_CLUSTER_LOGS"):
            _say(request.config, f"S3 server data and log kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def s3_server(_s3_optional: S3Server | None) -> S3Server:
    if _s3_optional is None:
        _, version = find_versitygw()
        message = (
            f"the S3 server (versitygw {version}) is not built; build it with "
            "`make cluster-binaries` (bash tests/cluster/build.sh)"
        )
        if os.environ.get("CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    _s3_optional.check_alive()
    return _s3_optional


@pytest.fixture
def s3_bucket(s3_server: S3Server, request: pytest.FixtureRequest) -> str:
    """A fresh bucket named after the test (left in place: the session's data is removed)."""
    return s3_server.create_bucket(_namespace_name(request)[:63].rstrip("-"))


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    env = s3_server.client_env()
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


@pytest.fixture(scope="session")
def node_agent(
    control_plane: ControlPlane,
    _s3_optional: S3Server | None,
    request: pytest.FixtureRequest,
) -> Iterator[NodeAgent]:
    agent = NodeAgent(
        control_plane.kubeconfig,
        control_plane.workdir / "node-agent",
        nodes=NODE_NAMES,
        apiserver_port=control_plane.apiserver_port,
        k8s_version=control_plane.binaries.k8s_version,
    )
    try:
        agent.start(timeout=START_TIMEOUT)
        _say(request.config, f"node agent: nodes {list(NODE_NAMES)}, log {agent.log_file}")
        if _s3_optional is not None:
            _s3_optional.pod_endpoint = agent.expose_host_port("s3", _s3_optional.port, 7070)
            _say(request.config, f"S3 server: pods reach it at http://{_s3_optional.pod_endpoint}")
        yield agent
    finally:
        agent.stop()


@pytest.fixture(scope="session")
def kueue(control_plane: ControlPlane, request: pytest.FixtureRequest) -> Iterator[Kueue]:
    try:
        control_plane.binaries.require_kueue()
    except MissingBinariesError as exc:
        if os.environ.get("CI"):
            pytest.fail(str(exc), pytrace=False)
        pytest.skip(str(exc))
    instance = Kueue(control_plane)
    try:
        instance.start()
        _say(request.config, f"kueue: ready in {instance.started_seconds:.1f} s")
        yield instance
    finally:
        instance.stop()


def _namespace_name(request: pytest.FixtureRequest) -> str:
    stem = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    return f"t-{stem}-{uuid.uuid4().hex[:5]}"


@pytest.fixture
def namespace(control_plane: ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace (its default ServiceAccount exists), deleted after the test."""
    name = _namespace_name(request)
    with control_plane.api_client() as client:
        core = kubernetes.client.CoreV1Api(client)
        core.create_namespace(
            {"metadata": {"name": name, "labels": {"preemptible.dev/test": "true"}}}
        )
        wait_until(
            f"ServiceAccount {name}/default",
            lambda: core.read_namespaced_service_account("default", name) is not None,
            timeout=START_TIMEOUT,
        )
    try:
        yield name
    finally:
        with contextlib.suppress(ApiException), control_plane.api_client() as client:
            kubernetes.client.CoreV1Api(client).delete_namespace(name)


@pytest.fixture
def kueue_namespace(kueue: Kueue, namespace: str) -> str:
    """A fresh namespace with the LocalQueue ``kueue.local_queue`` pointing at the ClusterQueue."""
    kueue.create_local_queue(namespace)
    return namespace


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[Any]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if not report.failed or not _CLUSTER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        return report
    if _Session.workdir is None and _Session.s3_workdir is None:
        return report
    _Session.failures += 1
    lines = []
    if _Session.workdir is not None:
        workdir = _Session.workdir
        logs = sorted(p.name for p in (workdir / "logs").glob("*.log"))
        lines += [
            f"component logs in {workdir / 'logs'}: {', '.join(logs)}",
            f"node agent log and pod logs in {workdir / 'node-agent'}",
        ]
    if _Session.s3_workdir is not None:
        lines.append(f"S3 server log and data in {_Session.s3_workdir}")
    report.sections.append(("cluster logs", "\n".join(lines)))
    return report
