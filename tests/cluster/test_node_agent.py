"""The stand-in node agent against the real API: status, termination messages, volumes and path
rewriting, restarts, and deletion with SIGTERM, grace period and SIGKILL."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from kubernetes.client.exceptions import ApiException

from .controlplane import ControlPlane
from .helpers import condition, eventually, python_container
from .node_agent import NodeAgent

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _pod(name: str, containers: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"app": "agent-test"},
                     "annotations": {"note": "hello"}},
        "spec": {"restartPolicy": "Never", "containers": containers, **spec},
    }  # fmt: skip


def _read(client: kubernetes.client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    core = kubernetes.client.CoreV1Api(client)
    return client.sanitize_for_serialization(core.read_namespaced_pod(name, namespace))


def _terminal(client: kubernetes.client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        pod = _read(client, namespace, name)
        return pod if pod["status"].get("phase") in ("Succeeded", "Failed") else None

    return eventually(f"pod {namespace}/{name} terminal", probe, timeout=120)


MESSAGE_CODE = """
import os, pathlib, sys
env = {k: os.environ[k] for k in ("POD_NAME", "NS", "APP", "NOTE", "POD_IP", "SHARED")}
shared = pathlib.Path(os.environ["SHARED"])
env["FROM_INIT"] = (shared / "init.txt").read_text()
env["CWD"] = os.getcwd()
pathlib.Path(os.environ["PREEMPTIBLE_TERMINATION_LOG"]).write_text(repr(sorted(env.items())))
sys.exit(3)
"""


def test_status_message_env_and_shared_empty_dir(
    control_plane: ControlPlane, node_agent: NodeAgent, namespace: str
) -> None:
    init = python_container(
        "import pathlib, sys; pathlib.Path(sys.argv[1]).write_text('from-init')",
        "/work/init.txt",
        name="init",
        mounts={"scratch": "/work"},
    )
    main = python_container(MESSAGE_CODE, mounts={"scratch": "/work"})
    main["workingDir"] = "/work"
    main["env"] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
        {"name": "NOTE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['note']"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "SHARED", "value": "/work"},
    ]
    pod = _pod(
        "message", [main], initContainers=[init], volumes=[{"name": "scratch", "emptyDir": {}}]
    )
    with control_plane.api_client() as client:
        kubernetes.client.CoreV1Api(client).create_namespaced_pod(namespace, pod)
        status = _terminal(client, namespace, "message")["status"]
    assert status["phase"] == "Failed"
    terminated = status["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 3 and terminated["reason"] == "Error"
    env = dict(eval(terminated["message"]))  # the pod wrote repr() of a list of pairs
    record = node_agent.record(namespace, "message")
    assert record is not None
    scratch = str(record.directory / "volumes" / "scratch")
    assert env == {
        "POD_NAME": "message",
        "NS": namespace,
        "APP": "agent-test",
        "NOTE": "hello",
        "POD_IP": status["podIP"],
        "SHARED": scratch,  # mountPath rewritten to the emptyDir's host directory
        "FROM_INIT": "from-init",  # the init container wrote into the same emptyDir
        "CWD": scratch,
    }
    assert status["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    for kind, expected in (("Initialized", "True"), ("Ready", "False"), ("PodScheduled", "True")):
        assert condition({"status": status}, kind)["status"] == expected  # type: ignore[index]


def test_fallback_to_logs_on_error(
    control_plane: ControlPlane, node_agent: NodeAgent, namespace: str
) -> None:
    code = "import sys; print('first'); print('boom: bad input'); sys.exit(2)"
    container = python_container(code)
    container["terminationMessagePolicy"] = "FallbackToLogsOnError"
    with control_plane.api_client() as client:
        kubernetes.client.CoreV1Api(client).create_namespaced_pod(
            namespace, _pod("fallback", [container])
        )
        status = _terminal(client, namespace, "fallback")["status"]
    terminated = status["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 2
    assert terminated["message"] == "first\nboom: bad input\n"


def test_the_launchers_of_the_image_run_as_the_pod_command(
    control_plane: ControlPlane, node_agent: NodeAgent, namespace: str
) -> None:
    """As in the Docker image, whose bin holds every installed distribution's console scripts:
    `accelerate` and `torchrun` (from our dependencies) and `trainer-runtime` (ours) resolve as
    `command`, and a launcher's worker (started with the launcher's own interpreter) imports
    this project."""

    def container(name: str, *argv: str) -> dict[str, Any]:
        return {"name": name, "image": "preemptible:test", "command": list(argv),
                "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}}  # fmt: skip

    accelerate = ("accelerate", "launch", "--cpu", "--num_processes", "1", "--num_machines", "1",
                  "--mixed_precision", "no", "--dynamo_backend", "no",
                  "-m", "trainer_runtime.cli", "--help")  # fmt: skip
    containers = [
        container("accelerate", *accelerate),
        container("torchrun", "torchrun", "--help"),
        container("trainer-runtime", "trainer-runtime", "--help"),
    ]
    with control_plane.api_client() as client:
        kubernetes.client.CoreV1Api(client).create_namespaced_pod(
            namespace, _pod("launchers", containers)
        )
        status = _terminal(client, namespace, "launchers")["status"]
    codes = {s["name"]: s["state"]["terminated"] for s in status["containerStatuses"]}
    logs = {n: node_agent.log_path(namespace, "launchers", n).read_text() for n in codes}
    assert {n: t["exitCode"] for n, t in codes.items()} == dict.fromkeys(logs, 0), (codes, logs)
    assert status["phase"] == "Succeeded"
    # accelerate's worker ran our CLI: the launcher's interpreter is the image's python.
    assert "usage: trainer-runtime" in logs["accelerate"], logs["accelerate"]
    assert "usage: torchrun" in logs["torchrun"], logs["torchrun"]
    assert "usage: trainer-runtime" in logs["trainer-runtime"], logs["trainer-runtime"]


ESCAPER = """
import os, pathlib, subprocess, sys, time
# A child in a session of its own (as torchrun starts its workers): the container's process group
# does not hold it, a PID namespace would.
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         start_new_session=True)
pathlib.Path(os.environ["PREEMPTIBLE_TERMINATION_LOG"]).write_text(str(child.pid))
sys.exit(4)
"""


def test_processes_that_left_the_group_end_with_the_container(
    control_plane: ControlPlane, node_agent: NodeAgent, namespace: str
) -> None:
    with control_plane.api_client() as client:
        pod = _pod("escaper", [python_container(ESCAPER)])
        kubernetes.client.CoreV1Api(client).create_namespaced_pod(namespace, pod)
        status = _terminal(client, namespace, "escaper")["status"]
    terminated = status["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 4
    child = int(terminated["message"])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        stat = Path(f"/proc/{child}/stat").read_text().split()
        if stat[2] == "Z":  # killed, not yet reaped by its (gone) parent's reaper
            break
        time.sleep(0.05)
    else:
        assert not Path(f"/proc/{child}").exists(), f"pid {child} outlived its container"


def test_on_failure_restarts_in_place(
    control_plane: ControlPlane, node_agent: NodeAgent, namespace: str
) -> None:
    # Fails on the first run, succeeds on the second (the emptyDir survives restarts).
    code = (
        "import pathlib, sys; m = pathlib.Path(sys.argv[1]);"
        "sys.exit(0) if m.exists() else (m.write_text('1'), sys.exit(4))"
    )
    container = python_container(code, "/state/marker", mounts={"state": "/state"})
    pod = _pod("restarts", [container], volumes=[{"name": "state", "emptyDir": {}}])
    pod["spec"]["restartPolicy"] = "OnFailure"
    with control_plane.api_client() as client:
        kubernetes.client.CoreV1Api(client).create_namespaced_pod(namespace, pod)
        status = _terminal(client, namespace, "restarts")["status"]
    container_status = status["containerStatuses"][0]
    assert status["phase"] == "Succeeded"
    assert container_status["restartCount"] == 1
    assert container_status["lastState"]["terminated"]["exitCode"] == 4
    assert container_status["state"]["terminated"]["exitCode"] == 0


def test_delete_sends_sigterm_waits_grace_then_sigkills(
    control_plane: ControlPlane, node_agent: NodeAgent, namespace: str, tmp_path: Path
) -> None:
    # Ignores SIGTERM: the agent must wait the whole grace period, then SIGKILL.
    code = (
        "import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        "pathlib.Path(sys.argv[1]).write_text('up'); time.sleep(600)"
    )
    container = python_container(code, "/out/up", mounts={"out": "/out"})
    pod = _pod(
        "stubborn",
        [container],
        terminationGracePeriodSeconds=3,
        volumes=[{"name": "out", "hostPath": {"path": str(tmp_path)}}],
    )
    with control_plane.api_client() as client:
        core = kubernetes.client.CoreV1Api(client)
        core.create_namespaced_pod(namespace, pod)
        eventually("process up", (tmp_path / "up").exists, timeout=120)
        running = _read(client, namespace, "stubborn")["status"]
        assert running["phase"] == "Running"
        assert condition({"status": running}, "Ready")["status"] == "True"  # type: ignore[index]
        core.delete_namespaced_pod("stubborn", namespace)
        record = node_agent.wait_for_record(namespace, "stubborn", timeout=60)

        def gone() -> bool:
            try:
                core.read_namespaced_pod("stubborn", namespace)
            except ApiException as exc:
                return exc.status == 404
            return False

        eventually("pod removed by the agent", gone, timeout=60)
    run = record.last_run()
    assert run is not None and run.exit is not None
    assert record.grace_seconds == 3
    assert run.killed and run.exit.signal == 9 and run.exit.exit_code == 137
    assert run.seconds_after_sigterm is not None and run.seconds_after_sigterm >= 3.0
    assert record.phase == "Failed"


def test_relist_stops_pods_deleted_while_the_watch_was_down(
    control_plane: ControlPlane, node_agent: NodeAgent, namespace: str, tmp_path: Path
) -> None:
    # The listing after a watch gap no longer holds the pod: its process must be stopped.
    code = "import pathlib, sys, time; pathlib.Path(sys.argv[1]).write_text('up'); time.sleep(600)"
    container = python_container(code, "/out/up", mounts={"out": "/out"})
    pod = _pod(
        "vanished",
        [container],
        terminationGracePeriodSeconds=2,
        volumes=[{"name": "out", "hostPath": {"path": str(tmp_path)}}],
    )
    with control_plane.api_client() as client:
        core = kubernetes.client.CoreV1Api(client)
        core.create_namespaced_pod(namespace, pod)
        eventually("process up", (tmp_path / "up").exists, timeout=120)
        record = node_agent.record(namespace, "vanished")
        assert record is not None
        others = {r.uid for r in node_agent.records() if r.uid != record.uid}
        stopped = node_agent.forget_missing(record.node, others)
        assert stopped == [record.uid]
        assert record.done.wait(60), "the pod process was not stopped"
    run = record.last_run()
    assert run is not None and run.exit is not None and run.seconds_after_sigterm is not None
    # A listing that still holds every pod stops nothing.
    assert node_agent.forget_missing(record.node, {r.uid for r in node_agent.records()}) == []


def test_a_killed_node_stops_heartbeating_and_reports_its_pods_when_restored(
    control_plane: ControlPlane, node_agent: NodeAgent, namespace: str
) -> None:
    node = "node-2"
    pod = _pod("doomed", [python_container("import time; time.sleep(600)")], nodeName=node)
    with control_plane.api_client() as client:
        core = kubernetes.client.CoreV1Api(client)
        coordination = kubernetes.client.CoordinationV1Api(client)
        core.create_namespaced_pod(namespace, pod)
        eventually(
            "pod Running", lambda: _read(client, namespace, "doomed")["status"].get("phase")
            == "Running",
        )  # fmt: skip
        (record,) = node_agent.kill_node(node)
        try:
            assert record.done.wait(30), "the pod's process was not killed"
            run = record.last_run()
            assert run is not None and run.exit is not None and run.exit.signal == 9
            renewed = coordination.read_namespaced_lease(node, "kube-node-lease").spec.renew_time
            time.sleep(12)  # longer than a heartbeat: nothing is reported any more
            lease = coordination.read_namespaced_lease(node, "kube-node-lease")
            assert lease.spec.renew_time == renewed
            assert _read(client, namespace, "doomed")["status"]["phase"] == "Running"
        finally:
            node_agent.restore_node(node)
        # Back again, the node reports what happened to its pod.
        status = _terminal(client, namespace, "doomed")["status"]
        assert status["phase"] == "Failed"
        (container,) = status["containerStatuses"]
        assert container["state"]["terminated"]["exitCode"] == 137
        lease = coordination.read_namespaced_lease(node, "kube-node-lease")
        assert lease.spec.renew_time != renewed
