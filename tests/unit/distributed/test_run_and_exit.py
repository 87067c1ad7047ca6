"""``collectives.run_and_exit``: the entry point's code becomes the exit status, output and atexit
handlers are flushed, and a distributed process skips the interpreter teardown."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainer_runtime.distributed import collectives

SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    import torch.distributed as dist
    from trainer_runtime.distributed import collectives

    def main():
        if sys.argv[1] == "dist":
            dist.init_process_group("gloo")
            collectives.destroy_at_exit()
            dist.all_reduce(__import__("torch").ones(4))
        atexit.register(lambda: print("atexit ran", flush=True))
        print("trained", end="")  # no newline, no flush: must still reach the log
        return int(sys.argv[2])

    collectives.run_and_exit(main)
    """
)


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    # Never os._exit the test process, even if another test left a process group behind.
    monkeypatch.setattr(collectives.dist, "is_initialized", lambda: False)


@pytest.mark.parametrize(("main_result", "code"), [(0, 0), (75, 75), (None, 0), ("boom", 1)])
def test_single_process_exit_codes(main_result: object, code: int) -> None:
    with pytest.raises(SystemExit) as exc:
        collectives.run_and_exit(lambda: main_result)  # type: ignore[arg-type, return-value]
    assert exc.value.code == code


def test_system_exit_inside_main_is_kept() -> None:
    def main() -> int:
        raise SystemExit(75)

    with pytest.raises(SystemExit) as exc:
        collectives.run_and_exit(main)
    assert exc.value.code == 75


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _two_ranks(command: list[str], cwd: Path) -> list[tuple[int, str]]:
    """Run ``command`` as ranks 0 and 1 of a gloo world; each rank's exit code and output."""
    port = _port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank))
        procs.append(
            subprocess.Popen(
                command,
                cwd=cwd,  # not the repository root: its operator/ shadows the stdlib's
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return [_finish(proc) for proc in procs]


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out


def test_two_gloo_ranks_exit_with_the_code_and_flushed_output(tmp_path: Path) -> None:
    script = tmp_path / "entry.py"
    script.write_text(SCRIPT)
    for code, out in _two_ranks([sys.executable, "-P", str(script), "dist", "75"], tmp_path):
        assert code == 75, out
        assert "trained" in out and "atexit ran" in out, out


# A stock script: it makes its own process group (as accelerate does for transformers' Trainer)
# and never destroys it. The wrapper must, before the process ends, whatever the script returns.
STOCK_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist

    _destroy = dist.destroy_process_group

    def _traced(*args, **kwargs):
        print("process group destroyed", flush=True)
        return _destroy(*args, **kwargs)

    dist.destroy_process_group = _traced
    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(4))
    print("trained", end="")
    if sys.argv[1] != "0":
        sys.exit(int(sys.argv[1]))
    """
)


@pytest.mark.parametrize(
    ("entry", "code"), [("trainer_runtime.hf.run", 0), ("trainer_runtime.distributed.worker", 3)]
)
def test_a_stock_scripts_process_group_is_destroyed_before_exit(
    tmp_path: Path, entry: str, code: int
) -> None:
    script = tmp_path / "stock.py"
    script.write_text(STOCK_SCRIPT)
    for exit_code, out in _two_ranks(
        [sys.executable, "-m", entry, str(script), str(code)], tmp_path
    ):
        assert exit_code == code, out
        assert "trained" in out and "process group destroyed" in out, out
