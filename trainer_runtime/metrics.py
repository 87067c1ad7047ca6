"""Prometheus /metrics of a training process (progress, step/save timings, checkpoint state).

Served only when $PREEMPTIBLE_METRICS_PORT is set, from a registry of its own (so several Trainers
in one process, or the default process collectors, never clash).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from trainer_runtime.protocol import (
    ENV_METRICS_HOST,
    ENV_METRICS_PORT,
    METRIC_NAMES,
    local_rank_from_env,
)

__all__ = ["RUNTIME_METRIC_NAMES", "TrainingMetrics", "metrics_from_env"]

logger = logging.getLogger(__name__)

_HELP = {
    "step": "Global optimizer step reached.",
    "max_steps": "Total optimizer steps of the run.",
    "epoch": "Fractional epoch reached.",
    "step_seconds_last": "Wall seconds of the last optimizer step.",
    "step_seconds_ema": "Exponential moving average of optimizer step wall seconds.",
    "step_seconds_p99": "99th percentile of optimizer step wall seconds.",
    "step_seconds_max": "Longest optimizer step in wall seconds.",
    "save_seconds_last": "Wall seconds of the last checkpoint save.",
    "save_seconds_max": "Longest checkpoint save in wall seconds.",
    "micro_batch_seconds_max": "Longest mean micro-batch wall seconds of a step (gradient "
    "accumulation; 0: not measured).",
    "last_complete_checkpoint_step": "Global step of the newest complete checkpoint (-1: none).",
    "stop_requested": "1 once SIGTERM was received, else 0.",
    "pinned_staging_bytes": "Host memory this process holds for save_async snapshots, in bytes "
    "(kept between saves, pinned ahead of one, or held by a write in flight).",
    "pinned_staging_kept": "1 when save_async snapshot memory is kept pinned between saves, "
    "else 0 (pinned ahead of each save or at it, given back after the write).",
    "snapshot_stall_seconds_last": "Wall seconds training stalled for the last save_async "
    "snapshot.",
}

# Served for people and dashboards only; the operator scrapes METRIC_NAMES (protocol.py).
RUNTIME_METRIC_NAMES = {
    "pinned_staging_bytes": "preemptible_pinned_staging_bytes",
    "pinned_staging_kept": "preemptible_pinned_staging_kept",
    "snapshot_stall_seconds_last": "preemptible_snapshot_stall_seconds_last",
}


class TrainingMetrics:
    """Gauges named by protocol.METRIC_NAMES in their own registry; ``serve`` starts the server."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.gauges: dict[str, Gauge] = {
            key: Gauge(name, _HELP.get(key, key), registry=self.registry)
            for key, name in {**METRIC_NAMES, **RUNTIME_METRIC_NAMES}.items()
        }
        self.gauges["last_complete_checkpoint_step"].set(-1)
        self._server: Any = None
        self._thread: Any = None
        self.port: int | None = None

    def serve(self, port: int, host: str = "") -> None:
        """Start the HTTP server (a daemon thread) on ``host:port``; ``port`` 0 picks a free one."""
        result = start_http_server(port, addr=host or "0.0.0.0", registry=self.registry)
        # prometheus_client >= 0.19 returns (server, thread); keep them to shut down cleanly.
        if isinstance(result, tuple):
            self._server, self._thread = result
            self.port = self._server.server_address[1]
        else:
            self.port = port
        logger.info("serving /metrics on %s:%s", host or "0.0.0.0", self.port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def set(self, key: str, value: float | None) -> None:
        if value is not None:
            self.gauges[key].set(float(value))

    def update(
        self,
        *,
        step: int | None = None,
        max_steps: int | None = None,
        epoch: float | None = None,
        step_seconds: Any = None,
        save_seconds: Any = None,
        last_complete_checkpoint_step: int | None = None,
        stop_requested: bool | None = None,
        micro_batch_seconds: Any = None,
    ) -> None:
        """Set whichever values are given (StepTimings/SaveTimings models for the timings)."""
        self.set("step", step)
        self.set("max_steps", max_steps)
        self.set("epoch", epoch)
        if step_seconds is not None:
            self.set("step_seconds_last", step_seconds.last)
            self.set("step_seconds_ema", step_seconds.ema)
            self.set("step_seconds_p99", step_seconds.p99)
            self.set("step_seconds_max", step_seconds.max)
        if save_seconds is not None:
            self.set("save_seconds_last", save_seconds.last)
            self.set("save_seconds_max", save_seconds.max)
        if micro_batch_seconds is not None:
            self.set("micro_batch_seconds_max", micro_batch_seconds.max)
        self.set("last_complete_checkpoint_step", last_complete_checkpoint_step)
        if stop_requested is not None:
            self.set("stop_requested", 1 if stop_requested else 0)


def metrics_from_env() -> TrainingMetrics | None:
    """A served TrainingMetrics when $PREEMPTIBLE_METRICS_PORT is set and this is the pod's main
    process (local rank 0), else None.

    A port that cannot be bound is logged, not fatal: training matters more than its metrics.
    """
    raw = os.environ.get(ENV_METRICS_PORT, "").strip()
    if not raw:
        return None
    if local_rank_from_env(os.environ) != 0:
        # One /metrics per pod, on the one port the pod declares: torchrun (and our launcher)
        # start several workers with the same environment, and only local rank 0 serves it
        # (the others would fail to bind, and whichever bound first would be scraped).
        return None
    try:
        port = int(raw)
        if not 0 <= port <= 65535:
            raise ValueError(raw)
    except ValueError:
        logger.error("%s=%r is not a TCP port: /metrics not served", ENV_METRICS_PORT, raw)
        return None
    metrics = TrainingMetrics()
    try:
        metrics.serve(port, os.environ.get(ENV_METRICS_HOST, "").strip())
    except OSError as exc:
        logger.error("cannot serve /metrics on port %s: %s", port, exc)
        return None
    return metrics
