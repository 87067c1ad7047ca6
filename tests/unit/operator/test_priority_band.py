"""The priority boost's band stays below the next higher priority class (issue 32): the pure
rule, the cached class values, and the Reconciler writing a narrowed boost."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import kubernetes
import pytest
from kubernetes.client.rest import ApiException

from preemptible_operator.priority_classes import PriorityClassValues
from preemptible_operator.reconcile import OperatorConfig, Reconciler
from preemptible_operator.victims import BOOST_ANNOTATION, band_top, victim_boost
from tests.unit.operator.builders import make_spec
from tests.unit.operator.test_victims import (
    T0,
    _inputs,
    _observed,
    _record,
    _Recorder,
    _status,
    _workload,
)


@pytest.mark.parametrize(
    ("priority", "classes", "configured", "expected"),
    [
        (100, [100, 1000], 100, 100),  # the test tier's classes: a 900 gap holds the band
        (100, [100, 1000], 5000, 899),  # a band wider than the gap: one below the next class
        (100, [100, 150, 1000], 100, 49),  # the next class, not the farthest, bounds it
        (100, [100, 101], 100, 0),  # no room: no boost at all
        (1000, [100, 1000], 100, 100),  # the top class: nothing above to reach
        (None, [0, 10], 100, 9),  # no priority: Kueue's 0
        (100, [], 100, 100),  # no classes at all
        (100, None, 100, 100),  # classes unknown (not readable): the configured band
        (-5, [-5, 0, 2_000_000_000], 100, 4),  # negative priorities too
    ],
)
def test_band_top(
    priority: int | None, classes: list[int] | None, configured: int, expected: int
) -> None:
    assert band_top(priority, classes, configured) == expected


def test_an_empty_band_boosts_nothing_even_a_protected_job() -> None:
    boost, cost = victim_boost(_inputs(min_run_seconds=10_000), 0)
    assert (boost, cost.protected) == (0, True)


class _Lists:
    """Stands in for the two list calls; ``fail`` makes the next calls raise."""

    def __init__(self, workload_classes: list[int], pod_classes: list[int]) -> None:
        self.workload_classes, self.pod_classes = workload_classes, pod_classes
        self.calls = 0
        self.fail: Exception | None = None

    def list_cluster_custom_object(self, group: str, version: str, plural: str) -> Any:
        assert (group, plural) == ("kueue.x-k8s.io", "workloadpriorityclasses")
        self.calls += 1
        if self.fail is not None:
            raise self.fail
        return {
            "items": [{"metadata": {"name": f"c{v}"}, "value": v} for v in self.workload_classes]
        }

    def list_priority_class(self) -> Any:
        return SimpleNamespace(items=[SimpleNamespace(value=v) for v in self.pod_classes])


def _values(lists: _Lists, clock: list[float]) -> PriorityClassValues:
    values = PriorityClassValues(kubernetes.client.ApiClient(), 60.0, clock=lambda: clock[0])
    values._custom = lists  # type: ignore[assignment]
    values._scheduling = lists  # type: ignore[assignment]
    return values


def test_class_values_merge_both_kinds_and_are_read_once_per_interval() -> None:
    clock = [0.0]
    lists = _Lists([1000, 100], [2_000_000_000, 100])
    values = _values(lists, clock)
    assert values.values("v1beta2") == (100, 1000, 2_000_000_000)
    clock[0] = 59.0
    lists.workload_classes = [100, 150, 1000]
    assert values.values("v1beta2") == (100, 1000, 2_000_000_000)  # cached
    assert lists.calls == 1
    clock[0] = 60.0
    assert values.values("v1beta2") == (100, 150, 1000, 2_000_000_000)
    assert lists.calls == 2


def test_class_values_keep_the_last_known_when_a_read_fails() -> None:
    clock = [0.0]
    lists = _Lists([100, 1000], [])
    values = _values(lists, clock)
    lists.fail = ApiException(status=403, reason="Forbidden")
    assert values.values("v1beta2") is None  # never read: the caller keeps its band
    clock[0] = 60.0
    lists.fail = None
    assert values.values("v1beta2") == (100, 1000)
    clock[0] = 120.0
    lists.fail = OSError("connection refused")
    assert values.values("v1beta2") == (100, 1000)


def test_the_reconciler_narrows_the_boost_below_the_next_class() -> None:
    r = Reconciler(
        kubernetes.client.ApiClient(),
        OperatorConfig(priority_boost=True, priority_boost_max=5000),
        clock=lambda: T0 + 60,
    )
    rec = _Recorder()
    r.custom = rec  # type: ignore[assignment]
    r._class_values = _values(_Lists([100, 1000], []), [0.0])
    workload = _workload()
    workload["spec"]["priority"] = 100
    spec = make_spec(preemption={"minRunSeconds": 300})  # protected: the top of the band
    r._update_priority_boost(_observed(workload), spec, _status(), _record())
    assert rec.patches == [
        ("job-tj-a2-x", {"metadata": {"annotations": {BOOST_ANNOTATION: "899"}}})
    ]
