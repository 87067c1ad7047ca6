"""Starting and stopping the control-plane processes: free ports, log files, readiness polling,
and stopping by PID (SIGTERM, wait, SIGKILL) so nothing outlives the tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

__all__ = ["ManagedProcess", "free_port", "http_ok", "tail", "wait_until"]


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel just handed out; racy in theory, fine for loopback test servers."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def tail(path: Path, lines: int = 30) -> str:
    try:
        content = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"
    return "\n".join(content[-lines:])


class ManagedProcess:
    """One long-running component with its output in ``log``; ``stop()`` is idempotent."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log: Path,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            out.write(f"$ {' '.join(self.argv)}\n".encode())
            out.flush()
            self.popen = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                # Own session: a Ctrl-C in the terminal reaches us, not the components directly,
                # so shutdown happens in order.
                start_new_session=True,
            )
        self.pid = self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def check_alive(self) -> None:
        if not self.alive():
            raise RuntimeError(
                f"{self.name} exited with code {self.popen.returncode}; "
                f"log {self.log}:\n{tail(self.log)}"
            )

    def stop(self, timeout: float = 15.0) -> None:
        if self.popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self.popen.wait(10)


def wait_until(
    what: str,
    predicate: Callable[[], bool],
    *,
    timeout: float,
    interval: float = 0.25,
    check: Callable[[], None] | None = None,
) -> None:
    """Poll ``predicate`` until true; ``check`` raises early (e.g. the process died)."""
    deadline = time.monotonic() + timeout
    while True:
        if check is not None:
            check()
        try:
            if predicate():
                return
        except Exception:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def http_ok(
    url: str,
    *,
    ca: Path | None = None,
    cert: tuple[Path, Path] | None = None,
    insecure: bool = False,
    timeout: float = 5.0,
) -> bool:
    """True iff GET ``url`` answers 200."""
    context: ssl.SSLContext | None = None
    if url.startswith("https://"):
        context = ssl.create_default_context(cafile=str(ca) if ca else None)
        if insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if cert:
            context.load_cert_chain(str(cert[0]), str(cert[1]))
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False
