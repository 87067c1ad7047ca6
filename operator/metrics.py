"""The operator's own Prometheus metrics."""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge, Histogram

__all__ = [
    "API_REQUESTS",
    "ATTEMPT",
    "ATTEMPT_GRACE_SECONDS",
    "GRACE_SECONDS",
    "LOST_STEPS",
    "PREEMPTIONS",
    "QUEUE_WAIT_SECONDS",
    "RECONCILE_ERRORS",
    "RECONCILE_SECONDS",
    "REQUEUE_SECONDS",
    "SIGTERM_TO_EXIT_SECONDS",
    "forget_job",
    "start_metrics_server",
]

RECONCILE_SECONDS = Histogram(
    "preemptible_operator_reconcile_seconds",
    "Duration of one reconcile pass of a TrainingJob.",
)
RECONCILE_ERRORS = Counter(
    "preemptible_operator_reconcile_errors_total",
    "Reconcile passes that raised (retried on the next pass).",
)
# The counters of what a pass records (PREEMPTIONS, LOST_STEPS, and QUEUE_WAIT_SECONDS below) are
# updated by the reconciler only once the status write that records it succeeded
# (PassResult.on_written): a pass refused with a conflict (409) is redone and must not count twice.
PREEMPTIONS = Counter(
    "preemptible_operator_preemptions_total",
    "Attempts ended by a preemption, by reason.",
    ["reason"],
)
REQUEUE_SECONDS = Histogram(
    "preemptible_operator_requeue_seconds",
    "Seconds from an interrupted attempt's pods being gone to the next attempt's Job created.",
    buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
)
LOST_STEPS = Counter(
    "preemptible_operator_lost_steps_total",
    "Training steps computed but not held by any complete checkpoint.",
    ["namespace", "name"],
)
API_REQUESTS = Counter(
    "preemptible_operator_api_requests_total",
    "Kubernetes API requests made by the reconcile passes (kopf's own watches not included).",
    ["verb"],
)
GRACE_SECONDS = Gauge(
    "preemptible_operator_grace_seconds",
    "Grace period computed for the next attempt.",
    ["namespace", "name"],
)

# For the Grafana dashboard (charts/preemptible/dashboards/): attempts per job, queue wait, and
# grace given vs SIGTERM-to-exit of the latest ended attempt, side by side.
ATTEMPT = Gauge(
    "preemptible_operator_attempt",
    "Current (latest) attempt number of a TrainingJob.",
    ["namespace", "name"],
)
QUEUE_WAIT_SECONDS = Histogram(
    "preemptible_operator_queue_wait_seconds",
    "Seconds from an attempt's Job created to its pods first seen running (Kueue admission and "
    "scheduling).",
    buckets=(1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600),
)
SIGTERM_TO_EXIT_SECONDS = Gauge(
    "preemptible_operator_sigterm_to_exit_seconds",
    "SIGTERM-to-exit seconds of the latest ended attempt that reported one.",
    ["namespace", "name"],
)
ATTEMPT_GRACE_SECONDS = Gauge(
    "preemptible_operator_attempt_grace_seconds",
    "terminationGracePeriodSeconds the latest ended attempt was given.",
    ["namespace", "name"],
)

POLL_INTERVAL_SECONDS = Gauge(
    "preemptible_operator_poll_interval_seconds",
    "Seconds between one running job's periodic passes now (--poll-interval, longer when the "
    "running jobs together would exceed --max-scrapes-per-second).",
)


def forget_job(namespace: str, name: str) -> None:
    """Remove the per-job series of a finished or deleted TrainingJob (an operator that runs
    thousands of jobs must not export a series for every job it ever saw)."""
    for family in (
        LOST_STEPS,
        GRACE_SECONDS,
        ATTEMPT,
        SIGTERM_TO_EXIT_SECONDS,
        ATTEMPT_GRACE_SECONDS,
    ):
        with contextlib.suppress(KeyError):
            family.remove(namespace, name)


def start_metrics_server(port: int, addr: str = "0.0.0.0") -> None:
    """Serve /metrics on ``addr:port`` (0 disables)."""
    if port:
        from prometheus_client import start_http_server

        start_http_server(port, addr=addr)
