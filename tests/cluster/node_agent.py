"""A stand-in for kubelet, for the cluster test tier: it registers Node objects, renews their
Leases and runs every pod bound to them as local processes of this project's virtualenv (the
"image"), reporting status the way kubelet does.

Faithful to kubelet in these respects: pod phase and conditions (PodScheduled,
PodReadyToStartContainers, Initialized, ContainersReady, Ready), container states with exit code,
signal and restart count, termination message (file, 4 KiB; FallbackToLogsOnError), init containers,
restart policies, $(VAR) expansion, downward-API env and volumes (their labels and annotations
refreshed when the pod changes), and deletion: SIGTERM to the container's main process, wait
the deletion grace period (at least 2 s), SIGKILL everything left in the container, report the
terminal status, then delete the pod with gracePeriodSeconds=0.

Where network namespaces can be made (pod_network.py): each pod has its own network, mount and
UTS namespace, a 10.X.a.b address on a bridge in a namespace of the tier's own (reachable from the
host through an address-less veth and a route), /etc/hosts in place of cluster DNS, the apiserver
at 10.0.0.1:443, projected service-account tokens, and volumes bind-mounted at their mountPath;
PersistentVolumeClaims of the default StorageClass are provisioned as directories
(provisioner.py).

Deviations, because processes share the host's filesystem (see docs/cluster-tests.md):
- without network namespaces, each pod gets its own loopback address (127.X.Y.Z) as status.podIP;
  nothing isolates ports;
- the termination-message file is a host file passed as $PREEMPTIBLE_TERMINATION_LOG;
- env values, command, args and workingDir that start with a volume's mountPath are rewritten to
  the host directory of that volume (hostPath: the path itself; emptyDir: a per-pod directory;
  configMap/secret: a per-pod directory with the keys as files);
- no images, probes, lifecycle hooks, resource limits, service links or kube-proxy.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime as dt
import logging
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from trainer_runtime.protocol import ENV_TERMINATION_LOG

from .image import write_image_bin
from .kubeconfig import api_client_from
from .pod_network import (
    HOST_SERVICE_NET,
    KUBERNETES_SERVICE_IP,
    KUBERNETES_SERVICE_PORT,
    ApiProxy,
    ClusterNetwork,
    NetworkUnavailableError,
    TcpRelay,
    network_unavailable_reason,
)
from .pod_runtime import (
    MIN_GRACE_SECONDS,
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
from .provisioner import LocalDirProvisioner

__all__ = ["DEFAULT_CAPACITY", "ContainerRun", "NodeAgent", "PodRecord"]

DEFAULT_CAPACITY = {"cpu": "4", "memory": "8Gi", "pods": "32", "ephemeral-storage": "20Gi"}
LEASE_SECONDS = 40
HEARTBEAT_SECONDS = 10.0
IMAGE_ID = "preemptible-node-agent://venv"
_SMP = "application/strategic-merge-patch+json"
_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_TERMINAL = ("Succeeded", "Failed")
HOSTS_REFRESH_SECONDS = 1.0

# Runs as the container's first program inside its pod's namespaces, then execs the container.
# Arguments: hosts file, resolv.conf, hostname, (source, target, ro|rw)*, "--", argv...
_WRAPPER = r"""
set -e
mount --bind "$1" /etc/hosts
if [ -e /etc/resolv.conf ]; then mount --bind "$2" /etc/resolv.conf; fi
hostname "$3"
shift 3
while [ "$1" != "--" ]; do
  mount --bind "$1" "$2"
  if [ "$3" = ro ]; then mount -o remount,bind,ro "$2"; fi
  shift 3
done
shift
exec "$@"
"""


# Set in every container's environment (unique per run): when the container's main process ends,
# the agent SIGKILLs every process still carrying it, as the kernel does to a PID namespace whose
# init ends. Killing the process group alone misses processes that started their own session
# (torchrun's workers, and torchrun itself under `trainer-runtime launch`).
CONTAINER_MARKER = "NODE_AGENT_CONTAINER"


def _kill_marked(marker: str) -> list[int]:
    """SIGKILL every process whose environment holds ``CONTAINER_MARKER=marker``; their pids."""
    needle = f"{CONTAINER_MARKER}={marker}".encode()
    killed = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as fh:
                environ = fh.read().split(b"\0")
        except OSError:
            continue
        if needle in environ:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
    return killed


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _ts(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class ContainerRun:
    """One process run of one container (restarts make several)."""

    container: str
    init: bool
    pid: int
    log: Path
    message_file: Path
    started_at: dt.datetime
    sigterm_at: float | None = None  # time.monotonic() when the agent sent SIGTERM
    exited_at: float | None = None  # time.monotonic() when the agent saw the exit
    finished_at: dt.datetime | None = None
    exit: ContainerExit | None = None
    message: str = ""
    killed: bool = False  # the agent had to SIGKILL it after the grace period
    marker: str = ""  # CONTAINER_MARKER's value in its environment

    @property
    def seconds_after_sigterm(self) -> float | None:
        if self.sigterm_at is None or self.exited_at is None:
            return None
        return self.exited_at - self.sigterm_at


@dataclass
class PodRecord:
    """What the agent did with one pod; outlives the pod object for assertions in tests."""

    namespace: str
    name: str
    uid: str
    node: str
    ip: str
    directory: Path
    netns: str | None = None  # the pod's network namespace (None: loopback mode)
    runs: list[ContainerRun] = field(default_factory=list)
    phase: str = "Pending"
    grace_seconds: float | None = None  # deletion grace the agent honoured, if deleted
    deleted: bool = False
    done: threading.Event = field(default_factory=threading.Event)

    def last_run(self, container: str | None = None) -> ContainerRun | None:
        runs = [r for r in self.runs if container is None or r.container == container]
        return runs[-1] if runs else None


class _Container:
    def __init__(self, spec: Mapping[str, Any], *, init: bool) -> None:
        self.spec = spec
        self.name: str = spec["name"]
        self.init = init
        self.popen: subprocess.Popen[bytes] | None = None
        self.run: ContainerRun | None = None
        self.restart_count = 0
        self.last_terminated: dict[str, Any] | None = None
        self.restart_at: float | None = None
        self.backoff = 1.0
        self.waiting: tuple[str, str] = ("ContainerCreating", "")
        # Readable once the process exits: the pod's thread sleeps on it instead of polling.
        self.pidfd: int | None = None

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.returncode is None

    def terminated_state(self) -> dict[str, Any] | None:
        run = self.run
        if run is None or run.exit is None:
            return None
        state: dict[str, Any] = {
            "exitCode": run.exit.exit_code,
            "reason": run.exit.reason,
            "startedAt": _ts(run.started_at),
            "finishedAt": _ts(run.finished_at or _now()),
            "containerID": f"preemptible-node-agent://{run.pid}",
        }
        if run.exit.signal is not None:
            state["signal"] = run.exit.signal
        if run.message:
            state["message"] = run.message
        return state


class _PodWorker(threading.Thread):
    """Runs one pod from start to removal."""

    def __init__(
        self, agent: NodeAgent, pod: dict[str, Any], ip: str, netns: str | None = None
    ) -> None:
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.agent = agent
        self.pod = pod
        self.pod.setdefault("status", {})
        self.pod["status"].update(
            {"podIP": ip, "podIPs": [{"ip": ip}], "hostIP": "127.0.0.1",
             "hostIPs": [{"ip": "127.0.0.1"}]}
        )  # fmt: skip
        self.spec: dict[str, Any] = pod["spec"]
        self.restart_policy: str = self.spec.get("restartPolicy", "Always")
        directory = agent.workdir / "pods" / f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"
        self.record = PodRecord(
            namespace=meta["namespace"],
            name=meta["name"],
            uid=meta["uid"],
            node=self.spec["nodeName"],
            ip=ip,
            directory=directory,
            netns=netns,
        )
        self.hostname: str = (self.spec.get("hostname") or meta["name"])[:63]
        self.subdomain: str = self.spec.get("subdomain") or ""
        self.hosts_path = directory / "etc" / "hosts"
        self.inits = [_Container(c, init=True) for c in self.spec.get("initContainers") or []]
        self.mains = [_Container(c, init=False) for c in self.spec["containers"]]
        self.initialized = not self.inits
        self.started_at = _now()
        self.finished = False  # set under agent lock when the worker is about to exit
        self._term = threading.Event()
        # Written to by request_termination(): wakes the thread sleeping in _sleep().
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)  # one byte is enough: a full pipe is awake
        self._wake_lock = threading.Lock()  # the pipe is closed when the thread ends
        self._term_grace: float | None = None
        self._gone = False
        self._transitions: dict[str, tuple[str, str]] = {}
        self._volumes: dict[str, str] = {}
        self._read_only: set[str] = set()
        self._config_error: str | None = None

    # ----------------------------------------------------------------------- control from agent
    def request_termination(self, grace: float | None, *, gone: bool = False) -> None:
        if grace is None:
            grace = float(self.spec.get("terminationGracePeriodSeconds", 30))
        # A second delete may shorten the grace period, never lengthen it.
        if self._term_grace is None or grace < self._term_grace:
            self._term_grace = grace
        self._gone = self._gone or gone
        self._term.set()
        with self._wake_lock:
            if self._wake_w >= 0:
                with contextlib.suppress(BlockingIOError):
                    os.write(self._wake_w, b"x")

    def _sleep(self, containers: Iterable[_Container], timeout: float) -> bool:
        """Sleep until a container's process exits, termination is requested, or ``timeout``
        (seconds) passes; True if termination was requested. Event-driven (pidfds and a pipe):
        with hundreds of pods, polling every container ten times a second costs the agent a
        core on a 2-core machine and slows every component measured beside it."""
        if self._term.is_set():
            return True
        fds = [c.pidfd for c in containers if c.pidfd is not None and c.running]
        poller = select.poll()
        for fd in (self._wake_r, *fds):
            poller.register(fd, select.POLLIN)
        poller.poll(max(0.0, timeout) * 1000)
        return self._term.is_set()

    @staticmethod
    def _open_pidfd(pid: int) -> int | None:
        """A file descriptor readable once ``pid`` exits; None without pidfds (an old kernel:
        the thread then polls)."""
        try:
            return os.pidfd_open(pid)
        except (AttributeError, OSError):
            return None

    def _next_wake(self, containers: Iterable[_Container]) -> float:
        """Seconds until the next restart is due (five safety-net seconds at most; a tenth of a
        second without pidfds, which must then be polled)."""
        cs = list(containers)
        cap = 5.0 if all(c.pidfd is not None for c in cs if c.running) else 0.1
        due = [c.restart_at - time.monotonic() for c in cs if c.restart_at is not None]
        return min([cap, *due])

    # --------------------------------------------------------------------------------- thread
    def run(self) -> None:
        log = self.agent.log
        try:
            self._setup_volumes()
            if self.record.netns is not None:
                self._setup_etc()
            self._report()
            if self._run_inits():
                self._run_mains()
        except Exception:
            log.exception("pod %s/%s: agent error", self.record.namespace, self.record.name)
        finally:
            for c in self.inits + self.mains:
                self._kill_group(c)
                if c.pidfd is not None:
                    os.close(c.pidfd)
                    c.pidfd = None
            with self._wake_lock:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_w = -1
        phase = self.record.phase
        with contextlib.suppress(Exception):
            self._report()
        log.info("pod %s/%s: %s", self.record.namespace, self.record.name, phase)
        with self.agent.lock:
            self.finished = True
            delete = self._term.is_set() and not self._gone
        if self.agent.network is not None:
            with contextlib.suppress(Exception):
                self.agent.network.detach(self.record.uid)
        self.record.done.set()
        if delete:
            self.agent.delete_now(self.pod)

    def _setup_volumes(self) -> None:
        pod_dir = self.record.directory
        (pod_dir / "volumes").mkdir(parents=True, exist_ok=True)
        (pod_dir / "home").mkdir(exist_ok=True)
        core = kubernetes.client.CoreV1Api(self.agent.client)
        namespace = self.record.namespace
        for volume in self.spec.get("volumes") or []:
            name = volume["name"]
            local = pod_dir / "volumes" / name
            if "hostPath" in volume:
                path = Path(volume["hostPath"]["path"])
                kind = volume["hostPath"].get("type") or ""
                if kind in ("", "DirectoryOrCreate"):
                    path.mkdir(parents=True, exist_ok=True)
                elif kind == "Directory" and not path.is_dir():
                    self._config_error = f"hostPath type check failed: {path} is not a directory"
                self._volumes[name] = str(path)
                continue
            if "persistentVolumeClaim" in volume:
                ref = volume["persistentVolumeClaim"]
                try:
                    self._volumes[name] = self._claim_directory(core, namespace, ref["claimName"])
                except (ApiException, ContainerConfigError) as exc:
                    self._config_error = f"volume {name!r}: {getattr(exc, 'reason', exc)}"
                if ref.get("readOnly"):
                    self._read_only.add(name)
                continue
            local.mkdir(exist_ok=True)
            self._volumes[name] = str(local)
            try:
                if "projected" in volume:
                    self._write_projected(core, local, volume["projected"])
                elif "downwardAPI" in volume:
                    self._write_downward(local, volume["downwardAPI"].get("items") or [])
                elif "configMap" in volume:
                    ref = volume["configMap"]
                    cm = core.read_namespaced_config_map(ref["name"], namespace)
                    self._write_items(local, cm.data or {}, ref.get("items"))
                elif "secret" in volume:
                    ref = volume["secret"]
                    secret = core.read_namespaced_secret(ref["secretName"], namespace)
                    data = {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}
                    self._write_items(local, data, ref.get("items"))
            except ApiException as exc:
                if not (volume.get("configMap") or volume.get("secret") or {}).get("optional"):
                    self._config_error = f"volume {name!r}: {exc.reason}"
            # emptyDir and everything else: an empty directory.

    def _claim_directory(self, core: Any, namespace: str, claim: str) -> str:
        """The host directory of the PersistentVolume bound to ``claim``."""
        pvc = core.read_namespaced_persistent_volume_claim(claim, namespace)
        if not pvc.spec.volume_name or pvc.status.phase != "Bound":
            raise ContainerConfigError(f"PersistentVolumeClaim {claim!r} is not bound")
        pv = core.read_persistent_volume(pvc.spec.volume_name)
        source = pv.spec.host_path or pv.spec.local
        if source is None:
            raise ContainerConfigError(
                f"PersistentVolume {pv.metadata.name!r} is neither hostPath nor local; the test "
                "node agent can only mount directories"
            )
        Path(source.path).mkdir(parents=True, exist_ok=True)
        return str(source.path)

    def _write_projected(self, core: Any, directory: Path, projected: Mapping[str, Any]) -> None:
        """kubelet's projected volume: service-account token, configMap, secret, downwardAPI."""
        namespace = self.record.namespace
        for source in projected.get("sources") or []:
            if "serviceAccountToken" in source:
                sat = source["serviceAccountToken"]
                token = self._service_account_token(
                    core, sat.get("audience"), int(sat.get("expirationSeconds") or 3600)
                )
                target = directory / sat["path"]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(token)
            elif "configMap" in source:
                ref = source["configMap"]
                try:
                    data = core.read_namespaced_config_map(ref["name"], namespace).data or {}
                except ApiException:
                    if ref.get("optional"):
                        continue
                    raise
                self._write_items(directory, data, ref.get("items"))
            elif "secret" in source:
                ref = source["secret"]
                try:
                    raw = core.read_namespaced_secret(ref["name"], namespace).data or {}
                except ApiException:
                    if ref.get("optional"):
                        continue
                    raise
                data = {k: base64.b64decode(v).decode() for k, v in raw.items()}
                self._write_items(directory, data, ref.get("items"))
            elif "downwardAPI" in source:
                self._write_downward(directory, source["downwardAPI"].get("items") or [])

    def _write_downward(self, directory: Path, items: Iterable[Mapping[str, Any]]) -> None:
        for item in items:
            if "fieldRef" not in item:
                raise ContainerConfigError(
                    f"downwardAPI item {item.get('path')!r}: only fieldRef is supported"
                )
            target = directory / item["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            # Whole or not at all, as kubelet's atomic writer: a reader never sees half a value.
            partial = target.with_name(f".{target.name}.partial")
            partial.write_text(field_value(self.pod, item["fieldRef"]["fieldPath"]))
            os.replace(partial, target)

    def refresh_downward(self, pod: Mapping[str, Any]) -> None:
        """kubelet's sync of downward-API volumes: labels and annotations the pod gained after
        it started show in their files (kubelet: within its sync period; here at the event)."""
        meta = pod.get("metadata") or {}
        self.pod["metadata"]["labels"] = dict(meta.get("labels") or {})
        self.pod["metadata"]["annotations"] = dict(meta.get("annotations") or {})
        for volume in self.spec.get("volumes") or []:
            local = self._volumes.get(volume["name"])
            items = (volume.get("downwardAPI") or {}).get("items")
            if local and items:
                with contextlib.suppress(ContainerConfigError, OSError):
                    self._write_downward(Path(local), items)

    def _service_account_token(self, core: Any, audience: str | None, seconds: int) -> str:
        """A token bound to this pod (TokenRequest), as kubelet projects it."""
        meta = self.pod["metadata"]
        request = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "audiences": [audience] if audience else [],
                "expirationSeconds": max(seconds, 600),
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": meta["name"],
                    "uid": meta["uid"],
                },
            },
        }
        account = self.spec.get("serviceAccountName") or "default"
        result = core.create_namespaced_service_account_token(
            account, self.record.namespace, request
        )
        return str(result.status.token)

    def _setup_etc(self) -> None:
        """The pod's /etc/hosts (names in place of cluster DNS) and /etc/resolv.conf (no server:
        unknown names fail at once instead of waiting for a DNS timeout)."""
        etc = self.hosts_path.parent
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "resolv.conf").write_text(
            f"# test node agent: names come from /etc/hosts\nnameserver 127.0.0.1\n"
            f"search {self.record.namespace}.svc.cluster.local svc.cluster.local cluster.local\n"
            "options ndots:5 timeout:1 attempts:1\n"
        )
        self.hosts_path.write_text("")
        self.agent.refresh_hosts()

    def hosts_entry(self) -> HostsPod:
        return HostsPod(self.record.namespace, self.hostname, self.subdomain, self.record.ip)

    @staticmethod
    def _write_items(
        directory: Path, data: Mapping[str, str], items: Iterable[Mapping[str, str]] | None
    ) -> None:
        mapping = {i["key"]: i["path"] for i in items} if items else {k: k for k in data}
        for key, rel in mapping.items():
            if key in data:
                target = directory / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(data[key])

    def _mounts(self, spec: Mapping[str, Any]) -> MountMap:
        pairs = []
        for mount in spec.get("volumeMounts") or []:
            host = self._volumes.get(mount["name"])
            if host is None:
                continue
            if mount.get("subPath"):
                host = os.path.join(host, mount["subPath"])
                if not Path(host).exists():
                    Path(host).mkdir(parents=True, exist_ok=True)
            pairs.append((mount["mountPath"], host))
        return MountMap.of(pairs)

    def _bind_mounts(self, spec: Mapping[str, Any]) -> list[str]:
        """(source, target, ro|rw) triples for the wrapper: each volume at its mountPath, in the
        pod's own mount namespace. Skipped: identity mounts, and mountPaths that would hide the
        agent's or the image's files (``protected_paths``; e.g. an emptyDir at /tmp when the
        agent works under /tmp): those rely on path rewriting alone."""
        triples: list[str] = []
        protected = self.agent.protected_paths()
        for mount in sorted(spec.get("volumeMounts") or [], key=lambda m: m["mountPath"]):
            host = self._volumes.get(mount["name"])
            if host is None:
                continue
            if mount.get("subPath"):
                host = os.path.join(host, mount["subPath"])
            target = Path(mount["mountPath"])
            if not target.is_absolute() or str(target) in ("/", "/proc", "/sys", "/dev"):
                continue
            if target == Path(host) or any(target == p or target in p.parents for p in protected):
                continue
            if not target.exists():
                # A mount point must exist; on the machine it is an empty directory (or file).
                if Path(host).is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.touch()
            ro = mount.get("readOnly") or mount["name"] in self._read_only
            triples += [host, str(target), "ro" if ro else "rw"]
        return triples

    def _wrap(self, argv: list[str], spec: Mapping[str, Any]) -> list[str]:
        """Run ``argv`` in the pod's network namespace and in its own mount and UTS namespaces
        (hostname, /etc/hosts, /etc/resolv.conf, volumes at their mountPaths). nsenter and
        unshare exec (no fork), so the container's process keeps the PID the agent started."""
        assert self.record.netns is not None
        etc = self.hosts_path.parent
        return [
            "nsenter",
            f"--net={ClusterNetwork.netns_path(self.record.netns)}",
            "--",
            "unshare",
            "--mount",
            "--uts",
            "--propagation",
            "private",
            "--",
            "/bin/sh",
            "-c",
            _WRAPPER,
            "pod-setup",
            str(self.hosts_path),
            str(etc / "resolv.conf"),
            self.hostname,
            *self._bind_mounts(spec),
            "--",
            *argv,
        ]

    def _environment(self, spec: Mapping[str, Any], mounts: MountMap, message_file: Path) -> dict:
        core = kubernetes.client.CoreV1Api(self.agent.client)
        namespace = self.record.namespace
        env: dict[str, str] = {
            # What the "image" provides: this project's virtualenv first on PATH, then the
            # console scripts of its dependencies (see image.py).
            "PATH": f"{self.agent.image_bin}:{self.agent.image_scripts}:{_SYSTEM_PATH}",
            "HOME": str(self.record.directory / "home"),
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            "HOSTNAME": self.spec.get("hostname") or self.record.name,
        }
        if self.record.netns is not None and self.agent.api_proxy is not None:
            # The "kubernetes" Service, as kubelet's service env gives it (see ApiProxy).
            env["KUBERNETES_SERVICE_HOST"] = KUBERNETES_SERVICE_IP
            env["KUBERNETES_SERVICE_PORT"] = str(KUBERNETES_SERVICE_PORT)
            env["KUBERNETES_SERVICE_PORT_HTTPS"] = str(KUBERNETES_SERVICE_PORT)
        elif self.agent.apiserver_port:
            env["KUBERNETES_SERVICE_HOST"] = "127.0.0.1"
            env["KUBERNETES_SERVICE_PORT"] = str(self.agent.apiserver_port)
        for source in spec.get("envFrom") or []:
            prefix = source.get("prefix", "")
            try:
                if "configMapRef" in source:
                    ref = source["configMapRef"]
                    data = core.read_namespaced_config_map(ref["name"], namespace).data or {}
                elif "secretRef" in source:
                    ref = source["secretRef"]
                    raw = core.read_namespaced_secret(ref["name"], namespace).data or {}
                    data = {k: base64.b64decode(v).decode() for k, v in raw.items()}
                else:
                    continue
            except ApiException as exc:
                if ref.get("optional"):
                    continue
                raise ContainerConfigError(f"envFrom {ref.get('name')!r}: {exc.reason}") from exc
            env.update({prefix + k: v for k, v in data.items()})
        for var in spec.get("env") or []:
            name = var["name"]
            if "valueFrom" not in var:
                env[name] = mounts.rewrite(expand(var.get("value", ""), env))
                continue
            source = var["valueFrom"]
            if "fieldRef" in source:
                env[name] = field_value(self.pod, source["fieldRef"]["fieldPath"])
            elif "configMapKeyRef" in source or "secretKeyRef" in source:
                secret = "secretKeyRef" in source
                ref = source["secretKeyRef" if secret else "configMapKeyRef"]
                try:
                    if secret:
                        raw = core.read_namespaced_secret(ref["name"], namespace).data or {}
                        data = {k: base64.b64decode(v).decode() for k, v in raw.items()}
                    else:
                        data = core.read_namespaced_config_map(ref["name"], namespace).data or {}
                except ApiException as exc:
                    if ref.get("optional"):
                        continue
                    raise ContainerConfigError(
                        f"env {name}: {ref['name']!r}: {exc.reason}"
                    ) from exc
                if ref["key"] not in data:
                    if ref.get("optional"):
                        continue
                    raise ContainerConfigError(
                        f"env {name}: key {ref['key']!r} not in {ref['name']!r}"
                    )
                env[name] = data[ref["key"]]
            else:
                raise ContainerConfigError(
                    f"env {name}: valueFrom {sorted(source)} is not supported by the test node "
                    "agent"
                )
        # The container's terminationMessagePath, as a host file (the agent's, always).
        env[ENV_TERMINATION_LOG] = str(message_file)
        return env

    def _start(self, c: _Container) -> None:
        if self._config_error:
            raise ContainerConfigError(self._config_error)
        spec = c.spec
        mounts = self._mounts(spec)
        stem = f"{c.name}.{c.restart_count}"
        log = self.record.directory / f"{stem}.log"
        message_file = self.record.directory / f"{stem}.termination-log"
        env = self._environment(spec, mounts, message_file)
        marker = f"{self.record.uid}/{stem}/{uuid.uuid4().hex[:8]}"
        env[CONTAINER_MARKER] = marker
        command = [mounts.rewrite(expand(a, env)) for a in spec.get("command") or []]
        args = [mounts.rewrite(expand(a, env)) for a in spec.get("args") or []]
        # No image entrypoint exists: without a command, args are the command (image CMD form).
        argv = command + args
        if not argv:
            raise ContainerConfigError(f"container {c.name!r} has neither command nor args")
        executable = shutil.which(argv[0], path=env["PATH"]) if "/" not in argv[0] else argv[0]
        if executable is None:
            raise ContainerConfigError(
                f"container {c.name!r}: executable {argv[0]!r} not found in the image "
                f"(PATH={env['PATH']})"
            )
        argv[0] = executable
        if spec.get("workingDir"):
            workdir = Path(mounts.rewrite(spec["workingDir"]))
            if not workdir.is_absolute() or not workdir.exists():
                workdir = self.record.directory / "rootfs" / spec["workingDir"].lstrip("/")
        else:
            workdir = self.record.directory / "rootfs"
        workdir.mkdir(parents=True, exist_ok=True)
        shown = " ".join(argv)
        if self.record.netns is not None:
            argv = self._wrap(argv, spec)
            shown += f" (netns {self.record.netns})"
        with log.open("ab") as out:
            popen = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=workdir,
                # One process group per container: the "container" is killed as a whole.
                start_new_session=True,
            )
        c.popen = popen
        if c.pidfd is not None:
            os.close(c.pidfd)
        c.pidfd = self._open_pidfd(popen.pid)
        c.run = ContainerRun(
            container=c.name,
            init=c.init,
            pid=popen.pid,
            log=log,
            message_file=message_file,
            started_at=_now(),
            marker=marker,
        )
        c.restart_at = None
        self.record.runs.append(c.run)
        self.agent.log.info(
            "pod %s/%s: started %s pid %d: %s", self.record.namespace, self.record.name,
            c.name, popen.pid, shown,
        )  # fmt: skip

    def _reap(self, c: _Container) -> bool:
        """Record the exit of ``c`` if its process ended; True if it did just now."""
        if c.popen is None or c.run is None or c.run.exit is not None:
            return False
        code = c.popen.poll()
        if code is None:
            return False
        run = c.run
        run.exited_at = time.monotonic()
        run.finished_at = _now()
        run.exit = container_exit(code)
        run.message = termination_message(
            run.message_file,
            run.log,
            policy=c.spec.get("terminationMessagePolicy"),
            exit_code=run.exit.exit_code,
        )
        self._kill_group(c)  # the container's other processes end with it
        self.agent.log.info(
            "pod %s/%s: %s exited %d (signal %s)", self.record.namespace, self.record.name,
            c.name, run.exit.exit_code, run.exit.signal,
        )  # fmt: skip
        return True

    @staticmethod
    def _kill_group(c: _Container) -> None:
        if c.popen is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(c.popen.pid, signal.SIGKILL)
        if c.run is not None and c.run.marker:
            _kill_marked(c.run.marker)
        with contextlib.suppress(Exception):
            c.popen.wait(5)

    def _wants_restart(self, c: _Container) -> bool:
        assert c.run is not None and c.run.exit is not None
        failed = c.run.exit.exit_code != 0
        if c.init:
            return failed and self.restart_policy != "Never"
        return self.restart_policy == "Always" or (self.restart_policy == "OnFailure" and failed)

    def _after_exit(self, c: _Container) -> None:
        if self._wants_restart(c):
            c.last_terminated = c.terminated_state()
            c.restart_at = time.monotonic() + c.backoff
            c.backoff = min(c.backoff * 2, 10.0)
            c.waiting = ("CrashLoopBackOff", f"back-off {c.backoff:.0f}s restarting {c.name}")

    def _maybe_restart(self, c: _Container) -> bool:
        if c.restart_at is not None and time.monotonic() >= c.restart_at:
            c.restart_count += 1
            self._start(c)
            return True
        return False

    def _run_inits(self) -> bool:
        try:
            for c in self.inits:
                if self._term.is_set():
                    self._terminate()
                    return False
                self._start(c)
                self._report()
                while True:
                    if self._sleep([c], self._next_wake([c])):
                        self._terminate()
                        return False
                    if self._reap(c):
                        self._after_exit(c)
                        self._report()
                        if c.run and c.run.exit and c.run.exit.exit_code == 0:
                            break
                        if c.restart_at is None:  # restartPolicy Never: the pod failed
                            self.record.phase = "Failed"
                            return False
                    if self._maybe_restart(c):
                        self._report()
            self.initialized = True
            return True
        except ContainerConfigError as exc:
            self._config_failure(exc)
            return False

    def _run_mains(self) -> None:
        if self._term.is_set():  # deleted before its containers started: start none
            self._terminate()
            return
        try:
            for c in self.mains:
                self._start(c)
        except ContainerConfigError as exc:
            self._config_failure(exc)
            return
        self.record.phase = "Running"
        self._report()
        while True:
            if self._sleep(self.mains, self._next_wake(self.mains)):
                self._terminate()
                return
            changed = False
            for c in self.mains:
                if self._reap(c):
                    self._after_exit(c)
                    changed = True
                try:
                    changed = self._maybe_restart(c) or changed
                except ContainerConfigError as exc:
                    self._config_failure(exc)
                    return
            if changed:
                self._update_phase()
                self._report()
            if all(not c.running and c.restart_at is None for c in self.mains):
                self._update_phase()
                return

    def _config_failure(self, exc: ContainerConfigError) -> None:
        """kubelet keeps such a pod Pending with a waiting reason until it is deleted."""
        self.agent.log.error("pod %s/%s: %s", self.record.namespace, self.record.name, exc)
        for c in self.inits + self.mains:
            if not c.running and (c.run is None or c.run.exit is None):
                c.waiting = ("CreateContainerConfigError", str(exc))
        self._report()
        while not self._term.wait(0.5):
            if self.agent.stopping.is_set():
                return
        self._terminate()

    def _terminate(self) -> None:
        """Graceful stop: SIGTERM, wait the grace period, SIGKILL what is left."""
        grace = max(float(self._term_grace or 0), MIN_GRACE_SECONDS)
        self.record.grace_seconds = grace
        self.record.deleted = True
        running = [c for c in self.inits + self.mains if c.running]
        for c in self.inits + self.mains:
            c.restart_at = None
        for c in running:
            assert c.popen is not None and c.run is not None
            c.run.sigterm_at = time.monotonic()
            with contextlib.suppress(ProcessLookupError):
                os.kill(c.popen.pid, signal.SIGTERM)  # the main process only, as a runtime does
        self.agent.log.info(
            "pod %s/%s: SIGTERM to %s, grace %.0f s", self.record.namespace, self.record.name,
            [c.name for c in running], grace,
        )  # fmt: skip
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(c.popen.poll() is None for c in running):  # type: ignore[union-attr]
            time.sleep(0.05)
        for c in running:
            if c.popen is not None and c.popen.poll() is None:
                assert c.run is not None
                c.run.killed = True
                self.agent.log.info(
                    "pod %s/%s: grace period over, SIGKILL %s",
                    self.record.namespace, self.record.name, c.name,
                )  # fmt: skip
                self._kill_group(c)
            self._reap(c)
        self._update_phase(terminating=True)

    def _update_phase(self, *, terminating: bool = False) -> None:
        exits: list[int | None] = []
        for c in self.mains:
            if c.running or c.restart_at is not None:
                exits.append(None)
            elif c.run is not None and c.run.exit is not None:
                exits.append(c.run.exit.exit_code)
            elif terminating:
                exits.append(137)  # never started: counts as not succeeded
            else:
                exits.append(None)
        self.record.phase = pod_phase(self.restart_policy, exits, terminating=terminating)

    # -------------------------------------------------------------------------------- status
    def _condition(self, kind: str, status: str, reason: str = "") -> dict[str, Any]:
        previous = self._transitions.get(kind)
        if previous is None or previous[0] != status:
            self._transitions[kind] = (status, _ts(_now()))
        condition = {
            "type": kind,
            "status": status,
            "lastTransitionTime": self._transitions[kind][1],
            "lastProbeTime": None,
        }
        if reason:
            condition["reason"] = reason
        return condition

    def _container_status(self, c: _Container) -> dict[str, Any]:
        status: dict[str, Any] = {
            "name": c.name,
            "image": c.spec.get("image", ""),
            "imageID": IMAGE_ID,
            "ready": c.running and not c.init,
            "started": c.running,
            "restartCount": c.restart_count,
        }
        if c.running and c.run is not None:
            status["state"] = {"running": {"startedAt": _ts(c.run.started_at)}}
            status["containerID"] = f"preemptible-node-agent://{c.run.pid}"
        elif c.restart_at is None and (terminated := c.terminated_state()) is not None:
            status["state"] = {"terminated": terminated}
            status["containerID"] = terminated["containerID"]
        else:
            reason, message = c.waiting
            if not c.init and not self.initialized and reason == "ContainerCreating":
                reason = "PodInitializing"
            status["state"] = {
                "waiting": {"reason": reason, **({"message": message} if message else {})}
            }
        if c.last_terminated is not None:
            status["lastState"] = {"terminated": c.last_terminated}
        return status

    def _report(self) -> None:
        terminal = self.record.phase in _TERMINAL
        all_ready = all(c.running for c in self.mains)
        ready_reason = "PodCompleted" if terminal else ("" if all_ready else "ContainersNotReady")
        ready = "True" if all_ready and not terminal else "False"
        status: dict[str, Any] = {
            "phase": self.record.phase,
            "hostIP": "127.0.0.1",
            "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": self.record.ip,
            "podIPs": [{"ip": self.record.ip}],
            "startTime": _ts(self.started_at),
            "conditions": [
                self._condition("PodReadyToStartContainers", "True"),
                self._condition(
                    "Initialized",
                    "True" if self.initialized else "False",
                    "" if self.initialized else "ContainersNotInitialized",
                ),
                self._condition("ContainersReady", ready, ready_reason),
                self._condition("Ready", ready, ready_reason),
                self._condition("PodScheduled", "True"),
            ],
            "containerStatuses": [self._container_status(c) for c in self.mains],
        }
        if self.inits:
            status["initContainerStatuses"] = [self._container_status(c) for c in self.inits]
        self.agent.patch_status(self.pod, status)


class NodeAgent:
    """Registers ``nodes`` and runs the pods bound to them. ``start()``, then always ``stop()``."""

    def __init__(
        self,
        kubeconfig: Path,
        workdir: Path,
        *,
        nodes: Iterable[str] = ("node-1",),
        capacity: Mapping[str, str] | None = None,
        image_bin: Path | None = None,
        apiserver_port: int = 0,
        k8s_version: str = "v0.0.0",
        ip_second_octet: int | None = None,
        network: str = "auto",
        provision_volumes: bool = True,
    ) -> None:
        """``network``: "netns" (a network, mount and UTS namespace per pod; fails where they
        cannot be made), "loopback" (processes share the host's namespaces; pod IPs 127.X.Y.Z),
        or "auto" (netns where possible, else loopback with ``network_unavailable`` saying why).
        ``provision_volumes``: run the directory-backed provisioner of the default
        StorageClass."""
        if network not in ("auto", "netns", "loopback"):
            raise ValueError(f"network={network!r}: use 'auto', 'netns' or 'loopback'")
        self.kubeconfig = kubeconfig
        self.workdir = workdir
        self.nodes = list(nodes)
        self.capacity = dict(capacity or DEFAULT_CAPACITY)
        self.image_bin = image_bin or Path(sys.executable).parent
        # The console scripts of the dependencies, run by the image's python (start() writes
        # them): the development venv keeps them in another layer (image.py).
        self.image_scripts = workdir / "image" / "bin"
        self.apiserver_port = apiserver_port
        self.k8s_version = k8s_version
        # Pod IPs 127.<octet>.Y.Z: a random second octet keeps two test sessions on one machine
        # (each with its own cluster) from handing out the same addresses.
        self._octet = ip_second_octet if ip_second_octet is not None else random.randint(1, 254)
        self._next_ip = 2
        self.lock = threading.RLock()
        self.stopping = threading.Event()
        self._workers: dict[str, _PodWorker] = {}
        self._records: list[PodRecord] = []
        self._finalized: set[str] = set()
        self._threads: list[threading.Thread] = []
        self.client: kubernetes.client.ApiClient | None = None
        self.network_mode = network
        self.network: ClusterNetwork | None = None
        self.network_unavailable: str | None = None
        self.api_proxy: ApiProxy | None = None
        self.relays: list[TcpRelay] = []
        self.provision_volumes = provision_volumes
        self.provisioner: LocalDirProvisioner | None = None
        self._silenced: set[str] = set()  # nodes whose heartbeat is stopped (node loss)
        self._relist: set[str] = set()  # nodes whose pods must be listed again
        self._hosts_lock = threading.Lock()
        self.log_file = workdir / "node-agent.log"
        self.log = logging.getLogger(f"tests.cluster.node_agent.{id(self):x}")
        self._handler: logging.Handler | None = None

    # ------------------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 120.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._handler = logging.FileHandler(self.log_file)
        self._handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(threadName)s %(message)s")
        )
        self.log.addHandler(self._handler)
        self.log.setLevel(logging.INFO)
        self.log.propagate = False
        self.client = api_client_from(self.kubeconfig)
        python = self.image_bin / "python"
        own = {p.name for p in self.image_bin.iterdir()}
        scripts = write_image_bin(python, self.image_scripts, skip=own)
        self.log.info(
            "image: %s, then %d console scripts in %s", self.image_bin, len(scripts),
            self.image_scripts,
        )  # fmt: skip
        self._start_network()
        if self.provision_volumes:
            self.provisioner = LocalDirProvisioner(self.client, self.workdir / "volumes", self.log)
            self.provisioner.start()
        for node in self.nodes:
            self._register(node)
        self._spawn("heartbeat", self._heartbeat_loop)
        for node in self.nodes:
            self._spawn(f"watch-{node}", self._watch_loop, node)
        if self.network is not None:
            self._spawn("hosts", self._hosts_loop)
        self._wait_schedulable(timeout)
        pods = str(self.network.subnet) if self.network else f"127.{self._octet}.x.y"
        self.log.info("agent ready: nodes %s, pod IPs %s", self.nodes, pods)

    def _start_network(self) -> None:
        if self.network_mode == "loopback":
            self.network_unavailable = "the agent was started with network='loopback'"
            return
        reason = network_unavailable_reason()
        if reason is None:
            network = ClusterNetwork(self.log)
            try:
                network.create()
                if self.apiserver_port:
                    self.api_proxy = ApiProxy(network.cluster_ns, self.apiserver_port, self.log)
            except (NetworkUnavailableError, OSError) as exc:
                network.destroy()
                reason = f"pod network setup failed: {exc}"
            else:
                self.network = network
                return
        if self.network_mode == "netns":
            raise NetworkUnavailableError(reason)
        self.network_unavailable = reason
        self.log.warning("pods share the host's network (loopback addresses): %s", reason)

    def expose_host_port(self, name: str, host_port: int, port: int | None = None) -> str:
        """Make a service listening on the host's 127.0.0.1:``host_port`` (e.g. the S3 server)
        reachable from pods; returns the ``host:port`` they connect to. With network
        namespaces: a TcpRelay at the next 10.0.1.N (port ``port``, default ``host_port``);
        without them pods share the host's loopback, so it is the host address itself."""
        if self.network is None:
            return f"127.0.0.1:{host_port}"
        with self.lock:
            ip = f"{HOST_SERVICE_NET}.{len(self.relays) + 1}"
            self.network.add_local_address(ip)
            relay = TcpRelay(
                self.network.cluster_ns,
                (ip, port or host_port),
                ("127.0.0.1", host_port),
                self.log,
                name=f"relay-{name}",
            )
            self.relays.append(relay)
        self.log.info(
            "%s: pods reach 127.0.0.1:%d at %s:%d", name, host_port, ip, port or host_port
        )
        return f"{ip}:{port or host_port}"

    def protected_paths(self) -> list[Path]:
        """Host paths a pod's processes need (the agent's files, the "image": venv, Python,
        this repository): a volume mounted over one of them, or over a parent, would hide them,
        so such a mount is left to path rewriting."""
        paths = {
            self.workdir,
            self.image_bin.parent,
            Path(sys.prefix),
            Path(sys.base_prefix),
            Path(__file__).parents[2],
        }
        return [p.resolve() for p in paths]

    def silence_node(self, node: str) -> None:
        """Stop renewing ``node``'s Lease and status and stop acting on its pods' updates (the
        node is cut off from the control plane); its processes keep running, as on a node that
        lost its network."""
        with self.lock:
            self._silenced.add(node)
        self.log.info("node %s: silenced (no heartbeats, no pod updates)", node)

    def unsilence_node(self, node: str) -> None:
        """The node is back: heartbeats resume and its pods are listed again (what happened to
        them meanwhile, e.g. a deletion, is acted on now)."""
        with self.lock:
            self._silenced.discard(node)
            self._relist.add(node)
            ended = [w for w in self._workers.values() if w.record.node == node and w.finished]
        self.log.info("node %s: heartbeats resumed", node)
        # What happened meanwhile is reported now, as a kubelet does when it reconnects.
        for worker in ended:
            with contextlib.suppress(Exception):
                worker._report()

    def kill_node(self, node: str) -> list[PodRecord]:
        """The machine dies: no more heartbeats or status, and every process of its pods is
        SIGKILLed at once (nothing is reported: the API keeps the pods as they were). Returns
        the records of the pods that were running."""
        self.silence_node(node)
        with self.lock:
            workers = [w for w in self._workers.values()
                       if w.record.node == node and not w.finished]  # fmt: skip
        for worker in workers:
            for c in worker.inits + worker.mains:
                worker._kill_group(c)
        self.log.info("node %s: killed %d pods", node, len(workers))
        return [w.record for w in workers]

    def restore_node(self, node: str, timeout: float = 120.0) -> None:
        """Bring a node back (registered again if its Node object was deleted) and wait until
        it is schedulable."""
        self.unsilence_node(node)
        self._register(node)
        deadline = time.monotonic() + timeout
        core = kubernetes.client.CoreV1Api(self.client)
        while True:
            taints = core.read_node(node).spec.taints or []
            if not any(t.key.startswith("node.kubernetes.io/") for t in taints):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {node} still tainted {taints} after {timeout:.0f} s")
            time.sleep(0.5)

    def cut_pod_network(self, namespace: str, name: str) -> None:
        """Take the pod's interface down: its processes run on but reach nobody (as on a node
        that lost its network)."""
        record = self.record(namespace, name)
        if record is None or record.netns is None:
            raise KeyError(f"no running pod {namespace}/{name} with its own network namespace")
        subprocess.run(
            ["ip", "-n", record.netns, "link", "set", "eth0", "down"],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip
        self.log.info("pod %s/%s: network cut", namespace, name)

    def stop(self) -> None:
        """Stop watching, end every pod process (SIGTERM, 5 s, SIGKILL); no status reports."""
        self.stopping.set()
        with self.lock:
            workers = list(self._workers.values())
        for worker in workers:
            if worker.is_alive():
                worker.request_termination(min(5.0, worker._term_grace or 5.0), gone=True)
        for worker in workers:
            worker.join(15)
        if self.provisioner is not None:
            self.provisioner.stop()
        for relay in [self.api_proxy, *self.relays]:
            if relay is not None:
                with contextlib.suppress(Exception):
                    relay.close()
        if self.network is not None:
            self.network.destroy()
        # Watch threads notice `stopping` when their (short) watch request ends; they are daemons
        # and make no further requests, so do not wait for them.
        for thread in self._threads:
            thread.join(0.2)
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close()
        if self._handler is not None:
            self.log.removeHandler(self._handler)
            self._handler.close()

    def _spawn(self, name: str, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    # ---------------------------------------------------------------------- queries for tests
    def records(self) -> list[PodRecord]:
        with self.lock:
            return list(self._records)

    def record(self, namespace: str, name: str) -> PodRecord | None:
        """The newest record of pod ``namespace/name``."""
        with self.lock:
            for record in reversed(self._records):
                if record.namespace == namespace and record.name == name:
                    return record
        return None

    def wait_for_record(
        self, namespace: str, name: str, *, finished: bool = True, timeout: float = 120.0
    ) -> PodRecord:
        deadline = time.monotonic() + timeout
        while True:
            record = self.record(namespace, name)
            if record is not None and (not finished or record.done.wait(0.1)):
                return record
            if time.monotonic() > deadline:
                state = "finished" if finished else "started"
                raise TimeoutError(
                    f"pod {namespace}/{name} not {state} by the node agent in {timeout:.0f} s"
                )
            time.sleep(0.1)

    def log_path(self, namespace: str, name: str, container: str | None = None) -> Path:
        """Log file of the newest run of ``container`` (default: the first main container)."""
        record = self.record(namespace, name)
        if record is None:
            raise KeyError(f"node agent never ran pod {namespace}/{name}")
        runs = [
            r for r in record.runs if not r.init and (container is None or r.container == container)
        ]
        if not runs:
            raise KeyError(f"pod {namespace}/{name} has no run of container {container!r}")
        return runs[-1].log

    # --------------------------------------------------------------------------------- nodes
    def _register(self, node: str) -> None:
        core = kubernetes.client.CoreV1Api(self.client)
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": node,
                "labels": {
                    "kubernetes.io/hostname": node,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "preemptible.dev/node-agent": "true",
                },
            },
        }
        try:
            core.create_node(body)
        except ApiException as exc:
            if exc.status != 409:
                raise
        self._node_status(node, full=True)
        self._renew_lease(node)

    def _node_status(self, node: str, *, full: bool = False) -> None:
        now = _ts(_now())
        conditions = [
            {"type": kind, "status": "False", "reason": reason, "lastHeartbeatTime": now,
             "lastTransitionTime": now}
            for kind, reason in (
                ("MemoryPressure", "KubeletHasSufficientMemory"),
                ("DiskPressure", "KubeletHasNoDiskPressure"),
                ("PIDPressure", "KubeletHasSufficientPID"),
            )
        ]  # fmt: skip
        conditions.append(
            {"type": "Ready", "status": "True", "reason": "KubeletReady", "lastHeartbeatTime": now,
             "lastTransitionTime": now, "message": "test node agent is posting ready status"}
        )  # fmt: skip
        status: dict[str, Any] = {"conditions": conditions}
        if full:
            status.update(
                {
                    "capacity": self.capacity,
                    "allocatable": self.capacity,
                    "addresses": [
                        {"type": "InternalIP", "address": "127.0.0.1"},
                        {"type": "Hostname", "address": node},
                    ],
                    "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
                    "nodeInfo": {
                        "machineID": node,
                        "systemUUID": node,
                        "bootID": node,
                        "kernelVersion": os.uname().release,
                        "osImage": "preemptible test node agent",
                        "containerRuntimeVersion": "preemptible-node-agent://1",
                        "kubeletVersion": self.k8s_version,
                        "kubeProxyVersion": "",
                        "operatingSystem": "linux",
                        "architecture": "amd64",
                    },
                }
            )
        kubernetes.client.CoreV1Api(self.client).patch_node_status(
            node, {"status": status}, _content_type=_SMP
        )

    def _renew_lease(self, node: str) -> None:
        coordination = kubernetes.client.CoordinationV1Api(self.client)
        renew = _now().strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        spec = {"holderIdentity": node, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": renew}
        try:
            coordination.patch_namespaced_lease(
                node,
                "kube-node-lease",
                {"spec": spec},
                _content_type="application/merge-patch+json",
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            coordination.create_namespaced_lease(
                "kube-node-lease",
                {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                 "metadata": {"name": node, "namespace": "kube-node-lease"}, "spec": spec},
            )  # fmt: skip

    def _heartbeat_loop(self) -> None:
        while not self.stopping.wait(HEARTBEAT_SECONDS):
            for node in self.nodes:
                if node in self._silenced:
                    continue
                try:
                    self._renew_lease(node)
                    self._node_status(node)
                except Exception as exc:
                    self.log.warning("heartbeat for %s failed: %s", node, exc)

    def _wait_schedulable(self, timeout: float) -> None:
        core = kubernetes.client.CoreV1Api(self.client)
        deadline = time.monotonic() + timeout
        pending = set(self.nodes)
        while pending:
            for node in list(pending):
                taints = core.read_node(node).spec.taints or []
                if not any(t.key == "node.kubernetes.io/not-ready" for t in taints):
                    pending.discard(node)
            if not pending:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"nodes {sorted(pending)} still tainted not-ready after {timeout:.0f} s "
                    "(is kube-controller-manager's node lifecycle controller running?)"
                )
            time.sleep(0.5)

    # ---------------------------------------------------------------------------------- pods
    def _watch_loop(self, node: str) -> None:
        core = kubernetes.client.CoreV1Api(self.client)
        selector = f"spec.nodeName={node}"
        resource_version: str | None = None
        while not self.stopping.is_set():
            with self.lock:
                if node in self._relist:
                    self._relist.discard(node)
                    resource_version = None
            try:
                if resource_version is None:
                    listing = core.list_pod_for_all_namespaces(field_selector=selector)
                    resource_version = listing.metadata.resource_version
                    for pod in listing.items:
                        self._on_pod("ADDED", self.client.sanitize_for_serialization(pod))  # type: ignore[union-attr]
                    self.forget_missing(node, {pod.metadata.uid for pod in listing.items})
                watch = kubernetes.watch.Watch()
                for event in watch.stream(
                    core.list_pod_for_all_namespaces,
                    field_selector=selector,
                    resource_version=resource_version,
                    timeout_seconds=5,  # short, so stop() is noticed quickly
                    deserialize=False,
                ):
                    pod = event["object"]
                    resource_version = pod["metadata"]["resourceVersion"]
                    self._on_pod(event["type"], pod)
                    if self.stopping.is_set():
                        watch.stop()
                        break
            except ApiException as exc:
                resource_version = None  # list again: _on_pod is idempotent per UID
                if exc.status != 410:  # 410: our resourceVersion is too old
                    self.log.warning("watch on %s: %s", node, exc)
                    time.sleep(1)
            except Exception as exc:
                # The client raises on a watch ERROR event too; with deserialize=False an expired
                # resourceVersion surfaces as KeyError('raw_object'). Watching again from the same
                # version would fail forever (the node would stop running pods): list again.
                resource_version = None
                if not self.stopping.is_set():
                    self.log.warning("watch on %s: %r; listing again", node, exc)
                    time.sleep(1)

    def forget_missing(self, node: str, listed_uids: set[str]) -> list[str]:
        """After a (re-)list: stop the pods of ``node`` whose objects are gone. A pod deleted
        while the watch was down never sends its DELETED event; without this its process would
        run on. Returns the UIDs stopped."""
        if node in self._silenced:
            return []
        with self.lock:
            gone = [
                worker
                for uid, worker in self._workers.items()
                if worker.record.node == node and uid not in listed_uids and not worker.finished
            ]
        for worker in gone:
            self.log.info(
                "pod %s/%s: not in the listing any more (deleted while the watch was down)",
                worker.record.namespace,
                worker.record.name,
            )
            worker.request_termination(None, gone=True)
        return [worker.record.uid for worker in gone]

    def _on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        if self.stopping.is_set():
            return
        meta = pod["metadata"]
        uid = meta["uid"]
        deleting = meta.get("deletionTimestamp") is not None
        if pod.get("spec", {}).get("nodeName") in self._silenced:
            return  # a node cut off from the control plane sees no updates
        with self.lock:
            worker = self._workers.get(uid)
            if kind == "DELETED":
                if worker is not None and not worker.finished:
                    worker.request_termination(meta.get("deletionGracePeriodSeconds"), gone=True)
                self._finalized.discard(uid)
                return
            if worker is not None:
                if worker.finished and pod.get("status", {}).get("phase") not in _TERMINAL:
                    # Its last report was lost (the apiserver was down then): report again, as
                    # kubelet's status manager resyncs, or the pod would look Running forever.
                    with contextlib.suppress(Exception):
                        worker._report()
                if deleting:
                    if worker.finished:
                        self.delete_now(pod)
                    else:
                        worker.request_termination(meta.get("deletionGracePeriodSeconds"))
                elif not worker.finished:
                    worker.refresh_downward(pod)
                return
            if deleting or pod.get("status", {}).get("phase") in _TERMINAL:
                # Never ran here (or ran before this agent): nothing to stop.
                if deleting:
                    self.delete_now(pod)
                return
            netns = None
            if self.network is not None and pod["spec"].get("hostNetwork"):
                ip = "127.0.0.1"  # the host's network: the node's address, as kubelet reports
            elif self.network is not None:
                try:
                    netns, ip = self.network.attach(uid)
                except NetworkUnavailableError as exc:
                    self.log.error("pod %s/%s: no network: %s", meta["namespace"],
                                   meta["name"], exc)  # fmt: skip
                    return  # retried at the next event or listing
            else:
                ip = self._allocate_ip()
            worker = _PodWorker(self, pod, ip, netns)
            self._workers[uid] = worker
            self._records.append(worker.record)
        self.log.info("pod %s/%s: admitted, IP %s", meta["namespace"], meta["name"], ip)
        worker.start()

    # ------------------------------------------------------------------------ name resolution
    def _hosts_loop(self) -> None:
        while not self.stopping.wait(HOSTS_REFRESH_SECONDS):
            try:
                self.refresh_hosts()
            except Exception as exc:
                self.log.warning("hosts refresh: %r", exc)

    def _services(self) -> list[ServiceRecord]:
        core = kubernetes.client.CoreV1Api(self.client)
        discovery = kubernetes.client.DiscoveryV1Api(self.client)
        ready: dict[tuple[str, str], list[str]] = {}
        for eps in discovery.list_endpoint_slice_for_all_namespaces().items:
            service = (eps.metadata.labels or {}).get("kubernetes.io/service-name")
            if not service:
                continue
            for endpoint in eps.endpoints or []:
                if endpoint.conditions is None or endpoint.conditions.ready is not False:
                    ready.setdefault((eps.metadata.namespace, service), []).extend(
                        endpoint.addresses or []
                    )
        records = []
        for svc in core.list_service_for_all_namespaces().items:
            key = (svc.metadata.namespace, svc.metadata.name)
            cluster_ip = svc.spec.cluster_ip or ""
            if cluster_ip == "None":
                ips = tuple(sorted(set(ready.get(key, []))))
                records.append(ServiceRecord(*key, ips=ips, headless=True))
            elif cluster_ip:
                records.append(ServiceRecord(*key, ips=(cluster_ip,)))
        return records

    def refresh_hosts(self) -> None:
        """Rewrite every running pod's /etc/hosts from the pods here and the API's Services and
        EndpointSlices. Written in place (same inode: the file is bind-mounted), one write."""
        with self._hosts_lock:
            with self.lock:
                workers = [w for w in self._workers.values() if not w.finished]
            workers = [w for w in workers if w.record.netns is not None]
            if not workers:
                return
            services = self._services()
            pods = [w.hosts_entry() for w in workers]
            for worker in workers:
                content = hosts_file(worker.hosts_entry(), pods, services).encode()
                path = worker.hosts_path
                with contextlib.suppress(FileNotFoundError):
                    if path.read_bytes() == content:
                        continue
                    fd = os.open(path, os.O_WRONLY)
                    try:
                        os.pwrite(fd, content, 0)
                        os.ftruncate(fd, len(content))
                    finally:
                        os.close(fd)

    def _allocate_ip(self) -> str:
        n = self._next_ip
        self._next_ip += 1
        if n % 256 in (0, 255):  # skip network/broadcast-looking addresses
            n += 2
            self._next_ip = n + 1
        return f"127.{self._octet}.{n // 256}.{n % 256}"

    def patch_status(self, pod: Mapping[str, Any], status: dict[str, Any]) -> None:
        meta = pod["metadata"]
        if pod.get("spec", {}).get("nodeName") in self._silenced:
            return  # cut off from the control plane
        body = {"metadata": {"uid": meta["uid"]}, "status": status}
        try:
            kubernetes.client.CoreV1Api(self.client).patch_namespaced_pod_status(
                meta["name"], meta["namespace"], body, _content_type=_SMP
            )
        except ApiException as exc:
            if exc.status not in (404, 409):
                self.log.warning("status of %s/%s: %s %s", meta["namespace"], meta["name"],
                                 exc.status, exc.body)  # fmt: skip

    def delete_now(self, pod: Mapping[str, Any]) -> None:
        """kubelet's last step: remove the pod object (gracePeriodSeconds=0, this UID only)."""
        meta = pod["metadata"]
        if pod.get("spec", {}).get("nodeName") in self._silenced:
            return
        with self.lock:
            if meta["uid"] in self._finalized:
                return
            self._finalized.add(meta["uid"])
        try:
            kubernetes.client.CoreV1Api(self.client).delete_namespaced_pod(
                meta["name"],
                meta["namespace"],
                body={"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}},
            )
            self.log.info("pod %s/%s: removed", meta["namespace"], meta["name"])
        except ApiException as exc:
            if exc.status not in (404, 409):
                with self.lock:
                    self._finalized.discard(meta["uid"])  # retried at the next event or listing
                self.log.warning("delete %s/%s: %s", meta["namespace"], meta["name"], exc)
        except Exception as exc:
            # The apiserver is unreachable (restarting): try again at the next event or listing.
            with self.lock:
                self._finalized.discard(meta["uid"])
            self.log.warning("delete %s/%s: %r", meta["namespace"], meta["name"], exc)


def main(argv: list[str] | None = None) -> int:
    """Run the agent alone against a cluster: python -m tests.cluster.node_agent --kubeconfig X."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--node", action="append", dest="nodes", help="node name (repeatable)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/preemptible-node-agent"))
    parser.add_argument(
        "--capacity",
        action="append",
        default=[],
        metavar="RESOURCE=QUANTITY",
        help="node capacity, e.g. pods=200 (repeatable; the rest as DEFAULT_CAPACITY)",
    )
    parser.add_argument("--apiserver-port", type=int, default=0)
    parser.add_argument("--k8s-version", default="v0.0.0")
    parser.add_argument("--start-timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    capacity = dict(DEFAULT_CAPACITY)
    for item in args.capacity:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--capacity {item!r}: use RESOURCE=QUANTITY, e.g. pods=200")
        capacity[key] = value
    agent = NodeAgent(
        args.kubeconfig,
        args.workdir,
        nodes=args.nodes or ["node-1"],
        capacity=capacity,
        apiserver_port=args.apiserver_port,
        k8s_version=args.k8s_version,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    agent.start(timeout=args.start_timeout)
    print(f"node agent running nodes {agent.nodes}; log {agent.log_file}", flush=True)
    stop.wait()
    agent.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
