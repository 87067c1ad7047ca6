"""Table tests of the node agent's pure kubelet rules (no cluster needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .pod_network import network_unavailable_reason, pod_address
from .pod_runtime import (
    ContainerConfigError,
    ContainerExit,
    HostsPod,
    MountMap,
    ServiceRecord,
    container_exit,
    expand,
    field_value,
    hosts_file,
    pod_phase,
    termination_message,
)

ENV = {"A": "1", "DIR": "/data/x", "EMPTY": ""}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("plain", "plain"),
        ("$(A)", "1"),
        ("pre-$(A)-post", "pre-1-post"),
        ("$(DIR)/ckpt", "/data/x/ckpt"),
        ("$(MISSING)", "$(MISSING)"),
        ("$$(A)", "$(A)"),
        ("$$", "$"),
        ("$(EMPTY)x", "x"),
        ("$A", "$A"),
    ],
)
def test_expand(value: str, expected: str) -> None:
    assert expand(value, ENV) == expected


POD = {
    "metadata": {
        "name": "p",
        "namespace": "ns",
        "uid": "u-1",
        "labels": {"app": "train"},
        "annotations": {"batch.kubernetes.io/job-completion-index": "2"},
    },
    "spec": {"nodeName": "node-1", "serviceAccountName": "default"},
    "status": {"podIP": "127.9.0.2", "podIPs": [{"ip": "127.9.0.2"}], "hostIP": "127.0.0.1"},
}


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("metadata.name", "p"),
        ("metadata.namespace", "ns"),
        ("metadata.uid", "u-1"),
        ("metadata.labels['app']", "train"),
        ("metadata.labels['missing']", ""),
        ("metadata.annotations['batch.kubernetes.io/job-completion-index']", "2"),
        ("spec.nodeName", "node-1"),
        ("spec.serviceAccountName", "default"),
        ("status.podIP", "127.9.0.2"),
        ("status.podIPs", "127.9.0.2"),
        ("status.hostIP", "127.0.0.1"),
    ],
)
def test_field_value(path: str, expected: str) -> None:
    assert field_value(POD, path) == expected


def test_field_value_unsupported_names_the_field() -> None:
    with pytest.raises(ContainerConfigError, match=r"metadata\.generation"):
        field_value(POD, "metadata.generation")


MOUNTS = MountMap.of(
    [("/data", "/host/vol-data"), ("/data/deep", "/host/deep"), ("/out/", "/tmp/o")]
)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("/data", "/host/vol-data"),
        ("/data/ckpt", "/host/vol-data/ckpt"),
        ("/data/deep/x", "/host/deep/x"),  # longest mount wins
        ("/database", "/database"),  # prefix must end at a path boundary
        ("/out/f", "/tmp/o/f"),
        ("file:///data/ckpt", "file:///host/vol-data/ckpt"),
        ("--output-dir=/data/run", "--output-dir=/host/vol-data/run"),
        ("--name=/elsewhere", "--name=/elsewhere"),
        ("s3://bucket/data", "s3://bucket/data"),
        ("relative/data", "relative/data"),
        ("", ""),
    ],
)
def test_mount_rewrite(value: str, expected: str) -> None:
    assert MOUNTS.rewrite(value) == expected


@pytest.mark.parametrize(
    ("returncode", "expected"),
    [
        (0, ContainerExit(0, None, "Completed")),
        (1, ContainerExit(1, None, "Error")),
        (75, ContainerExit(75, None, "Error")),
        (-15, ContainerExit(143, 15, "Error")),
        (-9, ContainerExit(137, 9, "Error")),
    ],
)
def test_container_exit(returncode: int, expected: ContainerExit) -> None:
    assert container_exit(returncode) == expected


@pytest.mark.parametrize(
    ("policy", "exits", "terminating", "phase"),
    [
        ("Never", [None], False, "Running"),
        ("Never", [0], False, "Succeeded"),
        ("Never", [0, 1], False, "Failed"),
        ("Never", [0, None], False, "Running"),
        ("OnFailure", [0], False, "Succeeded"),
        ("OnFailure", [1], False, "Running"),  # restarting in place
        ("OnFailure", [1], True, "Failed"),
        ("Always", [0], False, "Running"),
        ("Always", [0], True, "Succeeded"),
        ("Always", [143], True, "Failed"),
        ("Never", [75], True, "Failed"),
    ],
)
def test_pod_phase(policy: str, exits: list[int | None], terminating: bool, phase: str) -> None:
    assert pod_phase(policy, exits, terminating=terminating) == phase


@pytest.mark.parametrize(
    ("file_content", "log", "policy", "exit_code", "expected"),
    [
        ("done", "log line\n", None, 0, "done"),
        ("done", "log line\n", "FallbackToLogsOnError", 1, "done"),
        (None, "log line\n", None, 1, ""),
        (None, "log line\n", "FallbackToLogsOnError", 0, ""),  # only on error
        (None, "a\nb\n", "FallbackToLogsOnError", 1, "a\nb\n"),
        ("", "a\n", "FallbackToLogsOnError", 2, "a\n"),
        ("x" * 5000, "", None, 0, "x" * 4096),  # kubelet reads at most 4 KiB
        (None, "".join(f"{i}\n" for i in range(100)), "FallbackToLogsOnError", 1,
         "".join(f"{i}\n" for i in range(20, 100))),  # last 80 lines
        (None, ("y" * 99 + "\n") * 30, "FallbackToLogsOnError", 1,
         (("y" * 99 + "\n") * 30)[-2048:]),  # last 2 KiB
    ],
)  # fmt: skip
def test_termination_message(
    tmp_path: Path,
    file_content: str | None,
    log: str,
    policy: str | None,
    exit_code: int,
    expected: str,
) -> None:
    message_file, log_file = tmp_path / "msg", tmp_path / "log"
    if file_content is not None:
        message_file.write_text(file_content)
    log_file.write_text(log)
    assert (
        termination_message(message_file, log_file, policy=policy, exit_code=exit_code) == expected
    )


_OWN = HostsPod("ns1", "job-1", "workers", "10.9.0.3")
_PEER = HostsPod("ns1", "job-0", "workers", "10.9.0.2")
_OTHER_NS = HostsPod("ns2", "job-0", "workers", "10.9.0.7")
_NO_SERVICE = HostsPod("ns1", "lonely", "nosvc", "10.9.0.8")
_SERVICES = [
    ServiceRecord("ns1", "workers", ("10.9.0.2", "10.9.0.3"), headless=True),
    ServiceRecord("ns2", "workers", ("10.9.0.7",), headless=True),
    ServiceRecord("default", "kubernetes", ("10.0.0.1",)),
]


def _lookup(text: str, name: str) -> list[str]:
    """What a files-backed resolver returns for ``name``: every address listing it."""
    found = []
    for line in text.splitlines():
        address, *names = line.split()
        if name in names:
            found.append(address)
    return found


@pytest.mark.parametrize(
    ("name", "addresses"),
    [
        # kubelet's own line: the pod's FQDN and hostname.
        ("job-1", ["10.9.0.3"]),
        ("job-1.workers.ns1.svc.cluster.local", ["10.9.0.3"]),
        ("localhost", ["127.0.0.1", "::1"]),
        # A peer behind a headless Service: the FQDN and every search-path form.
        ("job-0.workers", ["10.9.0.2"]),
        ("job-0.workers.ns1", ["10.9.0.2"]),
        ("job-0.workers.ns1.svc", ["10.9.0.2"]),
        ("job-0.workers.ns1.svc.cluster.local", ["10.9.0.2"]),
        # Another namespace: only qualified names reach it.
        ("job-0.workers.ns2.svc.cluster.local", ["10.9.0.7"]),
        ("job-0.workers.ns2", ["10.9.0.7"]),
        # No headless Service named like the subdomain: DNS has no record for the pod.
        ("lonely.nosvc", []),
        # Services: headless -> its endpoints; ClusterIP -> the ClusterIP.
        ("workers", ["10.9.0.2", "10.9.0.3"]),
        ("workers.ns2.svc.cluster.local", ["10.9.0.7"]),
        ("kubernetes.default.svc.cluster.local", ["10.0.0.1"]),
        ("kubernetes.default", ["10.0.0.1"]),
        ("kubernetes", []),  # a short name only resolves within the pod's own namespace
    ],
)
def test_hosts_file(name: str, addresses: list[str]) -> None:
    text = hosts_file(_OWN, [_OWN, _PEER, _OTHER_NS, _NO_SERVICE], _SERVICES)
    assert _lookup(text, name) == addresses, text


def test_hosts_file_without_subdomain_names_the_pod_by_hostname_only() -> None:
    own = HostsPod("ns1", "solo", "", "10.9.0.4")
    assert hosts_file(own, [own], []).splitlines()[-1] == "10.9.0.4\tsolo"


def test_without_root_the_pod_network_is_unavailable_with_a_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert network_unavailable_reason() == (
        "network namespaces need root (CAP_SYS_ADMIN, CAP_NET_ADMIN)"
    )


@pytest.mark.parametrize(
    ("index", "address"),
    [(0, "10.7.0.2"), (252, "10.7.0.254"), (253, "10.7.1.2"), (600, "10.7.2.96")],
)
def test_pod_address_skips_network_gateway_and_broadcast(index: int, address: str) -> None:
    assert pod_address(7, index) == address
