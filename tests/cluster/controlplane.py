"""A real, throw-away Kubernetes control plane on loopback: etcd, kube-apiserver (RBAC, client
certificates), kube-controller-manager and kube-scheduler, each a process whose log is a file."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import kubernetes

from .binaries import Binaries
from .kubeconfig import api_client_from, write_kubeconfig
from .pki import CertificateAuthority, write_signing_key
from .processes import ManagedProcess, free_port, http_ok, wait_until

__all__ = ["ControlPlane", "client_environment"]

# Generous: the machine has 2 cores shared with Go builds and other test sessions.
START_TIMEOUT = float(os.environ.get("PREEMPTIBLE_CLUSTER_START_TIMEOUT", "180"))

ADMIN_USER = "preemptible-admin"
RESTRICTED_USER = "preemptible-restricted"


def client_environment() -> dict[str, str]:
    """Environment for Go clients of this apiserver: etcd 3.5 cannot serve watch-list streaming,
    so clients would log a fallback on every list; turning it off keeps the logs readable."""
    env = dict(os.environ)
    env["KUBE_FEATURE_WatchListClient"] = "false"
    return env


class ControlPlane:
    """Start with ``start()``, always ``stop()``. All state lives in ``workdir``."""

    def __init__(
        self,
        binaries: Binaries,
        workdir: Path,
        *,
        say: Callable[[str], None] = print,
    ) -> None:
        self.binaries = binaries
        self.workdir = workdir
        self.logs_dir = workdir / "logs"
        self.pki_dir = workdir / "pki"
        self._say = say
        self._processes: list[ManagedProcess] = []
        self.etcd_port = 0
        self.apiserver_port = 0
        self.server = ""
        self.kubeconfig = workdir / "admin.kubeconfig"
        self.restricted_user = RESTRICTED_USER
        self.restricted_kubeconfig_path = workdir / f"{RESTRICTED_USER}.kubeconfig"
        self.started_seconds: float | None = None
        self.ca: CertificateAuthority | None = None

    # ------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        t0 = time.monotonic()
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self._say(f"control plane: workdir {self.workdir} (component logs in {self.logs_dir})")
        self._write_pki()
        self._start_etcd()
        self._start_apiserver()
        self._start_controller_manager()
        self._start_scheduler()
        self._wait_for_controllers()
        self.started_seconds = time.monotonic() - t0
        self._say(f"control plane: ready at {self.server} in {self.started_seconds:.1f} s")

    def stop(self) -> None:
        """Stop every process this object started, newest first, by PID."""
        for process in reversed(self._processes):
            with contextlib.suppress(Exception):
                process.stop()
        self._processes.clear()

    def restart_apiserver(self) -> float:
        """Stop kube-apiserver (SIGTERM, by PID) and start it again on the same port with the same
        flags; etcd keeps the state. Returns the seconds it was unreachable (chaos tests)."""
        t0 = time.monotonic()
        (index,) = [i for i, p in enumerate(self._processes) if p.name == "kube-apiserver"]
        old = self._processes[index]
        old.stop()
        new = ManagedProcess(
            old.name, old.argv, old.log, env=client_environment(), cwd=self.workdir
        )
        self._processes[index] = new
        admin = (self.pki_dir / "admin.crt", self.pki_dir / "admin.key")
        wait_until(
            "kube-apiserver /readyz after a restart",
            lambda: http_ok(f"{self.server}/readyz", ca=self.ca.cert_path, cert=admin),  # type: ignore[union-attr]
            timeout=START_TIMEOUT,
            check=new.check_alive,
        )
        return time.monotonic() - t0

    def processes(self) -> list[ManagedProcess]:
        return list(self._processes)

    def check_alive(self) -> None:
        for process in self._processes:
            process.check_alive()

    def add_process(self, process: ManagedProcess) -> None:
        """Register a process started elsewhere (Kueue) so that ``stop()`` ends it too."""
        self._processes.append(process)

    # -------------------------------------------------------------------------------- clients
    def api_client(self) -> kubernetes.client.ApiClient:
        return api_client_from(self.kubeconfig)

    def kubectl(
        self,
        *args: str,
        kubeconfig: Path | None = None,
        input: str | None = None,
        check: bool = True,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        if self.binaries.kubectl is None:
            raise FileNotFoundError(
                "kubectl is not in the cluster cache; run `make cluster-binaries` to install it"
            )
        return subprocess.run(
            [str(self.binaries.kubectl), "--kubeconfig", str(kubeconfig or self.kubeconfig), *args],
            input=input,
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
            env=client_environment(),
        )

    def client_kubeconfig(
        self, user: str, groups: tuple[str, ...] = (), *, name: str | None = None
    ) -> Path:
        """A kubeconfig for a client-certificate identity ``user`` in ``groups``; its permissions
        are whatever RBAC grants that user or group (nothing, until a test binds a role)."""
        assert self.ca is not None, "control plane not started"
        stem = name or user.replace(":", "_")
        pair = self.ca.issue(stem, user, organizations=groups, client=True, directory=self.pki_dir)
        return write_kubeconfig(
            self.workdir / f"{stem}.kubeconfig",
            server=self.server,
            ca=self.ca.cert_path,
            user=user,
            cert=pair.cert,
            key=pair.key,
        )

    def restricted_kubeconfig(
        self, user: str = RESTRICTED_USER, groups: tuple[str, ...] = ()
    ) -> Path:
        return self.client_kubeconfig(user, groups)

    def restricted_api_client(self, user: str = RESTRICTED_USER) -> kubernetes.client.ApiClient:
        return api_client_from(self.restricted_kubeconfig(user))

    def service_account_kubeconfig(
        self, namespace: str, name: str, *, expiration_seconds: int = 7200
    ) -> Path:
        """A kubeconfig holding a bound token of ServiceAccount ``namespace/name`` (TokenRequest),
        e.g. to run the operator with exactly the chart's RBAC."""
        assert self.ca is not None, "control plane not started"
        with self.api_client() as client:
            request = kubernetes.client.AuthenticationV1TokenRequest(
                spec=kubernetes.client.V1TokenRequestSpec(
                    audiences=[], expiration_seconds=expiration_seconds
                )
            )
            token = (
                kubernetes.client.CoreV1Api(client)
                .create_namespaced_service_account_token(name, namespace, request)
                .status.token
            )
        return write_kubeconfig(
            self.workdir / f"sa-{namespace}-{name}.kubeconfig",
            server=self.server,
            ca=self.ca.cert_path,
            user=f"system:serviceaccount:{namespace}:{name}",
            token=token,
            namespace=namespace,
        )

    # -------------------------------------------------------------------------------- startup
    def _write_pki(self) -> None:
        self.ca = CertificateAuthority(self.pki_dir)
        self.ca.issue(
            "apiserver",
            "kube-apiserver",
            server=True,
            # 10.0.0.1: the "kubernetes" Service IP, where pods reach the apiserver (ApiProxy).
            ips=("127.0.0.1", "10.0.0.1"),
            dns_names=(
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ),
        )
        self.ca.issue("admin", ADMIN_USER, organizations=("system:masters",), client=True)
        write_signing_key(self.pki_dir / "sa.key", self.pki_dir / "sa.pub")

    def _start(self, name: str, argv: list[str]) -> ManagedProcess:
        process = ManagedProcess(
            name, argv, self.logs_dir / f"{name}.log", env=client_environment(), cwd=self.workdir
        )
        self._processes.append(process)
        return process

    def _start_etcd(self) -> None:
        self.etcd_port, peer = free_port(), free_port()
        client_url, peer_url = f"http://127.0.0.1:{self.etcd_port}", f"http://127.0.0.1:{peer}"
        etcd = self._start(
            "etcd",
            [
                str(self.binaries.etcd),
                "--name=preemptible-test",
                f"--data-dir={self.workdir / 'etcd-data'}",
                f"--listen-client-urls={client_url}",
                f"--advertise-client-urls={client_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=preemptible-test={peer_url}",
                # Throw-away data: fsync latency on a busy disk would slow everything.
                "--unsafe-no-fsync=true",
                "--log-level=warn",
            ],
        )
        wait_until(
            "etcd /health",
            lambda: http_ok(f"{client_url}/health"),
            timeout=START_TIMEOUT,
            check=etcd.check_alive,
        )

    def _start_apiserver(self) -> None:
        assert self.ca is not None
        self.apiserver_port = free_port()
        self.server = f"https://127.0.0.1:{self.apiserver_port}"
        pki = self.pki_dir
        apiserver = self._start(
            "kube-apiserver",
            [
                str(self.binaries.kube_apiserver),
                f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.apiserver_port}",
                f"--cert-dir={pki}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={self.ca.cert_path}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--authorization-mode=Node,RBAC",
                "--service-cluster-ip-range=10.0.0.0/24",
                "--allow-privileged=true",
                # The kubernetes Service's endpoints would be 127.0.0.1, which Endpoints reject.
                "--endpoint-reconciler-type=none",
                # etcd 3.5.1 lacks RequestWatchProgress: no watch-list streaming.
                "--feature-gates=WatchList=false",
                "--profiling=false",
            ],
        )
        self.kubeconfig = write_kubeconfig(
            self.kubeconfig,
            server=self.server,
            ca=self.ca.cert_path,
            user=ADMIN_USER,
            cert=pki / "admin.crt",
            key=pki / "admin.key",
        )
        admin = (pki / "admin.crt", pki / "admin.key")
        wait_until(
            "kube-apiserver /readyz",
            lambda: http_ok(f"{self.server}/readyz", ca=self.ca.cert_path, cert=admin),  # type: ignore[union-attr]
            timeout=START_TIMEOUT,
            check=apiserver.check_alive,
        )
        self.restricted_kubeconfig_path = self.restricted_kubeconfig()

    def _start_controller_manager(self) -> None:
        assert self.ca is not None
        port = free_port()
        cm = self._start(
            "kube-controller-manager",
            [
                str(self.binaries.kube_controller_manager),
                f"--kubeconfig={self.kubeconfig}",
                "--leader-elect=false",
                f"--service-account-private-key-file={self.pki_dir / 'sa.key'}",
                f"--root-ca-file={self.ca.cert_path}",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                f"--cert-dir={self.workdir / 'kube-controller-manager-certs'}",
                # A node whose Lease is not renewed for this long becomes NotReady.
                "--node-monitor-grace-period=40s",
                # Notice a new Ready node (and drop its not-ready taint) quickly.
                "--node-monitor-period=2s",
                "--profiling=false",
            ],
        )
        self._cm_healthz = f"https://127.0.0.1:{port}/healthz"
        wait_until(
            "kube-controller-manager /healthz",
            lambda: http_ok(self._cm_healthz, insecure=True),
            timeout=START_TIMEOUT,
            check=cm.check_alive,
        )

    def _start_scheduler(self) -> None:
        port = free_port()
        scheduler = self._start(
            "kube-scheduler",
            [
                str(self.binaries.kube_scheduler),
                f"--kubeconfig={self.kubeconfig}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                f"--cert-dir={self.workdir / 'kube-scheduler-certs'}",
                "--profiling=false",
            ],
        )
        wait_until(
            "kube-scheduler /healthz",
            lambda: http_ok(f"https://127.0.0.1:{port}/healthz", insecure=True),
            timeout=START_TIMEOUT,
            check=scheduler.check_alive,
        )

    def _wait_for_controllers(self) -> None:
        # The ServiceAccount controller creating default/default shows the controllers run; pods
        # cannot be created in a namespace before its default ServiceAccount exists.
        with self.api_client() as client:
            core = kubernetes.client.CoreV1Api(client)
            wait_until(
                "ServiceAccount default/default (controller-manager working)",
                lambda: core.read_namespaced_service_account("default", "default") is not None,
                timeout=START_TIMEOUT,
                check=self.check_alive,
            )
