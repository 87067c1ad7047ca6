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
