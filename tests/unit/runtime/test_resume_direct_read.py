"""A Trainer resume from a cold checkpoint reads the optimizer file with O_DIRECT into the buffer
prepared while the model file is read (issue 38.5), and the run stays bit-identical to an
uninterrupted one; with ``PREEMPTIBLE_DIRECT_READ=0`` or a warm file it reads through the page
cache, also bit-identical."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainer_runtime.checkpoint import io
from trainer_runtime.checkpoint.direct_read import ENV, open_direct
from trainer_runtime.checkpoint.model_state import OPTIMIZER_NAME
from trainer_runtime.protocol import ENV_ATTEMPT, ENV_OUTPUT_DIR, ENV_RESUME_FROM
from trainer_runtime.testing import drop_from_page_cache

from ..builders import StopAt
from .test_resume import assert_same_training, make_trainer

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT here")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (ENV_OUTPUT_DIR, ENV_RESUME_FROM, ENV_ATTEMPT, ENV):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(("cold", "switch", "direct"), [
    (True, None, True), (True, "0", False), (False, None, False),
])  # fmt: skip
def test_a_cold_resume_reads_the_optimizer_directly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cold: bool, switch: str | None, direct: bool
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    opened: dict[str, bool] = {}

    def spy(path: str, size: int) -> int | None:
        fd = open_direct(path, size)
        opened[os.path.basename(path)] = fd is not None
        return fd

    monkeypatch.setattr(io, "open_direct", spy)
    full = make_trainer(tmp_path / "full")
    full.train()
    first = make_trainer(tmp_path / "run")
    first.add_callback(StopAt(5))
    first.train()
    if cold:
        drop_from_page_cache(tmp_path / "run")
    else:
        for path in (tmp_path / "run").rglob(OPTIMIZER_NAME):
            path.read_bytes()
    if switch is not None:
        monkeypatch.setenv(ENV, switch)
    opened.clear()
    resumed = make_trainer(tmp_path / "run")
    resumed.train(resume_from_checkpoint=True)
    assert_same_training(full, resumed)
    assert opened == {OPTIMIZER_NAME: direct}
