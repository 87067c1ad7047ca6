"""The tier's S3-compatible object store: versitygw (an S3 gateway over a POSIX directory, built by
``tests/cluster/build.sh``) on the host's loopback, with random root credentials.

Each subdirectory of ``data_dir`` is a bucket. The server runs on its own for the runtime tests
(the ``s3_server`` fixture) and with the control plane, where the node agent relays it into the pod
network (``NodeAgent.expose_host_port``) so that pods reach it at ``pod_endpoint``.

Faults are real: ``kill()`` SIGKILLs the server (connections reset, in-flight uploads lost),
``restart()`` starts it again on the same port and data, a bucket can be made read-only or full
with a real mount (``read_only_bucket``, ``full_bucket``).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from .processes import ManagedProcess, free_port, tail, wait_until

__all__ = ["FaultyLink", "S3Server"]

# versitygw's default region; botocore signs for it.
REGION = "us-east-1"


def _port_open(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


class S3Server:
    """``start()``, then always ``stop()``. ``endpoint`` is for clients on the host,
    ``pod_endpoint`` (set by whoever relays it into the pod network) for pods."""

    def __init__(self, binary: Path, workdir: Path, *, port: int | None = None) -> None:
        self.binary = binary
        self.workdir = workdir
        self.data_dir = workdir / "data"
        self.log = workdir / "versitygw.log"
        self.port = port or free_port()
        self.access_key = f"pe{secrets.token_hex(8)}"
        self.secret_key = secrets.token_urlsafe(30)
        self.process: ManagedProcess | None = None
        self.pod_endpoint: str | None = None
        self.started_seconds: float | None = None
        self._mounts: list[Path] = []

    # ------------------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 60.0) -> None:
        t0 = time.monotonic()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "ROOT_ACCESS_KEY": self.access_key,
            "ROOT_SECRET_KEY": self.secret_key,
        }
        argv = [str(self.binary), "--port", f"127.0.0.1:{self.port}", "--quiet", "posix"]
        self.process = ManagedProcess("versitygw", [*argv, str(self.data_dir)], self.log, env=env)
        wait_until(
            f"versitygw on 127.0.0.1:{self.port}",
            lambda: _port_open(self.port),
            timeout=timeout,
            interval=0.05,
            check=self.process.check_alive,
        )
        self.started_seconds = time.monotonic() - t0

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-request, as a crashed or partitioned server does."""
        if self.process is not None and self.process.alive():
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.popen.wait(10)

    def restart(self) -> None:
        """Start again on the same port with the same data (after ``kill`` or ``stop``)."""
        if self.process is not None and self.process.alive():
            self.process.stop()
        self.start()

    def stop(self) -> None:
        for mount in reversed(self._mounts):
            subprocess.run(["umount", "-l", str(mount)], capture_output=True, check=False)
        self._mounts.clear()
        if self.process is not None:
            self.process.stop()

    def check_alive(self) -> None:
        if self.process is None or not self.process.alive():
            raise RuntimeError(f"versitygw is not running; log {self.log}:\n{tail(self.log)}")

    # -------------------------------------------------------------------------------- clients
    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client_env(self, *, pod: bool = False) -> dict[str, str]:
        """The variables an S3 client (botocore, s3fs, the AWS CLI) reads: what a Secret given
        to a pod with ``envFrom`` holds."""
        if pod and self.pod_endpoint is None:
            raise RuntimeError("the S3 server is not relayed into a pod network")
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": f"http://{self.pod_endpoint}" if pod else self.endpoint,
            "AWS_DEFAULT_REGION": REGION,
        }

    def storage_options(self) -> dict[str, object]:
        """fsspec/s3fs options for a client on the host (no environment needed)."""
        return {
            "key": self.access_key,
            "secret": self.secret_key,
            "endpoint_url": self.endpoint,
            "client_kwargs": {"region_name": REGION},
        }

    # -------------------------------------------------------------------------------- buckets
    def create_bucket(self, name: str) -> str:
        """A new, empty bucket (a directory of the posix backend); returns its name."""
        (self.data_dir / name).mkdir()
        return name

    def bucket_dir(self, name: str) -> Path:
        return self.data_dir / name

    @contextlib.contextmanager
    def read_only_bucket(self, name: str) -> Iterator[None]:
        """The bucket's storage becomes read-only (a read-only bind mount over its directory):
        every write is refused by the server, reads still work."""
        path = self.bucket_dir(name)
        self._mount("--bind", str(path), str(path))
        self._mount("-o", "remount,bind,ro", str(path), str(path), register=False)
        try:
            yield
        finally:
            self._umount(path)

    @contextlib.contextmanager
    def full_bucket(self, name: str, size_bytes: int) -> Iterator[None]:
        """The bucket's storage is a tmpfs of ``size_bytes`` (its current objects are copied
        in): writes beyond that fail with ENOSPC on the server, as on a full volume."""
        path = self.bucket_dir(name)
        saved = self.workdir / f".{name}.before-full"
        subprocess.run(["cp", "-a", str(path), str(saved)], check=True, capture_output=True)
        self._mount("-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path))
        subprocess.run(["cp", "-a", f"{saved}/.", str(path)], check=True, capture_output=True)
        try:
            yield
        finally:
            # what was written meanwhile goes back to the real directory
            subprocess.run(["cp", "-a", f"{path}/.", str(saved)], check=False, capture_output=True)
            self._umount(path)
            subprocess.run(["rm", "-rf", str(path)], check=False, capture_output=True)
            os.rename(saved, path)

    def _mount(self, *args: str, register: bool = True) -> None:
        result = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)
        if result.returncode != 0:
            raise RuntimeError(f"mount {' '.join(args)}: {result.stderr.strip()}")
        if register:
            self._mounts.append(Path(args[-1]))

    def _umount(self, path: Path) -> None:
        subprocess.run(["umount", str(path)], capture_output=True, check=False, timeout=30)
        with contextlib.suppress(ValueError):
            self._mounts.remove(path)


_REQUEST_LINE = re.compile(rb"(?:GET|PUT|POST|HEAD|DELETE) /[^ \r\n]* HTTP/1\.[01]\r\n")


class _Connection:
    """What the two directions of one relayed connection share."""

    def __init__(self) -> None:
        self.tail = b""
        self.dropping: bytes | None = None
        self.held = b""


class FaultyLink:
    """A TCP path from clients on the host to the S3 server that a test can slow down and cut:
    ``endpoint`` is what the client uses instead of the server's.

    - ``rate`` (bytes/s, both directions together): uploads take as long as on a slow network,
      so a fault can be aimed into one;
    - ``bytes_up``: bytes forwarded from clients to the server so far (a test waits for an upload
      to be under way);
    - ``cut()``: the network goes: the bytes of open connections stop flowing (the client waits
      until its read timeout) and new connections are refused; ``restore()`` ends the stalled
      connections and accepts new ones again;
    - ``drop_response_once(request)``: the next request whose request line contains ``request``
      (e.g. ``b"PUT /bucket/run/checkpoint-5/manifest.json"``) reaches the server, which does
      it, but its response never reaches the client: the connection closes instead (interim
      ``1xx`` answers still go through). The client sees a lost response and retries.
      ``dropped`` lists the request lines whose responses were dropped; ``requests`` every
      request line forwarded.
    """

    def __init__(self, upstream_port: int, *, rate: float | None = None) -> None:
        self.upstream_port = upstream_port
        self.rate = rate
        self.port = free_port()
        self.bytes_up = 0
        self._cut = threading.Event()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._budget = 0.0
        self._budget_at = time.monotonic()
        self._sockets: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self._drop: bytes | None = None
        self.dropped: list[bytes] = []
        self.requests: list[bytes] = []
        self._listen()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _listen(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
            except OSError:
                client.close()  # the server is gone: refused, as a dead endpoint is
                continue
            with self._lock:
                self._sockets += [client, upstream]
            conn = _Connection()
            for src, dst, up in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pump, args=(src, dst, up, conn), daemon=True).start()

    def drop_response_once(self, request: bytes) -> None:
        with self._lock:
            self._drop = request

    def _wait_for_budget(self, n: int) -> None:
        if self.rate is None:
            return
        while True:
            with self._lock:
                now = time.monotonic()
                self._budget = min(self.rate, self._budget + (now - self._budget_at) * self.rate)
                self._budget_at = now
                if self._budget >= n or self._budget >= self.rate:
                    self._budget -= n
                    return
                wait = (n - self._budget) / self.rate
            time.sleep(min(wait, 0.05))

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool, conn: _Connection) -> None:
        try:
            while True:
                data = src.recv(64 << 10)
                if not data:
                    break
                while self._cut.is_set() and not self._stopping.is_set():
                    time.sleep(0.05)  # the packets are lost; the sender waits for its timeout
                self._wait_for_budget(len(data))
                if up:
                    self._watch_requests(data, conn)
                elif conn.dropping is not None:
                    if not self._drop_response(data, conn, dst):
                        break  # the final response came: dropped, the connection ends
                    continue
                dst.sendall(data)
                if up:
                    with self._lock:
                        self.bytes_up += len(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def _watch_requests(self, data: bytes, conn: _Connection) -> None:
        """Request lines in the bytes a client sends (a window keeps one split across reads);
        marks the connection when one is the request whose response is to be dropped."""
        window = conn.tail + data
        for match in _REQUEST_LINE.finditer(window):
            if match.end() <= len(conn.tail):
                continue  # seen in the previous read already
            line = match.group(0).rstrip()
            with self._lock:
                self.requests.append(line)
                if self._drop is not None and self._drop in line:
                    self._drop = None
                    conn.dropping = line  # set before the request reaches the server
        conn.tail = window[-512:]

    def _drop_response(self, data: bytes, conn: _Connection, client: socket.socket) -> bool:
        """Hold back the server's answer to the marked request: interim 1xx answers go to the
        client; the final one does not. False once it came (the caller ends the connection)."""
        conn.held += data
        while conn.held.startswith(b"HTTP/1.1 1") and b"\r\n\r\n" in conn.held:
            end = conn.held.index(b"\r\n\r\n") + 4
            client.sendall(conn.held[:end])
            conn.held = conn.held[end:]
        if conn.held.startswith(b"HTTP/") and not conn.held.startswith(b"HTTP/1.1 1"):
            with self._lock:
                self.dropped.append(conn.dropping or b"")
            return False
        return True

    def cut(self) -> None:
        self._cut.set()
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def restore(self) -> None:
        with self._lock:
            stalled, self._sockets = self._sockets, []
        for sock in stalled:
            with contextlib.suppress(OSError):
                sock.close()
        self._cut.clear()
        if self._listener is None:
            self._listen()

    def close(self) -> None:
        self._stopping.set()
        self._cut.clear()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.close()
            self._sockets.clear()
