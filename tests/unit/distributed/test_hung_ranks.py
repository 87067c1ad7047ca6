"""Which rank is hung (alive, its training loop stuck) from the loop's own progress stamps."""

from __future__ import annotations

import pytest

from trainer_runtime.distributed.peers import PeerLoss, Progress, hang_loss, hung_ranks

NOW = 1000.0


def _p(count: int, age: float = 10.0, phase: str = "x") -> Progress:
    return Progress(count, phase, NOW - age)


@pytest.mark.parametrize(
    ("stamps", "expected"),
    [
        # rank 1 stopped in its save; ranks 0 and 2 went on to the barrier and wait for it
        ({0: _p(12), 1: _p(11), 2: _p(12)}, [1]),
        # two ranks behind
        ({0: _p(11), 1: _p(11), 2: _p(12), 3: _p(12)}, [0, 1]),
        # everyone at the same point (all in one collective, or all slow): nobody to name
        ({0: _p(12), 1: _p(12)}, []),
        # behind, but its stamp is fresh: it is moving, not hung
        ({0: _p(12), 1: _p(11, age=0.5)}, []),
        # a rank that never stamped, once the others did
        ({0: _p(3), 1: None}, [1]),
        ({0: None, 1: None}, []),
        ({}, []),
        # only the lowest count: a rank one point behind the leader but ahead of the laggard
        # is waiting too
        ({0: _p(20), 1: _p(19), 2: _p(7)}, [2]),
    ],
)
def test_hung_ranks(stamps: dict[int, Progress | None], expected: list[int]) -> None:
    assert hung_ranks(stamps, NOW) == expected


def test_hang_loss_names_the_rank_where_it_stopped_and_who_waits() -> None:
    stamps = {
        0: _p(12, 1.0, "barrier 2 of checkpoint-8"),
        1: _p(11, 14.0, "writing the JIT checkpoint-8"),
    }
    loss = hang_loss(stamps, NOW)
    assert loss is not None and loss.rank == 1 and loss.hung
    assert "'writing the JIT checkpoint-8' 14.0 s ago" in loss.detail
    assert "rank 0 went on to 'barrier 2 of checkpoint-8'" in loss.detail
    assert loss.message(1).startswith("rank 1 hung: its training loop stopped")
    assert loss.message(0).startswith("rank 0 stopped because rank 1 of the attempt hung")
    assert hang_loss({0: _p(3), 1: _p(3)}, NOW) is None


def test_a_gone_peer_is_not_a_hung_one() -> None:
    loss = PeerLoss(2, "no heartbeat for 10 s")
    assert not loss.hung
    assert "is gone" in loss.message(0)


@pytest.mark.parametrize(
    "raw",
    [b"12 999.500 writing the JIT checkpoint-8", "3 1.000 step 3", "0 5.000 start"],
)
def test_progress_round_trips_through_the_store(raw: bytes | str) -> None:
    progress = Progress.decode(raw)
    assert progress is not None
    text = raw.decode() if isinstance(raw, bytes) else raw
    assert progress.encode() == text


@pytest.mark.parametrize("raw", [None, b"", "x 1 y", "3 nan-ish z"])
def test_unreadable_progress_is_none(raw: bytes | str | None) -> None:
    assert Progress.decode(raw) is None
