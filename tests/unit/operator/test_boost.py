"""The priority-boost policy of a pass (operator/boost.py, issue 39): when the running
attempt's Workload gets a boost, which one, and when it is written."""

from __future__ import annotations

from typing import Any

import pytest

from preemptible_operator import models
from preemptible_operator.boost import boost_patch, plan_boost
from preemptible_operator.victims import BOOST_ANNOTATION
from tests.unit.operator.builders import make_spec

T0 = 1_800_000_000.0
RUN_START = "2027-01-15T08:00:00Z"  # = T0


def _workload(
    *, admitted: bool = True, active: bool | None = None, boost: str | None = None, priority=100
) -> dict[str, Any]:
    spec: dict[str, Any] = {"priority": priority}
    if active is not None:
        spec["active"] = active
    meta: dict[str, Any] = {"name": "wl", "namespace": "ns", "uid": "wl-1"}
    if boost is not None:
        meta["annotations"] = {BOOST_ANNOTATION: boost}
    conditions = [{"type": "Admitted", "status": "True"}] if admitted else []
    return {"metadata": meta, "spec": spec, "status": {"conditions": conditions}}


def _status(progress: dict[str, Any] | None) -> models.TrainingJobStatus:
    return models.TrainingJobStatus.model_validate(
        {
            "progress": progress,
            "timings": {"stepSecondsEma": 2.0, "stepSecondsMax": 2.0, "saveSecondsMax": 20.0},
            "gracePeriod": {"current": 60},
        }
    )


RECORD = models.AttemptRecord(attempt=2, job_name="tj-a2", running_time=RUN_START, start_step=0)
SPEC = make_spec(preemption={"minRunSeconds": 300})
SEEN = {"step": 100, "attempt": 2}  # /metrics scraped for this attempt, no checkpoint yet


@pytest.mark.parametrize(
    ("workload", "record", "progress", "ran", "values", "last", "expected"),
    [
        (None, RECORD, SEEN, 60, None, None, None),  # no Workload
        (_workload(admitted=False), RECORD, SEEN, 60, None, None, None),  # queued
        (_workload(active=False), RECORD, SEEN, 60, None, None, None),  # being stopped
        (_workload(), None, SEEN, 60, None, None, None),  # not running yet
        # inside minRunSeconds: the top of the band, at once
        (_workload(), RECORD, SEEN, 60, None, None, (100, True, False)),
        (_workload(boost="100"), RECORD, SEEN, 60, None, None, (100, False, False)),  # unchanged
        # a higher class 50 above: the band narrows to 49
        (_workload(), RECORD, SEEN, 60, (100, 150), None, (49, True, True)),
        # changed, but written 5 s ago (budget 15 s): later
        (_workload(boost="100"), RECORD, None, 400, None, 995.0, (28, False, False)),
        (_workload(boost="100"), RECORD, None, 400, None, 980.0, (28, True, False)),
        # minRunSeconds over, checkpoints invisible (nothing scraped): the cost decides
        (_workload(), RECORD, None, 400, None, None, (28, True, False)),
        # visible but never saved (a JIT-only job): protected up to one save wait past it
        (_workload(), RECORD, SEEN, 400, None, None, (100, True, False)),
        (_workload(), RECORD, SEEN, 300 + 1800 + 1, None, None, (28, True, False)),
    ],
)
def test_plan_boost(
    workload: dict[str, Any] | None,
    record: models.AttemptRecord | None,
    progress: dict[str, Any] | None,
    ran: float,
    values: tuple[int, ...] | None,
    last: float | None,
    expected: tuple[int, bool, bool] | None,
) -> None:
    plan = plan_boost(
        workload,
        _status(progress),
        SPEC,
        record,
        T0 + ran,
        class_values=lambda: values,
        configured=100,
        last_write=last,
        monotonic_now=1000.0,
        min_interval=15.0,
    )
    if expected is None:
        assert plan is None
        return
    assert plan is not None
    assert (plan.boost, plan.write, plan.narrowed) == expected
    if plan.boost == plan.band:
        assert plan.cost.protected and "minRunSeconds" in plan.cost.reason


def test_boost_patch() -> None:
    assert boost_patch(7) == {"metadata": {"annotations": {BOOST_ANNOTATION: "7"}}}
