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
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from .processes import ManagedProcess, free_port, tail, wait_until

__all__ = ["S3Server"]

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
