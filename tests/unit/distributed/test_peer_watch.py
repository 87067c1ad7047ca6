"""The peer watch's decisions: when a successor counts as gone, which errors mean a peer is gone."""

from __future__ import annotations

import pytest

from trainer_runtime.distributed.peers import (
    PeerLoss,
    RingView,
    _parse_announcement,
    peer_failure_in,
    peer_timeout_from_env,
)
from trainer_runtime.protocol import ENV_PEER_TIMEOUT_SECONDS

T = 10.0


@pytest.mark.parametrize(
    ("ticks", "lost_at", "expected"),
    [
        # (time, successor's counter or None when the store did not answer, successor done)
        ([(0, 1, False), (5, 2, False), (14, 2, False)], None, None),  # 9 s silent: not yet
        ([(0, 1, False), (5, 2, False), (15, 2, False)], 2, PeerLoss(3, "no heartbeat for 10 s")),
        ([(0, 0, False), (30, 0, False)], None, None),  # never beat: not judged
        ([(0, 1, False), (20, 1, True)], None, None),  # ended on purpose
        ([(0, 1, False), (5, None, False), (14, None, False)], None, None),
        (
            [(0, 1, False), (5, None, False), (15, None, False)],
            2,
            PeerLoss(0, "the rendezvous store (rank 0) unreachable for 10 s"),
        ),
        ([(0, 1, False), (5, None, False), (9, 2, False), (16, None, False)], None, None),
    ],
)
def test_ring_view(
    ticks: list[tuple[float, int | None, bool]], lost_at: int | None, expected: PeerLoss | None
) -> None:
    view = RingView(T, successor=3)
    results = [view.observe(now, value, done) for now, value, done in ticks]
    if lost_at is None:
        assert results == [None] * len(ticks)
    else:
        assert results[lost_at] == expected
        assert results[:lost_at] == [None] * lost_at


class DistBackendError(RuntimeError):
    """Stand-in with torch.distributed's error class name (the check is by name)."""


@pytest.mark.parametrize(
    ("exc", "is_peer"),
    [
        (
            RuntimeError(
                "[gloo/transport/tcp/pair.cc:561] Connection closed by peer [10.0.0.7]:4242"
            ),
            True,
        ),
        (RuntimeError("[pair.cc:545] Read error [127.0.0.1]: Connection reset by peer"), True),
        (DistBackendError("NCCL error: remote process exited or there was a network error"), True),
        (RuntimeError("CUDA out of memory"), False),
        (ValueError("loss is nan"), False),
        (TimeoutError("requests timed out"), False),
    ],
)
def test_peer_failure_in(exc: BaseException, is_peer: bool) -> None:
    assert (peer_failure_in(exc) is not None) is is_peer


def test_peer_failure_in_follows_the_cause() -> None:
    try:
        try:
            raise RuntimeError("Connection closed by peer [1.2.3.4]:5")
        except RuntimeError as inner:
            raise ValueError("step failed") from inner
    except ValueError as outer:
        found = peer_failure_in(outer)
    assert found is not None and "Connection closed by peer" in found


@pytest.mark.parametrize(
    ("raw", "loss"),
    [
        ("2 RuntimeError: boom", PeerLoss(2, "RuntimeError: boom")),
        ("? Connection closed", PeerLoss(None, "Connection closed")),
    ],
)
def test_announcements_round_trip(raw: str, loss: PeerLoss) -> None:
    assert _parse_announcement(raw) == loss


def test_the_message_names_the_rank_or_says_it_is_unknown() -> None:
    assert PeerLoss(2, "boom").message(0).startswith("rank 0 stopped because rank 2 ")
    assert "because another rank" in PeerLoss(None, "boom").message(1)


@pytest.mark.parametrize(("raw", "value"), [("", 10.0), ("3.5", 3.5), ("0", 0.0), ("x", 10.0)])
def test_peer_timeout_from_env(monkeypatch: pytest.MonkeyPatch, raw: str, value: float) -> None:
    monkeypatch.setenv(ENV_PEER_TIMEOUT_SECONDS, raw)
    assert peer_timeout_from_env() == value


def _store_server() -> tuple[object, int]:
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    server = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5)
    )
    return server, port


def test_a_watch_stops_on_anothers_announcement_and_ignores_its_own() -> None:
    import threading

    from trainer_runtime.distributed.peers import PeerWatch

    server, port = _store_server()
    seen: list[PeerLoss] = []
    called = threading.Event()

    def on_loss(loss: PeerLoss) -> None:
        seen.append(loss)
        called.set()

    kw = {"timeout": 30.0, "interval": 0.1, "host": "127.0.0.1", "port": port}
    me = PeerWatch(1, 3, on_loss, **kw).start()  # type: ignore[arg-type]
    other = PeerWatch(2, 3, lambda loss: None, **kw).start()  # type: ignore[arg-type]
    try:
        other.announce_failure("RuntimeError: boom")
        assert other.announced() is None  # its own announcement is no peer's failure
        assert called.wait(5), "the watch did not see the announcement"
        assert seen == [PeerLoss(2, "RuntimeError: boom")] and me.loss == seen[0]
    finally:
        me.stop()
        other.stop()
        del server
