"""What the node agent gives a pod beyond processes, against the real API: its own network
identity (non-loopback IP in its own network namespace, reachable from other pods and from the
host, listed in EndpointSlices), names as cluster DNS gives them (Indexed Job + headless Service),
an in-cluster client (projected service-account token, ca.crt, namespace,
KUBERNETES_SERVICE_HOST/PORT), and PersistentVolumeClaims bound by the tier's provisioner and
mounted at their mountPath."""

from __future__ import annotations

import ipaddress
import json
import socket
from typing import Any

import kubernetes
import pytest

from .controlplane import ControlPlane
from .helpers import eventually, job_manifest, python_container, wait_for_job_condition
from .node_agent import NodeAgent

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture
def netns_agent(node_agent: NodeAgent) -> NodeAgent:
    if node_agent.network is None:
        pytest.skip(f"pods have no network namespaces here: {node_agent.network_unavailable}")
    return node_agent


SERVER = """
import json, os, pathlib, socket
got = []
srv = socket.socket()
srv.bind((os.environ["POD_IP"], 7000))
srv.listen()
for _ in range(3):
    conn, addr = srv.accept()
    got.append([addr[0], conn.recv(100).decode()])
    conn.close()
pathlib.Path(os.environ["PREEMPTIBLE_TERMINATION_LOG"]).write_text(json.dumps(got))
"""

CLIENT = """
import json, os, pathlib, socket, sys, time
job, ns = sys.argv[1], os.environ["NS"]
names = [f"{job}-0.workers", f"{job}-0.workers.{ns}.svc.cluster.local", "workers"]
resolved = {}
deadline = time.monotonic() + 90
for name in names:
    while True:
        try:
            resolved[name] = socket.gethostbyname(name)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
for name in names[:2]:
    while True:
        try:
            with socket.create_connection((name, 7000), timeout=5) as s:
                s.sendall(name.encode())
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
own = socket.gethostname()
out = {"resolved": resolved, "hostname": own, "own_ip": socket.gethostbyname(own),
       "pod_ip": os.environ["POD_IP"]}
pathlib.Path(os.environ["PREEMPTIBLE_TERMINATION_LOG"]).write_text(json.dumps(out))
"""


def _fieldref(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def test_indexed_job_pods_find_each_other_by_name_and_the_host_reaches_them(
    control_plane: ControlPlane, netns_agent: NodeAgent, namespace: str
) -> None:
    job = "ring"
    code = f"import os, sys\nexec({SERVER!r} if os.environ['JOB_COMPLETION_INDEX'] == '0' else "
    code += f"{CLIENT!r})"
    container = python_container(code, job)
    container["env"] = [
        _fieldref("POD_IP", "status.podIP"),
        _fieldref("NS", "metadata.namespace"),
        _fieldref(
            "JOB_COMPLETION_INDEX",
            "metadata.annotations['batch.kubernetes.io/job-completion-index']",
        ),
    ]
    manifest = job_manifest(job, [container], completions=2, parallelism=2, indexed=True)
    manifest["spec"]["template"]["spec"]["subdomain"] = "workers"
    manifest["spec"]["template"]["spec"]["topologySpreadConstraints"] = [
        {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
         "whenUnsatisfiable": "DoNotSchedule", "labelSelector": {"matchLabels": {"job-name": job}}}
    ]  # fmt: skip
    with control_plane.api_client() as client:
        core = kubernetes.client.CoreV1Api(client)
        core.create_namespaced_service(
            namespace,
            {"metadata": {"name": "workers"},
             "spec": {"clusterIP": "None", "selector": {"job-name": job},
                      "ports": [{"name": "p", "port": 7000}]}},
        )  # fmt: skip
        kubernetes.client.BatchV1Api(client).create_namespaced_job(namespace, manifest)

        def server_pod() -> Any:
            pods = core.list_namespaced_pod(namespace, label_selector=f"job-name={job}").items
            return next(
                (p for p in pods if p.metadata.name.startswith(f"{job}-0-") and p.status.pod_ip),
                None,
            )

        pod0 = eventually("index 0 has an IP", server_pod)
        ip0 = pod0.status.pod_ip
        address = ipaddress.ip_address(ip0)
        assert not address.is_loopback and address in netns_agent.network.subnet  # type: ignore[union-attr]
        discovery = kubernetes.client.DiscoveryV1Api(client)

        def sliced() -> bool:
            slices = discovery.list_namespaced_endpoint_slice(
                namespace, label_selector="kubernetes.io/service-name=workers"
            ).items
            return any(ip0 in (e.addresses or []) for s in slices for e in s.endpoints or [])

        eventually("EndpointSlice lists index 0", sliced)

        # The control plane's side (this test process, on the host) reaches the pod's address.
        # Ready means started (no probes), not yet listening: retry until it listens.
        def send() -> bool:
            try:
                with socket.create_connection((ip0, 7000), timeout=10) as s:
                    s.sendall(b"host")
            except ConnectionRefusedError:
                return False
            return True

        eventually(f"index 0 listening at {ip0}:7000", send, timeout=120)
        wait_for_job_condition(client, namespace, job, timeout=180)
        pods = {p.metadata.name: p for p in core.list_namespaced_pod(namespace).items}

    def message(prefix: str) -> Any:
        (name,) = [n for n in pods if n.startswith(prefix)]
        record = netns_agent.wait_for_record(namespace, name)
        run = record.last_run()
        assert run is not None and run.exit is not None and run.exit.exit_code == 0, (
            netns_agent.log_path(namespace, name).read_text()
        )
        return record, json.loads(run.message)

    record0, got = message(f"{job}-0-")
    record1, out = message(f"{job}-1-")
    assert {record0.node, record1.node} == {"node-1", "node-2"}
    ip1 = record1.ip
    assert out["pod_ip"] == ip1 and out["hostname"] == f"{job}-1" and out["own_ip"] == ip1, out
    resolved = out["resolved"]
    assert resolved[f"{job}-0.workers"] == ip0, out
    assert resolved[f"{job}-0.workers.{namespace}.svc.cluster.local"] == ip0, out
    assert resolved["workers"] in (ip0, ip1), out  # a headless Service: its endpoints
    senders = sorted(tuple(x) for x in got)
    fqdn = f"{job}-0.workers.{namespace}.svc.cluster.local"
    assert (ip1, f"{job}-0.workers") in senders and (ip1, fqdn) in senders, senders
    (host_sender,) = [a for a, text in senders if text == "host"]
    assert ipaddress.ip_address(host_sender) not in netns_agent.network.subnet  # type: ignore[union-attr]


IN_CLUSTER = """
import json, os, pathlib
from kubernetes import client, config
config.load_incluster_config()
base = "/var/run/secrets/kubernetes.io/serviceaccount"
ns = pathlib.Path(base, "namespace").read_text()
me = client.CoreV1Api().read_namespaced_pod(os.environ["POD_NAME"], ns)
data = pathlib.Path("/mnt/preemptible-" + "tier-test")  # built here: no path rewriting helps
(data / "note.txt").write_text(me.status.pod_ip)
out = {"ns": ns, "ip": me.status.pod_ip, "sa": me.spec.service_account_name,
       "ca": pathlib.Path(base, "ca.crt").read_text().startswith("-----BEGIN CERTIFICATE"),
       "host": os.environ["KUBERNETES_SERVICE_HOST"], "port": os.environ["KUBERNETES_SERVICE_PORT"]}
pathlib.Path(os.environ["PREEMPTIBLE_TERMINATION_LOG"]).write_text(json.dumps(out))
"""

READER = """
import os, pathlib
text = pathlib.Path("/mnt/preemptible-" + "tier-test", "note.txt").read_text()
pathlib.Path(os.environ["PREEMPTIBLE_TERMINATION_LOG"]).write_text(text)
"""


def test_in_cluster_client_and_a_provisioned_claim_shared_between_nodes(
    control_plane: ControlPlane, netns_agent: NodeAgent, namespace: str
) -> None:
    with control_plane.api_client() as client:
        core = kubernetes.client.CoreV1Api(client)
        rbac = kubernetes.client.RbacAuthorizationV1Api(client)
        core.create_namespaced_service_account(namespace, {"metadata": {"name": "reader"}})
        rbac.create_namespaced_role(
            namespace,
            {"metadata": {"name": "pod-reader"},
             "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]},
        )  # fmt: skip
        rbac.create_namespaced_role_binding(
            namespace,
            {"metadata": {"name": "reader"},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                         "name": "pod-reader"},
             "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}]},
        )  # fmt: skip
        # No storageClassName: the default class of the tier's provisioner.
        core.create_namespaced_persistent_volume_claim(
            namespace,
            {"metadata": {"name": "data"},
             "spec": {"accessModes": ["ReadWriteMany"],
                      "resources": {"requests": {"storage": "1Gi"}}}},
        )  # fmt: skip
        claim = eventually(
            "claim Bound",
            lambda: (
                (c := core.read_namespaced_persistent_volume_claim("data", namespace))
                and c.status.phase == "Bound"
                and c
            ),
        )
        pv = core.read_persistent_volume(claim.spec.volume_name)
        assert pv.spec.host_path.path.startswith(str(netns_agent.workdir))
        assert claim.spec.storage_class_name == "standard"

        def pod(name: str, code: str, node: str) -> dict[str, Any]:
            container = python_container(code, name="main")
            container["env"] = [_fieldref("POD_NAME", "metadata.name")]
            container["volumeMounts"] = [
                {"name": "data", "mountPath": "/mnt/preemptible-tier-test"}
            ]
            return {
                "metadata": {"name": name},
                "spec": {"restartPolicy": "Never", "nodeName": node,
                         "serviceAccountName": "reader", "containers": [container],
                         "volumes": [{"name": "data",
                                      "persistentVolumeClaim": {"claimName": "data"}}]},
            }  # fmt: skip

        core.create_namespaced_pod(namespace, pod("writer", IN_CLUSTER, "node-1"))
        writer = netns_agent.wait_for_record(namespace, "writer", timeout=180)
        log = netns_agent.log_path(namespace, "writer")
        run = writer.last_run()
        assert run is not None and run.exit is not None and run.exit.exit_code == 0, log.read_text()
        out = json.loads(run.message)
        assert out == {
            "ns": namespace,
            "ip": writer.ip,
            "sa": "reader",
            "ca": True,
            "host": "10.0.0.1",
            "port": "443",
        }
        core.create_namespaced_pod(namespace, pod("reader", READER, "node-2"))
        reader = netns_agent.wait_for_record(namespace, "reader", timeout=180)
        run = reader.last_run()
        assert run is not None and run.exit is not None and run.exit.exit_code == 0, (
            netns_agent.log_path(namespace, "reader").read_text()
        )
        assert run.message == writer.ip
        # Deleting the claim releases the volume; the provisioner removes it and its directory.
        for name in ("writer", "reader"):
            core.delete_namespaced_pod(name, namespace)
        core.delete_namespaced_persistent_volume_claim("data", namespace)
        eventually(
            f"volume {pv.metadata.name} deleted",
            lambda: not [v for v in core.list_persistent_volume().items
                         if v.metadata.name == pv.metadata.name],
        )  # fmt: skip
