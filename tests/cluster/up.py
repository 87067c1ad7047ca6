"""`make cluster-up`: the test tier's cluster (control plane, Kueue with its queues, node agent, the
S3 server) for interactive use. Prints the kubeconfig and the S3 endpoint and credentials, runs
until Ctrl-C or SIGTERM, then stops everything.

    python -m tests.cluster.up [--no-kueue] [--no-s3] [--workdir DIR] [--nodes node-1,node-2]
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import kubernetes

from .binaries import MissingBinariesError, find_binaries
from .controlplane import ControlPlane
from .kueue import Kueue
from .node_agent import NodeAgent
from .s3 import S3Server


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster.up", description=__doc__)
    parser.add_argument("--no-kueue", action="store_true", help="do not start Kueue")
    parser.add_argument("--no-s3", action="store_true", help="do not start the S3 server")
    parser.add_argument(
        "--s3-bucket", default="checkpoints", help="bucket created at start (default: checkpoints)"
    )
    parser.add_argument("--workdir", type=Path, help="state and logs (default: a new temp dir)")
    parser.add_argument("--nodes", default="node-1,node-2", help="comma-separated node names")
    parser.add_argument("--keep", action="store_true", help="keep the workdir after stopping")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        binaries = find_binaries()
    except MissingBinariesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="preemptible-cluster-"))
    workdir.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())

    plane = ControlPlane(binaries, workdir)
    kueue: Kueue | None = None
    agent: NodeAgent | None = None
    s3: S3Server | None = None
    failed = False
    try:
        if not args.no_s3:
            s3 = S3Server(binaries.require_versitygw(), workdir / "s3")
            s3.start()
            s3.create_bucket(args.s3_bucket)
        plane.start()
        if not args.no_kueue:
            kueue = Kueue(plane)
            kueue.start()
            print(f"kueue: ready in {kueue.started_seconds:.1f} s", flush=True)
        agent = NodeAgent(
            plane.kubeconfig,
            workdir / "node-agent",
            nodes=[n for n in args.nodes.split(",") if n],
            apiserver_port=plane.apiserver_port,
            k8s_version=binaries.k8s_version,
        )
        agent.start()
        if s3 is not None:
            s3.pod_endpoint = agent.expose_host_port("s3", s3.port, 7070)
        if kueue is not None:
            # A LocalQueue in "default" so that a Job labelled with it is admitted right away.
            kueue.create_local_queue("default")
        _banner(plane, kueue, agent, s3, args.s3_bucket)
        while not stop.wait(1.0):
            plane.check_alive()
            if s3 is not None:
                s3.check_alive()
    except KeyboardInterrupt:
        pass
    except Exception as exc:
        failed = True
        print(f"error: {exc}\nlogs: {plane.logs_dir}", file=sys.stderr)
    finally:
        print("stopping ...", flush=True)
        t0 = time.monotonic()
        if agent is not None:
            agent.stop()
        if kueue is not None:
            kueue.stop()
        plane.stop()
        if s3 is not None:
            s3.stop()
        print(f"stopped in {time.monotonic() - t0:.1f} s", flush=True)
        if args.keep or failed or args.workdir:
            print(f"state and logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


def _banner(
    plane: ControlPlane, kueue: Kueue | None, agent: NodeAgent, s3: S3Server | None, bucket: str
) -> None:
    with plane.api_client() as client:
        version = kubernetes.client.VersionApi(client).get_code().git_version
    lines = [
        f"cluster up: Kubernetes {version} at {plane.server} "
        f"(control plane ready in {plane.started_seconds:.1f} s)",
        f"nodes (node agent): {', '.join(agent.nodes)}; pod logs under {agent.workdir / 'pods'}",
        (
            f"pod network: {agent.network.subnet} in netns {agent.network.cluster_ns}; pods reach "
            "the apiserver at 10.0.0.1:443; names from per-pod /etc/hosts"
            if agent.network is not None
            else f"pod network: loopback addresses only ({agent.network_unavailable})"
        ),
        f"storage: default StorageClass 'standard' (directories under {agent.workdir / 'volumes'})",
        f"component logs: {plane.logs_dir}",
        f"admin kubeconfig: {plane.kubeconfig}",
        f"restricted identity ({plane.restricted_user}, no RBAC grants): "
        f"{plane.restricted_kubeconfig_path}",
    ]
    if kueue is not None:
        lines.append(
            f"kueue: ClusterQueue {kueue.cluster_queue} (quota {kueue.quota}), LocalQueue "
            f"{kueue.local_queue} in namespace default, priorities {list(kueue.priorities)}"
        )
    if plane.binaries.kubectl is not None:
        lines.append(f"kubectl: {plane.binaries.kubectl}")
    if s3 is not None:
        pod = s3.client_env(pod=True)
        lines += [
            f"S3 server (versitygw, data under {s3.data_dir}): bucket {bucket!r}",
            f"  endpoint from this machine: {s3.endpoint}",
            f"  endpoint from pods:         {pod['AWS_ENDPOINT_URL']}",
            f"  access key: {s3.access_key}",
            f"  secret key: {s3.secret_key}",
            "  credentials for pods (a Secret to give them with envFrom):",
            "    kubectl create secret generic s3-credentials "
            + " ".join(f"--from-literal={k}={v}" for k, v in pod.items()),
        ]
    lines += [
        "",
        f"export KUBECONFIG={plane.kubeconfig}",
        "",
        "Ctrl-C (or SIGTERM) stops everything.",
    ]
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
