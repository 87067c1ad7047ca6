"""Read the rank-0 pod's /metrics (the runtime's progress and timings)."""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from trainer_runtime.protocol import METRIC_NAMES

__all__ = ["RuntimeMetrics", "parse_metrics", "scrape"]


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


def scrape(host: str, port: int, timeout: float = 2.0) -> RuntimeMetrics | None:
    """GET http://host:port/metrics; None when the pod does not answer (not started, gone)."""
    url = f"http://{host}:{port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            text = resp.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError, ValueError):
        return None
    try:
        return parse_metrics(text)
    except ValueError:
        return None
