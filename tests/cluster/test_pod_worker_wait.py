"""The node agent's pod threads sleep until something happens (a container's exit, a deletion,
a restart that is due) instead of polling: with hundreds of pods, polling took most of a core
from the components measured beside it. No API server needed."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from .node_agent import _Container, _PodWorker

LONG = 30.0  # a timeout none of these waits may reach


def _worker(tmp_path: Path) -> _PodWorker:
    pod: dict[str, Any] = {
        "metadata": {"namespace": "ns", "name": "p", "uid": "0123456789abcdef"},
        "spec": {"nodeName": "n", "restartPolicy": "Never", "containers": []},
    }
    return _PodWorker(SimpleNamespace(workdir=tmp_path), pod, "127.0.0.1")  # type: ignore[arg-type]


def _container(seconds: float) -> _Container:
    c = _Container({"name": "main"}, init=False)
    c.popen = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])
    c.pidfd = _PodWorker._open_pidfd(c.popen.pid)
    return c


@pytest.fixture
def worker(tmp_path: Path) -> _PodWorker:
    return _worker(tmp_path)


def test_wakes_when_a_container_exits(worker: _PodWorker) -> None:
    c = _container(0.3)
    if c.pidfd is None:
        pytest.skip("no pidfd_open on this kernel: the agent polls instead")
    started = time.monotonic()
    assert worker._sleep([c], worker._next_wake([c])) is False
    assert c.popen is not None and c.popen.poll() == 0  # woken by the exit itself
    assert time.monotonic() - started < LONG / 2


def test_wakes_when_termination_is_requested(worker: _PodWorker) -> None:
    c = _container(LONG)
    assert c.popen is not None
    try:
        threading.Timer(0.2, worker.request_termination, args=(5.0,)).start()
        started = time.monotonic()
        assert worker._sleep([c], LONG) is True
        assert time.monotonic() - started < LONG / 2
        assert c.popen.poll() is None  # still running: termination is the caller's next step
    finally:
        c.popen.kill()
        c.popen.wait()


def test_sleeps_only_until_a_restart_is_due(worker: _PodWorker) -> None:
    c = _Container({"name": "main"}, init=False)
    c.restart_at = time.monotonic() + 0.2
    assert 0 < worker._next_wake([c]) <= 0.2
    c.restart_at = time.monotonic() - 1
    assert worker._next_wake([c]) < 0
    assert worker._sleep([c], worker._next_wake([c])) is False  # due: no wait at all
