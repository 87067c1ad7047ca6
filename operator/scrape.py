"""Read the rank-0 pod's /metrics (the runtime's progress and timings)."""

from __future__ import annotations

import http.client
import time
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from trainer_runtime.protocol import METRIC_NAMES

__all__ = ["MAX_BODY_BYTES", "RuntimeMetrics", "parse_metrics", "scrape"]


@dataclass(frozen=True)
class RuntimeMetrics:
    """The runtime's gauges by protocol key (``step``, ``step_seconds_max``, ...); NaN dropped."""

    values: dict[str, float]

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
            if key is not None and sample.value == sample.value:  # NaN != NaN
                values[key] = float(sample.value)
    return RuntimeMetrics(values)


MAX_BODY_BYTES = 256 * 1024
"""The runtime's /metrics is a few kB; more is not ours (or is hostile): stop reading."""


def scrape(
    host: str, port: int, timeout: float = 2.0, max_bytes: int = MAX_BODY_BYTES
) -> RuntimeMetrics | None:
    """GET http://host:port/metrics within ``timeout`` seconds in total (connect, headers and
    body together, however slowly the pod sends) and at most ``max_bytes`` of body; None when
    the pod does not answer in time (not started, gone, too slow, too large)."""
    deadline = time.monotonic() + timeout
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", "/metrics", headers={"Accept": "text/plain"})
        sock = conn.sock
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        resp = conn.getresponse()
        if resp.status != 200:
            return None
        length = resp.getheader("Content-Length")
        if length is not None and length.isdigit() and int(length) > max_bytes:
            return None
        chunks: list[bytes] = []
        size = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if resp.isclosed():
                break
            sock.settimeout(left)
            chunk = resp.read1(65536)
            if not chunk:
                break
            size += len(chunk)
            if size > max_bytes:
                return None
            chunks.append(chunk)
        text = b"".join(chunks).decode("utf-8", errors="replace")
    except (OSError, http.client.HTTPException, ValueError, AttributeError):
        return None
    finally:
        conn.close()
    try:
        return parse_metrics(text)
    except ValueError:
        return None
