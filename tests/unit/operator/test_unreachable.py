"""Condition NodeUnreachable of a pass (unreachable.unreachable_condition)."""

from __future__ import annotations

from typing import Any

import pytest

from preemptible_operator import conditions as conds
from preemptible_operator.conditions import Reason
from preemptible_operator.unreachable import unreachable_condition
from tests.unit.operator.builders import make_pod, make_snapshot, make_spec

T0 = 1_780_000_000.0  # 2026-05-28T20:26:40Z
T0_RFC = "2026-05-28T20:26:40Z"


def _conditions(ctype: str, status: str, reason: str = "", message: str = "") -> Any:
    return conds.set_condition(None, ctype, status, reason, message, "2026-05-28T20:00:00Z", 1)  # type: ignore[arg-type]


NOT_READY_SINCE = T0 - 1000


UNREACHABLE = [
    # (id, pods, node ready, recorded, conditions before, status after, event)
    ("stuck-past-bound", [make_pod()], {"node-1": False}, False, None, "True", True),
    (
        "still-stuck",
        [make_pod()],
        {"node-1": False},
        False,
        _conditions(conds.NODE_UNREACHABLE, "True", Reason.OUT_OF_SERVICE_NEEDED),
        "True",
        False,
    ),
    (
        "recorded-clears",
        [make_pod()],
        {"node-1": False},
        True,
        _conditions(conds.NODE_UNREACHABLE, "True", Reason.OUT_OF_SERVICE_NEEDED),
        "False",
        False,
    ),
    (
        "node-back",
        [make_pod()],
        {"node-1": True},
        False,
        _conditions(conds.NODE_UNREACHABLE, "True", Reason.OUT_OF_SERVICE_NEEDED),
        "False",
        False,
    ),
    ("never-stuck", [make_pod()], {"node-1": True}, False, None, None, False),
]


@pytest.mark.parametrize(
    ("pods", "ready", "recorded", "before", "after", "event"),
    [c[1:] for c in UNREACHABLE],
    ids=[c[0] for c in UNREACHABLE],
)
def test_unreachable_condition(
    pods: list[dict[str, Any]],
    ready: dict[str, bool],
    recorded: bool,
    before: Any,
    after: str | None,
    event: bool,
) -> None:
    spec = make_spec(unreachableNode={"escalateAfterSeconds": 600})
    since = {n: NOT_READY_SINCE for n, ok in ready.items() if not ok}
    snap = make_snapshot(
        spec=spec, attempt=1, pods=pods, node_ready=ready, node_not_ready_since=since
    )
    got, ev = unreachable_condition(snap, spec, before, recorded, T0_RFC, 1, T0)
    found = conds.find_condition(got, conds.NODE_UNREACHABLE)
    assert (found.status if found else None) == after
    assert (ev is not None and ev[:2] == ("Warning", Reason.OUT_OF_SERVICE_NEEDED)) is event
