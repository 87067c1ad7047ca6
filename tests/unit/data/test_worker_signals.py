"""DataLoader workers and SIGTERM (trainer_runtime/data/worker_signals.py), with real worker
processes and real signals: a SIGTERM from anyone but the training process is ignored, the
parent's still ends a worker at once, the user's ``worker_init_fn`` is kept, and workers still end
when the iterator shuts down, at interpreter exit (persistent workers) and when the parent dies.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from trainer_runtime.data.worker_signals import (
    SigtermShieldedInit,
    is_shielded,
    shield_dataloader,
    shield_prepared_dataloaders,
    shielded_worker_init_fn,
)

_INIT_MARK: dict[str, int] = {}


def _user_init(worker_id: int) -> None:
    _INIT_MARK["worker"] = worker_id + 100


class _Slow(Dataset):
    """Each item sleeps a little (so a signal lands while workers are busy) and says which
    worker made it and what the user's init left there."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, Any]:
        time.sleep(0.05)
        return {"i": torch.tensor(i), "mark": torch.tensor(_INIT_MARK.get("worker", -1))}


def _loader(**kw: Any) -> DataLoader:
    return DataLoader(_Slow(), batch_size=2, num_workers=2, **kw)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_worker_survives_a_sigterm_from_another_process() -> None:
    loader = shield_dataloader(_loader())
    it = iter(loader)
    batches = [next(it)]
    pids = [w.pid for w in it._workers]  # type: ignore[attr-defined]
    # Not the parent: a separate process sends it, as torchrun's killpg or dumb-init would.
    subprocess.run(["kill", "-TERM", *map(str, pids)], check=True)
    time.sleep(0.3)
    batches += list(it)  # unshielded: "DataLoader worker (pid N) is killed by signal: Terminated"
    assert [int(i) for b in batches for i in b["i"]] == list(range(16))


_SLOW_START = {"seconds": 0.0}


def _slow_start() -> None:
    # In every forked child: the seconds the parent set before forking (0 outside the test below).
    time.sleep(_SLOW_START["seconds"])


os.register_at_fork(after_in_child=_slow_start)


def test_a_sigterm_before_the_shield_runs_waits_for_it() -> None:
    """A worker that takes long to reach its worker_init_fn: the SIGTERM lands before the shield
    (and before torch's own handler) and must wait for it, not kill the worker."""
    loader = shield_dataloader(_loader())
    _SLOW_START["seconds"] = 1.5
    try:
        it = iter(loader)
    finally:
        _SLOW_START["seconds"] = 0.0
    pids = [w.pid for w in it._workers]  # type: ignore[attr-defined]
    subprocess.run(["kill", "-TERM", *map(str, pids)], check=True)  # still starting
    assert [int(i) for b in it for i in b["i"]] == list(range(16))


def test_the_parents_sigterm_still_ends_a_worker_at_once() -> None:
    it = iter(shield_dataloader(_loader(persistent_workers=True)))
    next(it)
    worker = it._workers[0]  # type: ignore[attr-defined]
    os.kill(worker.pid, signal.SIGTERM)  # from the parent: torch's rule, exit 0
    worker.join(timeout=10)
    assert worker.exitcode == 0
    it._shutdown_workers()  # type: ignore[attr-defined]


def test_the_users_worker_init_fn_is_kept() -> None:
    loader = shield_dataloader(_loader(worker_init_fn=_user_init))
    assert is_shielded(loader.worker_init_fn)
    assert loader.worker_init_fn.user_fn is _user_init
    marks = {int(m) for b in loader for m in b["mark"]}
    assert marks == {100, 101}


@pytest.mark.parametrize(
    ("given", "user_fn"),
    [(None, None), (_user_init, _user_init), (SigtermShieldedInit(_user_init), _user_init)],
)
def test_shielded_worker_init_fn_wraps_once(given: Any, user_fn: Any) -> None:
    shielded = shielded_worker_init_fn(given)
    assert is_shielded(shielded) and shielded.user_fn is user_fn
    assert shielded_worker_init_fn(shielded) is shielded


def test_loaders_without_workers_and_other_objects_are_left_alone() -> None:
    loader = DataLoader(_Slow(), batch_size=2)
    assert shield_dataloader(loader).worker_init_fn is None
    assert shield_dataloader([1, 2]) == [1, 2]


def test_in_the_training_process_the_shield_never_blocks_sigterm() -> None:
    # Called by hand (or by thread workers): only the user's function runs.
    _INIT_MARK.clear()
    SigtermShieldedInit(_user_init)(3)
    assert _INIT_MARK["worker"] == 103
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_accelerator_prepare_shields_the_loader_it_returns() -> None:
    from accelerate import Accelerator

    accelerator = shield_prepared_dataloaders(Accelerator(cpu=True))
    assert shield_prepared_dataloaders(accelerator) is accelerator  # idempotent
    prepared = accelerator.prepare(_loader(worker_init_fn=_user_init))
    assert is_shielded(prepared.worker_init_fn), prepared.worker_init_fn
    assert prepared.worker_init_fn.user_fn is _user_init


_CHILD = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, {here!r})
    from test_worker_signals import _loader
    from trainer_runtime.data.worker_signals import shield_dataloader
    loader = shield_dataloader(_loader(persistent_workers=True))
    it = iter(loader)
    next(it)
    print(" ".join(str(w.pid) for w in it._workers), flush=True)
    if sys.argv[1] == "hang":
        time.sleep(600)
    # "exit": leave with the persistent iterator still referenced
    """
)


def _start_child(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[str], list[int]]:
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(here=str(Path(__file__).parent)))
    proc = subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2, pids
    return proc, pids


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_persistent_workers_end_when_the_training_process_exits(tmp_path: Path) -> None:
    proc, pids = _start_child(tmp_path, "exit")
    try:
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    assert not _wait_gone(pids, 10)


def test_workers_end_when_the_training_process_is_killed(tmp_path: Path) -> None:
    proc, pids = _start_child(tmp_path, "hang")
    try:
        # A forwarded SIGTERM first (ignored by the workers), then the parent dies by SIGKILL.
        subprocess.run(["kill", "-TERM", *map(str, pids)], check=True)
        time.sleep(0.3)
        assert all(_alive(p) for p in pids)
        proc.kill()
        proc.wait()
        # An orphan takes its SIGTERMs as torch would, and torch's watchdog ends it (5 s poll).
        assert not _wait_gone(pids, 20)
    finally:
        proc.kill()
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
