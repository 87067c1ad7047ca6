"""The SIGTERM latch: records the first SIGTERM only; decisions use an injected clock."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from trainer_runtime.protocol import ENV_GRACE_SECONDS, ENV_KILL_WAIT_SECONDS
from trainer_runtime.signals import SigtermLatch


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_kill_wait_then_act() -> None:
    clock = FakeClock()
    latch = SigtermLatch(kill_wait=3.0, grace_seconds=30.0, clock=clock)
    assert not latch.triggered and not latch.should_act()
    assert latch.elapsed() is None and latch.seconds_left() is None
    latch.trigger()
    assert latch.triggered and not latch.should_act()
    clock.now += 2.999
    assert not latch.should_act()
    clock.now += 0.001
    assert latch.should_act()
    assert latch.elapsed() == pytest.approx(3.0)
    assert latch.seconds_left() == pytest.approx(27.0)


def test_second_sigterm_never_resets() -> None:
    clock = FakeClock()
    latch = SigtermLatch(kill_wait=3.0, clock=clock)
    latch.trigger()
    clock.now += 2.0
    latch.trigger()
    clock.now += 1.0
    assert latch.count == 2
    assert latch.elapsed() == pytest.approx(3.0)
    assert latch.should_act()


@pytest.mark.parametrize(
    ("env", "kill_wait", "grace"),
    [
        ({}, 3.0, None),
        ({ENV_KILL_WAIT_SECONDS: "0.5", ENV_GRACE_SECONDS: "60"}, 0.5, 60.0),
        ({ENV_KILL_WAIT_SECONDS: "soon", ENV_GRACE_SECONDS: "-1"}, 3.0, None),
    ],
)
def test_settings_from_env(
    monkeypatch: pytest.MonkeyPatch, env: dict, kill_wait: float, grace: float | None
) -> None:
    for name in (ENV_KILL_WAIT_SECONDS, ENV_GRACE_SECONDS):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    latch = SigtermLatch()
    assert latch.kill_wait == kill_wait
    assert latch.grace_seconds == grace


def test_real_sigterm_sets_latch_and_handler_is_restored() -> None:
    seen: list[int] = []

    def previous(signum: int, frame: object) -> None:
        seen.append(signum)

    old = signal.signal(signal.SIGTERM, previous)
    try:
        latch = SigtermLatch(kill_wait=0.0)
        with latch:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
            # The handler runs at the next bytecode boundary of the main thread.
            for _ in range(1000):
                if latch.count == 2:
                    break
            assert latch.triggered and latch.count == 2 and latch.should_act()
        assert signal.getsignal(signal.SIGTERM) is previous
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):
            if seen:
                break
        assert seen == [signal.SIGTERM]
        assert latch.count == 2
    finally:
        signal.signal(signal.SIGTERM, old)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="kernel stamps: Linux only")
def test_a_sigterm_during_a_long_c_call_counts_from_its_arrival() -> None:
    """The main thread is inside one long C call (sorting holds the GIL and never checks for
    signals, like an NCCL collective or a CUDA synchronisation) when SIGTERM arrives: the Python
    handler runs only after it, but the latch counts from the arrival (the kernel's stamp)."""
    data = [random.random() for _ in range(4_000_000)]
    sender = subprocess.Popen(
        ["sh", "-c", f"read go; kill -TERM {os.getpid()}"], stdin=subprocess.PIPE
    )
    latch = SigtermLatch(kill_wait=0.0)
    with latch:
        assert sender.stdin is not None
        sender.stdin.write(b"go\n")
        sender.stdin.flush()
        started = time.monotonic()
        data.sort()  # SIGTERM arrives in here (the sender needs milliseconds, the sort ~1 s)
        ended = time.monotonic()
        for _ in range(1000):  # the handler runs at the next bytecode boundary
            if latch.triggered:
                break
        sender.wait(10)
        assert latch.triggered and latch.received_at is not None
        # counted from inside the sort, not from its end
        assert started <= latch.received_at < ended - 0.25 * (ended - started), (
            started,
            latch.received_at,
            ended,
        )


def test_another_wakeup_fd_is_left_in_place() -> None:
    import socket

    from trainer_runtime.signals import ArrivalStamps

    reader, writer = socket.socketpair()
    writer.setblocking(False)
    previous = signal.set_wakeup_fd(writer.fileno())
    try:
        stamps = ArrivalStamps()
        assert stamps.install() is False  # e.g. an asyncio loop's: not replaced
        assert signal.set_wakeup_fd(writer.fileno()) == writer.fileno()
        assert stamps.take(signal.SIGTERM) is None
        # once theirs is gone, the next install takes the place
        signal.set_wakeup_fd(-1)
        assert stamps.install() is True
    finally:
        signal.set_wakeup_fd(previous)
        reader.close()
        writer.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="kernel stamps: Linux only")
def test_other_signals_never_crowd_out_the_sigterm_stamp() -> None:
    """Other Python-handled signals (a DataLoader's SIGCHLD) write to the same wakeup socket;
    the latch drains it at every step boundary, so a SIGTERM's byte still finds room."""
    previous = signal.signal(signal.SIGUSR1, lambda *_: None)
    latch = SigtermLatch(kill_wait=0.0)
    stamps: list[float | None] = []
    take = latch._stamps.take

    def recording_take(signum: int) -> float | None:
        stamps.append(take(signum))
        return stamps[-1]

    latch._stamps.take = recording_take  # type: ignore[method-assign]
    try:
        with latch:
            for _ in range(20):
                for _ in range(200):  # far more than the socket's buffer holds at once
                    os.kill(os.getpid(), signal.SIGUSR1)
                assert not latch.should_act()  # a step boundary: drains
            before = time.monotonic()
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):
                if latch.triggered:
                    break
            assert latch.received_at is not None
            # the SIGTERM's byte found room and was stamped, near when it was sent
            assert len(stamps) == 1 and stamps[0] is not None, stamps
            assert abs(latch.received_at - before) < 0.5
            assert signal.SIGTERM not in latch._stamps._first  # taken by the handler
    finally:
        del latch._stamps.take
        signal.signal(signal.SIGUSR1, previous)
