"""Where a daemon's pass runs: a watch event must not wait behind a queue of periodic passes.

Real thread pools and a real event loop; the reconciler is a recorder (the pass's content is
tested elsewhere, here only when and where it runs)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from preemptible_operator import handlers
from preemptible_operator.reconcile import Cached, PassResult


class Recorder:
    """Stands in for the Reconciler: records each pass and its thread; a pass blocks while
    ``hold`` is clear."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.scrapes: list[bool] = []
        self.hold = threading.Event()
        self.hold.set()
        self.entered = threading.Event()

    def reconcile(
        self,
        namespace: str,
        name: str,
        cached: Cached | None = None,
        *,
        scrape_metrics: bool = True,
    ) -> PassResult:
        self.entered.set()
        self.hold.wait(10)
        self.calls.append((name, threading.current_thread().name))
        self.scrapes.append(scrape_metrics)
        return PassResult(requeue_after=5.0)


@pytest.fixture
def pools() -> Iterator[tuple[Recorder, concurrent.futures.ThreadPoolExecutor]]:
    periodic = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="periodic")
    urgent = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="urgent")
    recorder = Recorder()
    saved = dict(handlers._state)
    handlers._state.update(periodic=periodic, urgent=urgent, reconciler=recorder)
    try:
        yield recorder, periodic
    finally:
        handlers._state.clear()
        handlers._state.update(saved)
        periodic.shutdown(wait=True, cancel_futures=True)
        urgent.shutdown(wait=True)


def _cached() -> Cached:
    return Cached(obj={}, jobs=[], pods=[], workloads={})


def _busy(pool: concurrent.futures.ThreadPoolExecutor) -> threading.Event:
    """Occupy the pool's only thread until the returned event is set."""
    release = threading.Event()
    pool.submit(release.wait, 10)
    return release


def test_a_queued_periodic_pass_is_dropped_when_an_event_wakes_the_daemon(
    pools: tuple[Recorder, concurrent.futures.ThreadPoolExecutor],
) -> None:
    recorder, periodic = pools
    release = _busy(periodic)

    async def scenario() -> Any:
        wake = asyncio.Event()
        task = asyncio.create_task(handlers._run_pass(False, wake, "ns", "job", _cached()))
        await asyncio.sleep(0.1)
        assert not task.done()  # queued behind the busy thread
        wake.set()
        return await asyncio.wait_for(task, 2)

    try:
        assert asyncio.run(scenario()) is None
    finally:
        release.set()
    periodic.submit(lambda: None).result(5)  # the queue has drained: the dropped pass never ran
    assert recorder.calls == []


def test_a_periodic_pass_already_running_is_awaited(
    pools: tuple[Recorder, concurrent.futures.ThreadPoolExecutor],
) -> None:
    recorder, _ = pools
    recorder.hold.clear()

    async def scenario() -> Any:
        wake = asyncio.Event()
        task = asyncio.create_task(handlers._run_pass(False, wake, "ns", "job", _cached()))
        await asyncio.to_thread(recorder.entered.wait, 5)
        wake.set()
        await asyncio.sleep(0.1)
        assert not task.done()  # a pass under way is never abandoned half done
        recorder.hold.set()
        return await asyncio.wait_for(task, 5)

    result = asyncio.run(scenario())
    assert isinstance(result, PassResult) and result.requeue_after == 5.0
    assert [name for name, _ in recorder.calls] == ["job"]


def test_an_urgent_pass_does_not_queue_behind_periodic_ones(
    pools: tuple[Recorder, concurrent.futures.ThreadPoolExecutor],
) -> None:
    recorder, periodic = pools
    release = _busy(periodic)
    try:
        result = asyncio.run(
            asyncio.wait_for(handlers._run_pass(True, asyncio.Event(), "ns", "job", _cached()), 5)
        )
    finally:
        release.set()
    assert isinstance(result, PassResult)
    assert [thread.startswith("urgent") for _, thread in recorder.calls] == [True]


@pytest.mark.parametrize(("urgent", "scrapes"), [(True, False), (False, True)])
def test_only_periodic_passes_scrape(
    pools: tuple[Recorder, concurrent.futures.ThreadPoolExecutor], urgent: bool, scrapes: bool
) -> None:
    """A pass woken by a watch event keeps the last scraped values: pods slow to answer
    /metrics must not hold the threads that handle events (issue 30)."""
    recorder, _ = pools
    result = asyncio.run(
        asyncio.wait_for(handlers._run_pass(urgent, asyncio.Event(), "ns", "job", _cached()), 5)
    )
    assert isinstance(result, PassResult)
    assert recorder.scrapes == [scrapes]
