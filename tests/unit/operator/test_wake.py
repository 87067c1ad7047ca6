"""When the next pass is due (wake.py)."""

from __future__ import annotations

import pytest

from preemptible_operator.wake import deadline_wake, wake_after

T0 = 1_780_000_000.0  # 2026-05-28T20:26:40Z
T0_RFC = "2026-05-28T20:26:40Z"


WAKES = [
    # (id, phase, completed at, ttl, due, has pods, expected wake)
    (
        "ttl-passed",
        "Succeeded",
        "2026-05-28T20:00:00Z",
        60,
        None,
        False,
        (True, True, None, False, False),
    ),
    (
        "ttl-ahead",
        "Failed",
        "2026-05-28T20:26:00Z",
        60,
        None,
        False,
        (False, False, 20.0, False, False),
    ),
    (
        "ttl-ahead-sooner-due",
        "Failed",
        "2026-05-28T20:26:00Z",
        60,
        1.0,
        False,
        (False, False, 1.0, False, False),
    ),
    ("terminal-no-ttl", "Succeeded", T0_RFC, None, None, False, (False, True, None, False, False)),
    (
        "terminal-releasing",
        "Succeeded",
        T0_RFC,
        None,
        1.0,
        False,
        (False, False, 1.0, False, False),
    ),
    ("running-periodic-busy", "Running", None, None, None, True, (False, False, None, True, True)),
    ("queued-periodic-idle", "Queued", None, None, None, False, (False, False, None, True, False)),
    (
        "suspended-with-pods-idle",
        "Suspended",
        None,
        None,
        None,
        True,
        (False, False, None, True, False),
    ),
    ("due-given", "Pending", None, None, 0.0, True, (False, False, 0.0, False, False)),
]


@pytest.mark.parametrize(
    ("phase", "completed", "ttl", "due", "has_pods", "expected"),
    [c[1:] for c in WAKES],
    ids=[c[0] for c in WAKES],
)
def test_wake_after(
    phase: str,
    completed: str | None,
    ttl: int | None,
    due: float | None,
    has_pods: bool,
    expected: tuple[bool, bool, float | None, bool, bool],
) -> None:
    wake = wake_after(phase, completed, ttl, due, has_pods, T0)
    got = (wake.delete, wake.done, wake.requeue_after, wake.periodic, wake.busy)
    assert got == (
        expected[0],
        expected[1],
        pytest.approx(expected[2]) if expected[2] is not None else None,
        expected[3],
        expected[4],
    )


@pytest.mark.parametrize(
    ("due", "phase", "left", "expected"),
    [
        (None, "Pending", None, None),
        (None, "Queued", 100.0, 100.5),
        (5.0, "Running", 100.0, 5.0),
        (None, "Running", -30.0, 0.5),
        (None, "Failed", 100.0, None),
        (3.0, "Succeeded", -1.0, 3.0),
    ],
    ids=["no-deadline", "queued-wakes-at-it", "sooner-due", "passed", "terminal", "terminal-due"],
)
def test_deadline_wake(
    due: float | None, phase: str, left: float | None, expected: float | None
) -> None:
    assert deadline_wake(due, phase, left) == expected
