"""The toy's injected failure is a real failure: exit 1, reason "failed" (the retry path)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.runtime.conftest import RUN_TIMEOUT, toy_args
from trainer_runtime.testing import ToyRun

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(300)]


def test_fail_at_step_exits_1_with_a_failed_termination_message(tmp_path: Path) -> None:
    run = ToyRun(tmp_path / "out", tmp_path, args=toy_args(extra=("--fail-at-step", "6"))).start()
    try:
        code = run.wait(RUN_TIMEOUT)
    finally:
        run.kill()
    assert code == 1, f"exit code {code}\n{run.tail()}"
    msg = run.termination_message()
    assert msg.reason == "failed", msg
    assert msg.message and "injected failure at step 6" in msg.message, msg
    assert msg.step == 5, msg  # steps 1..5 finished, step 6 raised
    assert list(run.steps_begun())[-1] == 6
