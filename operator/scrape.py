"""Read the rank-0 pod's /metrics (the runtime's progress and timings)."""

from __future__ import annotations

import dataclasses
import http.client
import io
import math
import socket
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from trainer_runtime.protocol import METRIC_NAMES

__all__ = ["MAX_BODY_BYTES", "RuntimeMetrics", "parse_metrics", "scrape"]


@dataclass(frozen=True)
class RuntimeMetrics:
    """The runtime's gauges by protocol key (``step``, ``step_seconds_max``, ...); NaN and
    infinities dropped."""

    values: dict[str, float]
    scraped_at: float | None = None
    """When the body was read (seconds since the epoch): the time of ``step`` (the lost-steps
    estimate extrapolates from it, accounting.estimated_end_step)."""
    answered: bool = True
    """False: the pod did not answer (``values`` empty; ``scraped_at`` is when it was asked). A
    rank 0 that stops answering is an upper bound of when it stopped training (a lost node)."""

    @classmethod
    def unanswered(cls, asked_at: float) -> RuntimeMetrics:
        """A scrape started at ``asked_at`` that got no (usable) answer."""
        return cls({}, scraped_at=asked_at, answered=False)

    def get(self, key: str) -> float | None:
        return self.values.get(key)

    def int(self, key: str) -> int | None:
        value = self.values.get(key)
        return int(value) if value is not None else None


def parse_metrics(text: str) -> RuntimeMetrics:
    """Parse Prometheus text exposition; keeps only the series named in protocol.METRIC_NAMES."""
    by_series = {series: key for key, series in METRIC_NAMES.items()}
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = by_series.get(sample.name)
            # A NaN or an infinity (a runtime's bug, or not ours) is no measurement: int(inf)
            # would raise in every periodic pass of the job.
            if key is not None and math.isfinite(sample.value):
                values[key] = float(sample.value)
    return RuntimeMetrics(values)


MAX_BODY_BYTES = 256 * 1024
"""The runtime's /metrics is a few kB; more is not ours (or is hostile): stop reading."""


class _DeadlineReader(io.RawIOBase):
    """The socket's reads, each given only the time left to the deadline: a pod that sends one
    byte at a time cannot stretch the whole (status line, headers, body) past it."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        # The socket's own file object: it keeps the socket open until the response is read,
        # as http.client expects (it closes the connection before reading a closing body).
        self._raw = sock.makefile("rb", buffering=0)
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int | None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("scrape deadline passed")
        self._sock.settimeout(left)
        return self._raw.readinto(buffer)

    def close(self) -> None:
        self._raw.close()
        super().close()


class _DeadlineSocket:
    """What http.client uses of a socket (sendall, makefile, close), bounded by one deadline."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline

    def sendall(self, data: bytes) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("scrape deadline passed")
        self._sock.settimeout(left)  # sendall's timeout bounds the whole call
        self._sock.sendall(data)

    def makefile(self, mode: str = "rb", *args: Any, **kwargs: Any) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))

    def close(self) -> None:
        self._sock.close()


class _DeadlineConnection(http.client.HTTPConnection):
    """An HTTP connection whose connect, request and every read of the response share one
    deadline (http.client's own timeout applies to each socket operation anew)."""

    def __init__(self, host: str, port: int, deadline: float) -> None:
        super().__init__(host, port)
        self._deadline = deadline

    def connect(self) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("scrape deadline passed")
        sock = socket.create_connection((self.host, self.port), timeout=left)
        self.sock = _DeadlineSocket(sock, self._deadline)  # type: ignore[assignment]


def scrape(
    host: str, port: int, timeout: float = 2.0, max_bytes: int = MAX_BODY_BYTES
) -> RuntimeMetrics | None:
    """GET http://host:port/metrics within ``timeout`` seconds in total (connect, status line,
    headers and body together, however slowly the pod sends) and at most ``max_bytes`` of body;
    None when the pod does not answer in time (not started, gone, too slow, too large)."""
    conn = _DeadlineConnection(host, port, time.monotonic() + timeout)
    try:
        conn.request("GET", "/metrics", headers={"Accept": "text/plain"})
        resp = conn.getresponse()
        if resp.status != 200:
            return None
        length = resp.getheader("Content-Length")
        if length is not None and length.isdigit() and int(length) > max_bytes:
            return None
        chunks: list[bytes] = []
        size = 0
        while not resp.isclosed():
            chunk = resp.read1(65536)
            if not chunk:
                break
            size += len(chunk)
            if size > max_bytes:
                return None
            chunks.append(chunk)
        text = b"".join(chunks).decode("utf-8", errors="replace")
        scraped_at = time.time()
    except (OSError, http.client.HTTPException, ValueError, AttributeError):
        return None
    finally:
        conn.close()
    try:
        return dataclasses.replace(parse_metrics(text), scraped_at=scraped_at)
    except ValueError:
        return None
