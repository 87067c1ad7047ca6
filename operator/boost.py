"""The priority-boost policy of one pass (pure, table-tested; issue 39): whether and what the
operator writes into the running attempt's Kueue Workload's ``kueue.x-k8s.io/priority-boost``
annotation. The cost model and the band are victims.py's; this module decides, from what the
pass observed, the boost, whether it is written now and the patch. reconcile.py only performs
the write and logs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from preemptible_operator.classify import is_kueue_admitted
from preemptible_operator.models import AttemptRecord, TrainingJobSpec, TrainingJobStatus
from preemptible_operator.victims import (
    BOOST_ANNOTATION,
    PreemptionCost,
    band_top,
    should_write_boost,
    victim_boost,
    victim_inputs,
)

__all__ = ["BoostPlan", "boost_patch", "plan_boost"]


@dataclass(frozen=True)
class BoostPlan:
    """The boost the running attempt's Workload should carry now."""

    boost: int
    cost: PreemptionCost
    current: str | None
    """The Workload's annotation as read (None: not set)."""
    write: bool
    """Patch it now (it differs, and the write budget allows)."""
    band: int
    """The top of the band used (the configured one, or lower: band_top)."""
    narrowed: bool
    """The band is narrower than configured (a higher class is closer): worth a warning."""


def plan_boost(
    workload: dict[str, Any] | None,
    status: TrainingJobStatus,
    spec: TrainingJobSpec,
    record: AttemptRecord | None,
    now: float,
    *,
    class_values: Callable[[], Iterable[int] | None],
    configured: int,
    last_write: float | None,
    monotonic_now: float,
    min_interval: float,
) -> BoostPlan | None:
    """What to do with the running attempt's boost (None: nothing, no Workload admitted, one
    being stopped, or the attempt not running yet). ``last_write``: the monotonic time of the
    last write to this same Workload (None: none yet, the first value goes out at once).
    ``class_values``: reads the cluster's priority class values (None: unknown), called only
    when a boost is due."""
    if workload is None or not is_kueue_admitted(workload):
        return None
    if (workload.get("spec") or {}).get("active") is False:
        return None  # a victim being stopped: its boost was dropped with the deactivation
    inputs = victim_inputs(status, spec, record, now)
    if inputs is None:
        return None
    priority = (workload.get("spec") or {}).get("priority")
    top = band_top(priority, class_values(), configured)
    boost, cost = victim_boost(inputs, top)
    current = ((workload.get("metadata") or {}).get("annotations") or {}).get(BOOST_ANNOTATION)
    write = should_write_boost(boost, current, last_write, monotonic_now, min_interval)
    return BoostPlan(boost, cost, current, write, top, top < configured)


def boost_patch(boost: int) -> dict[str, Any]:
    """The merge patch of the Workload that sets the boost."""
    return {"metadata": {"annotations": {BOOST_ANNOTATION: str(boost)}}}
