"""One rank of a three-rank attempt is gone (SIGKILL, frozen, or a real failure): the others end
within seconds with EXIT_PEER_FAILED and a termination message naming what happened, instead of
waiting in their next collective until the operator's SIGKILL."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.distributed.ranks import RankedRun
from trainer_runtime.protocol import (
    DEFAULT_PEER_TIMEOUT_SECONDS,
    EXIT_PEER_FAILED,
    EXIT_PREEMPTED,
)

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(300)]

WORLD = 3
ARGS = ["--max-steps", "200", "--save-steps", "1000", "--seed", "3", "--step-sleep", "0.3"]
START_TIMEOUT = 180.0
# Generous on 2 loaded cores; the process group's own timeout is 30 minutes.
SLACK = 8.0


def _survivor_exits(run: RankedRun, gone: int, within: float) -> dict[int, tuple[int, float]]:
    """Exit code and seconds to exit of every other rank (polled: they end in any order)."""
    t0 = time.monotonic()
    exits: dict[int, tuple[int, float]] = {}
    while len(exits) < WORLD - 1 and time.monotonic() - t0 < within:
        for rank, toy in enumerate(run.ranks):
            code = toy.proc.poll() if rank != gone and rank not in exits else None
            if code is not None:
                exits[rank] = (code, time.monotonic() - t0)
        time.sleep(0.05)
    return exits


@pytest.mark.parametrize(
    ("sig", "within"),
    [
        # gloo usually raises at once on the closed connections; when it does not, the watch
        # of the dead rank's predecessor announces it after its heartbeat timeout.
        (signal.SIGKILL, DEFAULT_PEER_TIMEOUT_SECONDS + SLACK),
        # Frozen (a node gone without closing its connections): only the heartbeat tells.
        (signal.SIGSTOP, DEFAULT_PEER_TIMEOUT_SECONDS + SLACK),
    ],
    ids=["sigkill", "frozen"],
)
def test_the_other_ranks_end_with_the_peer_failure_code(
    tmp_path: Path, sig: signal.Signals, within: float
) -> None:
    gone = 1
    with RankedRun(tmp_path / "out", tmp_path, world_size=WORLD, args=ARGS) as run:
        run.ranks[gone].wait_for_event("step_begin", step=3, timeout=START_TIMEOUT)
        time.sleep(0.1)  # inside the step
        run.send(gone, sig)
        exits = _survivor_exits(run, gone, within + 30)
        run.send(gone, signal.SIGKILL)  # a frozen rank ends here
    survivors = [r for r in range(WORLD) if r != gone]
    assert sorted(exits) == survivors, f"still running after {within + 30:.0f} s\n{run.tails()}"
    for rank, (code, seconds) in exits.items():
        assert code == EXIT_PEER_FAILED != EXIT_PREEMPTED, f"rank {rank}: {code}\n{run.tails()}"
        assert seconds < within, f"rank {rank} took {seconds:.1f} s\n{run.tails()}"
        msg = run.ranks[rank].termination_message()
        assert msg.reason == "failed" and msg.peer_gone, msg
        assert msg.message and "is gone" in msg.message, msg
        assert msg.failed_rank in (gone, None), msg
    if sig == signal.SIGSTOP:
        # No connection closed: the heartbeat named the frozen rank.
        assert {run.ranks[r].termination_message().failed_rank for r in survivors} == {gone}


def test_a_real_failure_of_one_rank_is_named_by_the_others(tmp_path: Path) -> None:
    failing = 2
    args = [*ARGS, "--fail-at-step", "4", "--fail-rank", str(failing)]
    with RankedRun(tmp_path / "out", tmp_path, world_size=WORLD, args=args) as run:
        run.ranks[failing].wait_for_event("step_begin", step=4, timeout=START_TIMEOUT)
        exits = _survivor_exits(run, failing, DEFAULT_PEER_TIMEOUT_SECONDS + 30)
        own = run.ranks[failing].wait(30)
    assert own == 1, run.tails()
    assert "injected failure" in (run.ranks[failing].termination_message().message or "")
    assert sorted(exits) == [0, 1], run.tails()
    for rank, (code, seconds) in exits.items():
        assert code == EXIT_PEER_FAILED, f"rank {rank}: {code}\n{run.tails()}"
        assert seconds < SLACK, f"rank {rank} took {seconds:.1f} s\n{run.tails()}"
        msg = run.ranks[rank].termination_message()
        assert msg.peer_gone and msg.failed_rank == failing, msg
        assert "injected failure" in (msg.message or ""), msg
