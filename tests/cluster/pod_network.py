"""Pod networking for the stand-in node agent: a network namespace per pod, joined by a veth pair
to a bridge that lives in a "cluster" network namespace the tier creates itself.

Layout (X is picked per agent so that two sessions on one machine do not collide)::

    pod netns pe<pid>-p<N>: eth0 10.X.a.b/16, default via 10.X.0.1
          |  veth
    cluster netns pe<pid>-c: bridge br0 10.X.0.1/16; 10.0.0.1/32 on lo (the "kubernetes" Service
          |  veth              IP: a proxy to the apiserver, see ApiProxy); 10.0.1.N/32 on lo
          |                    for other host services (the S3 server, TcpRelay); forwarding on
    host: veth h<pid> with NO address; route 10.X.0.0/16 via 10.X.0.1 onlink

Private addresses exist only inside namespaces created here; the machine's own interfaces get
none (the host end of the uplink has no address, the host only gains a route to the pod subnet,
which disappears with the namespace). Nothing is routed off the machine: the cluster netns has no
other way out, and the host does not forward for it.

Processes on the host (the control plane, an operator run outside the cluster) reach pod IPs
through that route; pods reach the apiserver (which listens on the host's 127.0.0.1) through
``ApiProxy`` at 10.0.0.1:443, as in-cluster clients expect (KUBERNETES_SERVICE_HOST/PORT), and
other services of the host (the tier's S3 server) through a ``TcpRelay`` at 10.0.1.N, an address
outside the Service range (10.0.0.0/24), so no ClusterIP the apiserver hands out can shadow it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import logging
import os
import random
import socket
import subprocess
import threading
from pathlib import Path

__all__ = [
    "HOST_SERVICE_NET",
    "KUBERNETES_SERVICE_IP",
    "KUBERNETES_SERVICE_PORT",
    "ApiProxy",
    "ClusterNetwork",
    "NetworkUnavailableError",
    "TcpRelay",
    "network_unavailable_reason",
    "pod_address",
]

KUBERNETES_SERVICE_IP = "10.0.0.1"  # first address of --service-cluster-ip-range=10.0.0.0/24
KUBERNETES_SERVICE_PORT = 443
# Addresses of host services relayed into the pod network (TcpRelay): 10.0.1.1, 10.0.1.2, ...
HOST_SERVICE_NET = "10.0.1"
NETNS_DIR = Path("/run/netns")
_CLONE_NEWNET = 0x40000000
_PREFIX = "pe"


class NetworkUnavailableError(RuntimeError):
    """Network namespaces cannot be made on this machine (not root, no `ip`, no permission)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL
    )
    if check and result.returncode != 0:
        raise NetworkUnavailableError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def network_unavailable_reason() -> str | None:
    """None if this process can create network namespaces, else why not (probed for real)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_SYS_ADMIN, CAP_NET_ADMIN)"
    dirs = [d for d in os.environ.get("PATH", "").split(":") if d] + ["/usr/sbin", "/usr/bin"]
    for tool in ("ip", "nsenter", "unshare", "mount"):
        if not any((Path(d) / tool).exists() for d in dirs):
            return f"{tool!r} is not installed"
    name = f"{_PREFIX}{os.getpid()}-probe{random.randint(0, 1 << 20)}"
    try:
        _ip("netns", "add", name)
    except (NetworkUnavailableError, OSError) as exc:
        return f"cannot create a network namespace: {exc}"
    _ip("netns", "del", name, check=False)
    return None


def pod_address(subnet_octet: int, index: int) -> str:
    """The index-th pod address in 10.<subnet_octet>.0.0/16, skipping .0, .1 (gateway), .255."""
    a, b = divmod(index, 253)
    return f"10.{subnet_octet}.{a}.{b + 2}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale() -> None:
    """Delete namespaces left by agents whose process is gone (a crashed test session)."""
    if not NETNS_DIR.is_dir():
        return
    for entry in NETNS_DIR.iterdir():
        name = entry.name
        if not name.startswith(_PREFIX):
            continue
        pid_text = name[len(_PREFIX) :].split("-", 1)[0]
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            _ip("netns", "del", name, check=False)


def _used_networks() -> list[ipaddress.IPv4Network]:
    out = _ip("-j", "-4", "route", "show", "table", "all", check=False).stdout or "[]"
    nets = []
    for route in json.loads(out):
        dst = route.get("dst", "")
        if dst in ("default", "") or ":" in dst:
            continue
        with contextlib.suppress(ValueError):
            nets.append(ipaddress.ip_network(dst, strict=False))
    return nets


class ClusterNetwork:
    """The cluster netns, its bridge and the host uplink; ``attach``/``detach`` pod namespaces."""

    def __init__(self, log: logging.Logger | None = None) -> None:
        self.log = log or logging.getLogger(__name__)
        self.tag = f"{_PREFIX}{os.getpid()}"
        self.cluster_ns = f"{self.tag}-c"
        self.host_link = f"h{os.getpid()}"[:15]
        self.octet = 0
        self.subnet: ipaddress.IPv4Network | None = None
        self.gateway = ""
        self._lock = threading.Lock()
        self._index = 0
        self._pods: dict[str, str] = {}  # pod key -> netns name

    # ------------------------------------------------------------------------------ lifecycle
    def create(self, tries: int = 5) -> None:
        _remove_stale()
        for attempt in range(tries):
            used = _used_networks()
            candidates = [o for o in range(100, 250) if not any(
                n.overlaps(ipaddress.ip_network(f"10.{o}.0.0/16")) for n in used)]  # fmt: skip
            if not candidates:
                raise NetworkUnavailableError("no free 10.X.0.0/16 subnet for pods on this machine")
            try:
                self._create(random.choice(candidates))
                return
            except NetworkUnavailableError:
                # Another session may have taken the same subnet in the meantime: pick again.
                if attempt == tries - 1:
                    raise

    def _create(self, octet: int) -> None:
        self.octet = octet
        self.subnet = ipaddress.ip_network(f"10.{self.octet}.0.0/16")
        self.gateway = f"10.{self.octet}.0.1"
        c = self.cluster_ns
        _ip("netns", "add", c)
        try:
            _ip("-n", c, "link", "set", "lo", "up")
            _ip("-n", c, "link", "add", "br0", "type", "bridge")
            _ip("-n", c, "addr", "add", f"{self.gateway}/16", "dev", "br0")
            _ip("-n", c, "link", "set", "br0", "up")
            _ip("-n", c, "addr", "add", f"{KUBERNETES_SERVICE_IP}/32", "dev", "lo")
            # Forward between the bridge and the uplink inside the cluster netns only.
            _nsenter_write(c, "/proc/sys/net/ipv4/ip_forward", "1")
            _ip("link", "add", self.host_link, "type", "veth", "peer", "name", "up0", "netns", c)
            _ip("link", "set", self.host_link, "up")
            _ip("-n", c, "link", "set", "up0", "up")
            _ip("-n", c, "route", "add", "default", "dev", "up0")
            _ip("route", "add", str(self.subnet), "via", self.gateway, "dev", self.host_link,
                "onlink")  # fmt: skip
        except BaseException:
            self.destroy()
            raise
        self.log.info("pod network: %s in netns %s (gateway %s)", self.subnet, c, self.gateway)

    def destroy(self) -> None:
        with self._lock:
            names = list(self._pods.values())
            self._pods.clear()
        for name in names:
            _ip("netns", "del", name, check=False)
        _ip("link", "del", self.host_link, check=False)  # also removes the route
        _ip("netns", "del", self.cluster_ns, check=False)

    # ---------------------------------------------------------------------------------- pods
    def attach(self, key: str) -> tuple[str, str]:
        """A new pod netns with its own address; returns (netns name, IP)."""
        with self._lock:
            index = self._index
            self._index += 1
        ns = f"{self.tag}-p{index}"
        peer = f"v{os.getpid() % 10000}x{index}"[:15]
        ip = pod_address(self.octet, index)
        c = self.cluster_ns
        _ip("netns", "add", ns)
        try:
            _ip("-n", c, "link", "add", peer, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", c, "link", "set", peer, "master", "br0")
            _ip("-n", c, "link", "set", peer, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{ip}/16", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "route", "add", "default", "via", self.gateway)
        except BaseException:
            _ip("netns", "del", ns, check=False)
            raise
        with self._lock:
            self._pods[key] = ns
        return ns, ip

    def detach(self, key: str) -> None:
        with self._lock:
            ns = self._pods.pop(key, None)
        if ns is not None:
            _ip("netns", "del", ns, check=False)  # its veth pair goes with it

    def add_local_address(self, ip: str) -> None:
        """An address of the cluster netns itself (on its loopback), which every pod reaches
        through its default route: where a TcpRelay listens."""
        _ip("-n", self.cluster_ns, "addr", "add", f"{ip}/32", "dev", "lo")

    @staticmethod
    def netns_path(name: str) -> str:
        return str(NETNS_DIR / name)


def _nsenter_write(ns: str, path: str, value: str) -> None:
    result = subprocess.run(
        ["nsenter", f"--net={NETNS_DIR / ns}", "sh", "-c", f"echo {value} > {path}"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if result.returncode != 0:
        raise NetworkUnavailableError(f"{path} in netns {ns}: {result.stderr.strip()}")


_libc = ctypes.CDLL(None, use_errno=True)


def _listen_in_netns(ns: str, address: tuple[str, int]) -> socket.socket:
    """A listening TCP socket that lives in network namespace ``ns`` (the calling thread enters
    the namespace just long enough to create it; a socket keeps the namespace it was made in)."""
    result: dict[str, object] = {}

    def worker() -> None:
        with open("/proc/thread-self/ns/net") as own, open(NETNS_DIR / ns) as target:
            if _libc.setns(target.fileno(), _CLONE_NEWNET) != 0:
                result["error"] = OSError(ctypes.get_errno(), f"setns({ns})")
                return
            try:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(address)
                sock.listen(128)
                result["socket"] = sock
            except OSError as exc:
                result["error"] = exc
            finally:
                if _libc.setns(own.fileno(), _CLONE_NEWNET) != 0:  # pragma: no cover
                    result["error"] = OSError(ctypes.get_errno(), "setns back")

    # A throw-away thread: even a failed switch back cannot leave another thread in ``ns``.
    thread = threading.Thread(target=worker, name=f"netns-{ns}")
    thread.start()
    thread.join()
    if "error" in result:
        with contextlib.suppress(Exception):
            result["socket"].close()  # type: ignore[union-attr]
        raise result["error"]  # type: ignore[misc]
    return result["socket"]  # type: ignore[return-value]


class TcpRelay:
    """TCP relay from ``listen`` in the cluster netns to ``upstream`` on the host (bytes pass
    through unchanged: TLS, and request signatures that cover the Host header, still hold).
    When the upstream does not answer, the pod's connection is closed at once, as a Service
    without ready endpoints would refuse it."""

    def __init__(
        self,
        cluster_ns: str,
        listen: tuple[str, int],
        upstream: tuple[str, int],
        log: logging.Logger,
        *,
        name: str = "relay",
    ) -> None:
        self.listen = listen
        self.upstream = upstream
        self.name = name
        self.log = log
        self._listener = _listen_in_netns(cluster_ns, listen)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._accept, name=name, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.upstream, timeout=10)
                upstream.settimeout(None)
            except OSError as exc:
                self.log.warning("%s: upstream %s: %s", self.name, self.upstream, exc)
                client.close()
                continue
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(a, b), name=f"{self.name}-pump",
                                 daemon=True).start()  # fmt: skip

    def close(self) -> None:
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()


class ApiProxy(TcpRelay):
    """The relay from 10.0.0.1:443 in the cluster netns to the apiserver on the host's loopback,
    so pods find the apiserver where in-cluster clients look for it (TLS passes through)."""

    def __init__(self, cluster_ns: str, upstream_port: int, log: logging.Logger) -> None:
        super().__init__(
            cluster_ns,
            (KUBERNETES_SERVICE_IP, KUBERNETES_SERVICE_PORT),
            ("127.0.0.1", upstream_port),
            log,
            name="api-proxy",
        )


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            with contextlib.suppress(OSError):
                s.shutdown(how)
        # The second pump to finish closes both.
        with contextlib.suppress(OSError):
            if src.fileno() != -1 and _half_closed(src, dst):
                src.close()
                dst.close()


def _half_closed(a: socket.socket, b: socket.socket) -> bool:
    key = (min(id(a), id(b)), max(id(a), id(b)))
    with _PAIRS_LOCK:
        if key in _PAIRS:
            _PAIRS.discard(key)
            return True
        _PAIRS.add(key)
        return False


_PAIRS: set[tuple[int, int]] = set()
_PAIRS_LOCK = threading.Lock()
