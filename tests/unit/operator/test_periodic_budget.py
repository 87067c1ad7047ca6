"""Each running job's periodic work (scrapes, progress-only status writes) shares one budget."""

from __future__ import annotations

import kubernetes
import pytest

from preemptible_operator import metrics
from preemptible_operator.budget import periodic_delay, spread_interval
from preemptible_operator.reconcile import OperatorConfig, Reconciler


@pytest.mark.parametrize(
    ("base", "jobs", "per_second", "expected"),
    [
        (5.0, 0, 20.0, 5.0),  # nothing running
        (5.0, 1, 20.0, 5.0),
        (5.0, 100, 20.0, 5.0),  # exactly at the budget
        (5.0, 101, 20.0, 5.05),
        (5.0, 500, 20.0, 25.0),
        (15.0, 500, 10.0, 50.0),
        (5.0, 10_000, 20.0, 500.0),
        (5.0, 500, 0.0, 5.0),  # no budget
        (0.5, 3, 20.0, 0.5),  # tests' short intervals stay as they are
    ],
)
def test_spread_interval(base: float, jobs: int, per_second: float, expected: float) -> None:
    assert spread_interval(base, jobs, per_second) == pytest.approx(expected)


def _reconciler(**config: float) -> Reconciler:
    return Reconciler(kubernetes.client.ApiClient(), OperatorConfig(**config))


@pytest.mark.parametrize(
    ("polled", "config", "expected"),
    [
        (10, {}, (5.0, 15.0)),
        (500, {}, (25.0, 50.0)),
        (500, {"max_scrapes_per_second": 0, "max_progress_writes_per_second": 0}, (5.0, 15.0)),
        (500, {"max_scrapes_per_second": 100.0, "poll_interval": 1.0}, (5.0, 50.0)),
    ],
)
def test_the_reconciler_shares_the_budget_among_polled_jobs(
    polled: int, config: dict[str, float], expected: tuple[float, float]
) -> None:
    r = _reconciler(**config)
    r._polled = {("ns", f"j{i}") for i in range(polled)}
    assert r.periodic_intervals() == pytest.approx(expected)
    assert metrics.POLL_INTERVAL_SECONDS._value.get() == pytest.approx(expected[0])
    r.forget("ns", "j0")
    assert len(r._polled) == polled - 1


@pytest.mark.parametrize(
    ("phase", "busy", "expected"),
    [
        ("Running", True, 5.0),  # scrapes, pods on a node that may be lost
        ("Checkpointing", True, 5.0),
        ("Pending", True, 5.0),  # pods exist: one may sit on a lost node
        ("Queued", False, None),  # Kueue's admission and evictions come as watch events
        ("Pending", False, 300.0),  # the safety net
        ("Suspended", False, 300.0),
        (None, False, 300.0),
    ],
)
def test_periodic_delay(phase: str | None, busy: bool, expected: float | None) -> None:
    assert periodic_delay(phase, busy, 5.0, 300.0) == expected
