"""The cluster admin's cap on grace periods (--max-grace-seconds, Helm operator.maxGraceSeconds)."""

from __future__ import annotations

import pytest

from preemptible_operator.grace import GraceDecision, cap_grace
from preemptible_operator.reconcile import jittered


@pytest.mark.parametrize(
    ("seconds", "cap", "expected", "capped"),
    [
        (86_400, 600, 600, True),  # a user's pinned day of grace: the admin's cap wins
        (243, 600, 243, False),
        (600, 600, 600, False),
        (86_400, None, 86_400, False),  # no cap configured
    ],
)
def test_cap_grace(seconds: int, cap: int | None, expected: int, capped: bool) -> None:
    decision = cap_grace(GraceDecision(seconds, None, "pinned", {}), cap)
    assert decision.seconds == expected
    assert ("capped at" in decision.reason) is capped


def test_jitter_stays_within_its_spread() -> None:
    values = [jittered(10.0) for _ in range(500)]
    assert all(8.0 <= v <= 12.0 for v in values)
    assert max(values) - min(values) > 1.0  # actually spread
