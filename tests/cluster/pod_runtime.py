"""Pure pieces of the stand-in node agent: what kubelet would compute for a container (environment,
$(VAR) expansion, container paths mapped to host directories, termination message, pod phase).

Pods are plain dicts in the API's JSON form (camelCase), as a watch delivers them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CLUSTER_DOMAIN",
    "MAX_FALLBACK_LOG_BYTES",
    "MAX_FALLBACK_LOG_LINES",
    "MAX_TERMINATION_MESSAGE_BYTES",
    "MIN_GRACE_SECONDS",
    "ContainerConfigError",
    "ContainerExit",
    "HostsPod",
    "MountMap",
    "ServiceRecord",
    "container_exit",
    "expand",
    "field_value",
    "hosts_file",
    "pod_phase",
    "termination_message",
]

# kubelet's limits (pkg/kubelet/container): message file read up to 4 KiB; FallbackToLogsOnError
# takes the last 80 log lines, at most 2 KiB.
MAX_TERMINATION_MESSAGE_BYTES = 4096
MAX_FALLBACK_LOG_LINES = 80
MAX_FALLBACK_LOG_BYTES = 2048
# kubelet never kills a container with less than 2 s of grace.
MIN_GRACE_SECONDS = 2


CLUSTER_DOMAIN = "cluster.local"


class ContainerConfigError(ValueError):
    """The container cannot be started as specified (kubelet: CreateContainerConfigError)."""


_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes $(VAR) expansion: $(NAME) becomes env[NAME] when defined (else stays as is),
    $$ becomes $."""

    def repl(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env.get(name, match.group(0))

    return _VAR_REF.sub(repl, value)


_SUBSCRIPT = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


def field_value(pod: Mapping[str, Any], field_path: str) -> str:
    """The downward-API value of ``field_path`` for ``pod`` (the fields kubelet offers env)."""
    meta = pod.get("metadata", {})
    spec = pod.get("spec", {})
    status = pod.get("status", {})
    simple: dict[str, Callable[[], str]] = {
        "metadata.name": lambda: meta.get("name", ""),
        "metadata.namespace": lambda: meta.get("namespace", ""),
        "metadata.uid": lambda: meta.get("uid", ""),
        "spec.nodeName": lambda: spec.get("nodeName", ""),
        "spec.serviceAccountName": lambda: spec.get("serviceAccountName", ""),
        "status.hostIP": lambda: status.get("hostIP", ""),
        "status.hostIPs": lambda: ",".join(i["ip"] for i in status.get("hostIPs", [])),
        "status.podIP": lambda: status.get("podIP", ""),
        "status.podIPs": lambda: ",".join(i["ip"] for i in status.get("podIPs", [])),
    }
    if field_path in simple:
        return simple[field_path]()
    match = _SUBSCRIPT.match(field_path)
    if match:
        return (meta.get(match.group(1)) or {}).get(match.group(2), "")
    raise ContainerConfigError(
        f"env valueFrom.fieldRef.fieldPath {field_path!r} is not supported by the test node agent; "
        "use metadata.name/namespace/uid, metadata.labels['k'], metadata.annotations['k'], "
        "spec.nodeName, spec.serviceAccountName, status.podIP(s) or status.hostIP(s)"
    )


@dataclass(frozen=True)
class MountMap:
    """Container mount paths -> host directories. A value that starts with a mount path (or is
    ``file://`` + such a path, or ``--flag=`` + such a path) is rewritten to the host directory,
    because the pod's processes see the host filesystem, not the container's."""

    mounts: tuple[tuple[str, str], ...]  # (mountPath, host dir), longest mountPath first

    @classmethod
    def of(cls, pairs: Sequence[tuple[str, str]]) -> MountMap:
        cleaned = [(m.rstrip("/") or "/", h.rstrip("/") or "/") for m, h in pairs]
        return cls(tuple(sorted(cleaned, key=lambda p: len(p[0]), reverse=True)))

    def _path(self, value: str) -> str | None:
        for mount, host in self.mounts:
            if value == mount:
                return host
            if value.startswith(mount + "/"):
                return host + value[len(mount) :]
        return None

    def rewrite(self, value: str) -> str:
        mapped = self._path(value)
        if mapped is not None:
            return mapped
        if value.startswith("file://"):
            mapped = self._path(value[len("file://") :])
            if mapped is not None:
                return "file://" + mapped
        if value.startswith("-") and "=" in value:
            flag, _, rest = value.partition("=")
            rewritten = self.rewrite(rest)
            if rewritten != rest:
                return f"{flag}={rewritten}"
        return value


@dataclass(frozen=True)
class ContainerExit:
    exit_code: int
    signal: int | None
    reason: str


def container_exit(returncode: int) -> ContainerExit:
    """Popen's returncode in the form kubelet reports: a signal N gives exit code 128+N."""
    if returncode < 0:
        return ContainerExit(128 - returncode, -returncode, "Error")
    return ContainerExit(returncode, None, "Completed" if returncode == 0 else "Error")


def termination_message(
    message_file: Path, log_file: Path, *, policy: str | None, exit_code: int
) -> str:
    """kubelet's rule: the file's content (first 4 KiB); with FallbackToLogsOnError and a failed
    container whose file is empty, the last 80 log lines (last 2 KiB)."""
    message = ""
    try:
        with message_file.open("rb") as f:
            message = f.read(MAX_TERMINATION_MESSAGE_BYTES).decode(errors="replace")
    except FileNotFoundError:
        pass
    if not message and policy == "FallbackToLogsOnError" and exit_code != 0:
        try:
            lines = log_file.read_bytes().splitlines(keepends=True)
        except FileNotFoundError:
            lines = []
        data = b"".join(lines[-MAX_FALLBACK_LOG_LINES:])[-MAX_FALLBACK_LOG_BYTES:]
        message = data.decode(errors="replace")
    return message


def pod_phase(restart_policy: str, exits: Sequence[int | None], *, terminating: bool) -> str:
    """Phase from the containers' last exit codes (None: running or not started yet).

    A container restarted in place (Always; OnFailure after a failure) shows as running, so by the
    time this is called its exit is None. Terminating pods end Succeeded iff every container
    exited 0, as kubelet does before it lets the pod go.
    """
    if any(code is None for code in exits):
        return "Running"
    if all(code == 0 for code in exits):
        if restart_policy == "Always" and not terminating:
            return "Running"
        return "Succeeded"
    if restart_policy == "Never" or terminating:
        return "Failed"
    return "Running"


@dataclass(frozen=True)
class HostsPod:
    """What name resolution needs to know about one pod."""

    namespace: str
    hostname: str
    subdomain: str
    ip: str


@dataclass(frozen=True)
class ServiceRecord:
    """A Service as cluster DNS answers it: its ClusterIP, or for a headless Service (``headless``)
    the addresses of its ready endpoints."""

    namespace: str
    name: str
    ips: tuple[str, ...]
    headless: bool = False


def _names(stem: str, namespace: str, own_namespace: str, domain: str) -> list[str]:
    """The names a DNS client of ``own_namespace`` resolves to ``stem.namespace.svc.domain``:
    the FQDN, and the forms its search path (``<ns>.svc.<domain> svc.<domain> <domain>``)
    completes."""
    names = [f"{stem}.{namespace}.svc.{domain}", f"{stem}.{namespace}.svc", f"{stem}.{namespace}"]
    if namespace == own_namespace:
        names.append(stem)
    return names


def hosts_file(
    own: HostsPod,
    pods: Sequence[HostsPod],
    services: Sequence[ServiceRecord],
    *,
    domain: str = CLUSTER_DOMAIN,
) -> str:
    """The /etc/hosts a pod gets in place of cluster DNS.

    - kubelet's own entries: localhost, and ``<podIP> <fqdn> <hostname>`` (fqdn
      ``<hostname>.<subdomain>.<ns>.svc.<domain>`` when the pod has a subdomain);
    - a pod with ``hostname`` and ``subdomain`` where a headless Service named ``subdomain`` exists
      in its namespace: ``<hostname>.<subdomain>.<ns>.svc.<domain>`` (DNS's pod A record) and the
      shorter forms the search path gives (``<hostname>.<subdomain>`` from the same namespace);
    - a Service: ``<svc>.<ns>.svc.<domain>`` and its search-path forms, to its ClusterIP, or to
      each ready endpoint address when headless.
    """
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    headless = {(s.namespace, s.name) for s in services if s.headless}
    if own.subdomain:
        stem = f"{own.hostname}.{own.subdomain}"
        names = [f"{stem}.{own.namespace}.svc.{domain}"]
        if (own.namespace, own.subdomain) in headless:
            names = _names(stem, own.namespace, own.namespace, domain)
        lines.append(f"{own.ip}\t{' '.join(names)} {own.hostname}")
    else:
        lines.append(f"{own.ip}\t{own.hostname}")
    for pod in sorted(pods, key=lambda p: (p.namespace, p.subdomain, p.hostname, p.ip)):
        if pod.ip == own.ip:
            continue  # named in the pod's own line above
        if not pod.subdomain or (pod.namespace, pod.subdomain) not in headless:
            continue
        stem = f"{pod.hostname}.{pod.subdomain}"
        lines.append(f"{pod.ip}\t" + " ".join(_names(stem, pod.namespace, own.namespace, domain)))
    for svc in sorted(services, key=lambda s: (s.namespace, s.name)):
        names = " ".join(_names(svc.name, svc.namespace, own.namespace, domain))
        lines.extend(f"{ip}\t{names}" for ip in svc.ips)
    return "\n".join(lines) + "\n"
