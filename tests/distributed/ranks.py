"""Several toy ranks as real processes, started the way the operator starts the pods of an attempt.

Each rank is one ``python -m trainer_runtime.toy`` process (a :class:`ToyRun`) with the operator's
rendezvous environment: MASTER_ADDR/MASTER_PORT of rank 0, WORLD_SIZE, RANK = NODE_RANK and
LOCAL_RANK=0 (one process per pod). Every rank has its own work directory, so its events, log and
termination message are its own; all ranks share the output dir.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Sequence
from pathlib import Path

from trainer_runtime.testing import ToyRun, ToyRunError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RankedRun:
    """``world_size`` toy processes of one attempt."""

    def __init__(
        self,
        output_dir: Path,
        workdir: Path,
        *,
        world_size: int,
        args: Sequence[str],
        attempt: int = 1,
        resume_from: str | None = None,
        kill_wait: float | None = 0.2,
        grace_seconds: float | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        port = free_port()
        self.world_size = world_size
        self.attempt = attempt
        self.ranks = [
            ToyRun(
                output_dir,
                workdir / f"a{attempt}-rank{rank}",
                args=args,
                attempt=attempt,
                resume_from=resume_from,
                kill_wait=kill_wait,
                grace_seconds=grace_seconds,
                env={
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "WORLD_SIZE": str(world_size),
                    "RANK": str(rank),
                    "NODE_RANK": str(rank),
                    "LOCAL_RANK": "0",
                    "LOCAL_WORLD_SIZE": "1",
                    **(env or {}),
                },
            )
            for rank in range(world_size)
        ]

    def start(self) -> RankedRun:
        for run in self.ranks:
            run.start()
        return self

    def wait(self, timeout: float) -> list[int]:
        """Exit codes of every rank (in rank order); kills all of them on a timeout."""
        deadline = time.monotonic() + timeout
        codes = []
        try:
            for run in self.ranks:
                codes.append(run.wait(max(1.0, deadline - time.monotonic())))
        except ToyRunError:
            self.kill()
            raise
        return codes

    def kill(self) -> None:
        for run in self.ranks:
            run.kill()

    def send(self, rank: int, sig: signal.Signals) -> float:
        return self.ranks[rank].send(sig)

    def steps_begun(self, rank: int) -> list[int]:
        return list(self.ranks[rank].steps_begun())

    def steps_ended(self, rank: int) -> list[int]:
        return [int(e["step"]) for e in self.ranks[rank].events() if e["event"] == "step_end"]

    def tails(self) -> str:
        return "\n".join(run.tail(25) for run in self.ranks)

    def __enter__(self) -> RankedRun:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()


def pids_alive(pids: Sequence[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(pid)
    return alive
