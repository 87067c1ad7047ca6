"""What idle TrainingJobs cost the operator (issue 30): a sleeping daemon schedules no timer, a
finished job's metric series go, and the copy of our last status write goes once the watch
cache has it, and a sleeping daemon holds no copy of its objects."""

from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any

import kopf
import kubernetes
import pytest
from kopf._cogs.aiokits.aioenums import AsyncFlagWaiter, FlagSetter
from prometheus_client.metrics import MetricWrapperBase

from preemptible_operator import handlers, metrics
from preemptible_operator.reconcile import Cached, PassResult, Reconciler


def _timers(loop: asyncio.AbstractEventLoop) -> list[Any]:
    """Timer handles pending on the loop (CPython's BaseEventLoop keeps them in _scheduled)."""
    return [h for h in getattr(loop, "_scheduled", []) if not h.cancelled()]


async def _started(coro: Any) -> asyncio.Task[Any]:
    task = asyncio.ensure_future(coro)
    for _ in range(5):
        await asyncio.sleep(0)
    return task


@pytest.mark.parametrize("delay", [None, 300.0])
def test_a_sleeping_daemon_wakes_only_for_its_event_its_delay_or_stop(delay: float | None) -> None:
    """No periodic wake-up while a daemon sleeps: one timer at most (its requeue delay), none
    without a delay. A daemon that looked at ``stopped`` every second cost 0.15 core at 5,000
    idle jobs."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        wake, stopper = asyncio.Event(), FlagSetter[Any]()
        task = await _started(handlers._sleep(wake, AsyncFlagWaiter(stopper), delay))
        timers = _timers(loop)
        assert len(timers) == (0 if delay is None else 1)
        if timers:
            assert timers[0].when() - loop.time() > delay - 1  # the delay, not a 1 s poll
        assert not task.done()
        wake.set()
        await asyncio.wait_for(task, 1)

    asyncio.run(run())


def test_a_sleeping_daemon_ends_when_stopped() -> None:
    async def run() -> None:
        stopper = FlagSetter[Any]()
        task = await _started(handlers._sleep(asyncio.Event(), AsyncFlagWaiter(stopper), None))
        assert not task.done()
        stopper.set()
        await asyncio.wait_for(task, 1)
        assert not _timers(asyncio.get_running_loop())

    asyncio.run(run())


def test_a_sleeping_daemon_ends_at_its_delay() -> None:
    async def run() -> float:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.wait_for(
            handlers._sleep(asyncio.Event(), AsyncFlagWaiter(FlagSetter[Any]()), 0.05), 2
        )
        return loop.time() - t0

    assert 0.04 <= asyncio.run(run()) < 1.0


def _per_job_families() -> list[Any]:
    """Every metric of the operator labelled by TrainingJob (namespace, name): derived from the
    registry, so a new per-job series that forget_job misses fails below."""
    families = []
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase) and {"namespace", "name"} <= set(value._labelnames):
            families.append(value)
    return families


def _set_series(namespace: str, name: str) -> None:
    for family in _per_job_families():
        child = family.labels(namespace=namespace, name=name)
        (child.inc if hasattr(child, "inc") and not hasattr(child, "set") else child.set)(1)


def _series_of(namespace: str, name: str) -> list[str]:
    out = []
    for family in _per_job_families():
        for sample in family.collect()[0].samples:
            if (sample.labels.get("namespace"), sample.labels.get("name")) == (namespace, name):
                out.append(sample.name)
    return out


def test_forget_job_removes_every_per_job_series() -> None:
    assert len(_per_job_families()) >= 5
    _set_series("ns", "gone")
    _set_series("ns", "kept")
    metrics.forget_job("ns", "gone")
    assert _series_of("ns", "gone") == []
    assert _series_of("ns", "kept")
    metrics.forget_job("ns", "kept")


def test_a_finished_jobs_series_go_after_a_delay() -> None:
    async def run() -> tuple[list[str], list[str]]:
        _set_series("ns", "done")
        handlers.forget_series_later("ns", "done", delay=0.05)
        before = _series_of("ns", "done")
        await asyncio.sleep(0.2)
        return before, _series_of("ns", "done")

    before, after = asyncio.run(run())
    assert before and after == []
    assert handlers.SERIES_AFTER_FINISH_SECONDS > 0


def test_series_stay_when_a_job_of_that_name_runs_again() -> None:
    async def run() -> list[str]:
        _set_series("ns", "again")
        handlers.forget_series_later("ns", "again", delay=0.05)
        handlers._wakeups[("ns", "again")] = asyncio.Event()  # its new daemon
        try:
            await asyncio.sleep(0.2)
        finally:
            handlers._wakeups.pop(("ns", "again"), None)
        return _series_of("ns", "again")

    assert asyncio.run(run())
    metrics.forget_job("ns", "again")


def _tj(rv: str) -> dict[str, Any]:
    return {"metadata": {"name": "tj", "namespace": "ns", "uid": "u", "resourceVersion": rv}}


def test_the_copy_of_our_status_write_goes_once_the_cache_has_it() -> None:
    r = Reconciler(kubernetes.client.ApiClient())
    returned = {**_tj("11"), "metadata": {**_tj("11")["metadata"], "managedFields": [{"x": 1}]}}
    r._put_status = lambda obj, status: returned  # type: ignore[method-assign]
    assert r._write_status(_tj("10"), {"phase": "Queued"}, {})
    held = r._written[("ns", "tj")]
    assert "managedFields" not in held[1]["metadata"]
    # The cache still has the version our write replaced: the written object is used.
    assert r._current_tj("ns", "tj", Cached(_tj("10"), [], [], {}))["metadata"][
        "resourceVersion"
    ] == ("11")
    assert ("ns", "tj") in r._written
    # The cache caught up: the copy is dropped (thousands of idle jobs held one each).
    assert r._current_tj("ns", "tj", Cached(_tj("11"), [], [], {}))["metadata"][
        "resourceVersion"
    ] == ("11")
    assert ("ns", "tj") not in r._written


def test_the_copy_of_our_status_write_goes_when_the_watch_delivers_it() -> None:
    """A job with no further pass (finished, or queued with nothing to wake it) must not hold
    the copy: the TrainingJob's watch event that carries our write drops it."""
    r = Reconciler(kubernetes.client.ApiClient())
    r._put_status = lambda obj, status: _tj("11")  # type: ignore[method-assign]
    assert r._write_status(_tj("10"), {"phase": "Succeeded"}, {})
    r.cache_saw("ns", "tj", "10")  # the version our write replaced: still needed
    assert ("ns", "tj") in r._written
    r.cache_saw("ns", "other", "11")
    r.cache_saw("ns", "tj", None)
    assert ("ns", "tj") in r._written
    r.cache_saw("ns", "tj", "11")
    assert ("ns", "tj") not in r._written


def _reconcile_daemon() -> Any:
    registry = handlers.register(kopf.OperatorRegistry())
    (daemon,) = [h.fn for h in registry._spawning.get_all_handlers() if h.id == "reconcile"]
    return daemon


def test_a_sleeping_daemon_holds_no_copy_of_its_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between passes a daemon keeps only the delay: the pass's copy of the TrainingJob and of
    its children goes with the pass (a second copy of every TrainingJob, for its whole life)."""
    seen: list[weakref.ref[Cached]] = []

    async def one_pass(urgent: bool, wake: Any, ns: str, name: str, cached: Cached) -> Any:
        seen.append(weakref.ref(cached))
        return PassResult(phase="Queued", requeue_after=None)

    monkeypatch.setattr(handlers, "_run_pass", one_pass)
    body = {"metadata": {"name": "tj", "namespace": "ns", "uid": "u",
                         "finalizers": [handlers.FINALIZER]}, "spec": {"numNodes": 1}}  # fmt: skip
    job = {"metadata": {"name": "tj-a1", "uid": "j"}, "status": {}}

    async def run() -> None:
        stopper = FlagSetter[Any]()
        task = await _started(
            _reconcile_daemon()(
                namespace="ns", name="tj", body=body, stopped=AsyncFlagWaiter(stopper),
                tj_jobs={("ns", "tj"): [job]}, tj_pods={}, tj_workloads={},
            )
        )  # fmt: skip
        try:
            assert len(seen) == 1 and not task.done()  # asleep, no delay
            gc.collect()
            assert seen[0]() is None
        finally:
            stopper.set()
            await asyncio.wait_for(task, 2)

    asyncio.run(run())
