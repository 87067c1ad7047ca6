"""The exit budget (issue 37): the launcher's margin after torchrun's shutdown timeout, and a
torchrun worker's deadline, which is that timeout when it comes before the grace's end."""

from __future__ import annotations

import pytest

from trainer_runtime.deadline import (
    deadline_budget,
    launcher_margin,
    torchrun_shutdown_timeout,
)
from trainer_runtime.signals import SigtermLatch, launcher_timeout_from_env


@pytest.mark.parametrize(
    ("grace", "margin", "timeout"),
    [
        (5, 2.0, 3),  # a short grace: at least 2 s for the message
        (20, 2.0, 18),
        (30, 3.0, 27),  # a tenth
        (77, 5.0, 72),  # at most 5 s
        (3600, 5.0, 3595),
        (1, 2.0, 1),  # never 0: torchrun would SIGKILL at once
    ],
)
def test_launcher_margin_and_torchrun_timeout(grace: float, margin: float, timeout: int) -> None:
    assert launcher_margin(grace) == pytest.approx(margin)
    assert torchrun_shutdown_timeout(grace) == timeout


@pytest.mark.parametrize(
    ("grace", "notice", "launcher", "expected"),
    [
        (60.0, None, None, 60.0),
        (60.0, 30.0, None, 30.0),
        (60.0, None, 55.0, 55.0),  # a torchrun worker: SIGKILLed at its agent's timeout
        (60.0, 20.0, 55.0, 20.0),
        (None, None, 30.0, 30.0),  # no grace known, torchrun's default 30 s still is one
        (None, None, None, None),
    ],
)
def test_deadline_budget_counts_the_launchers_timeout(
    grace: float | None, notice: float | None, launcher: float | None, expected: float | None
) -> None:
    assert deadline_budget(grace, notice, launcher) == expected


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),  # not a torchrun worker
        ({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "18"}, None),  # set, but no torchrun around
        ({"TORCHELASTIC_RUN_ID": "x"}, 30.0),  # torchrun's default
        ({"TORCHELASTIC_RUN_ID": "x", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "18"}, 18.0),
        # the option's environment form wins, as in torchrun
        (
            {
                "TORCHELASTIC_RUN_ID": "x",
                "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "18",
                "PET_SHUTDOWN_TIMEOUT": "12",
            },
            12.0,
        ),
    ],
)
def test_launcher_timeout_from_env(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: float | None
) -> None:
    for name in ("TORCHELASTIC_RUN_ID", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "PET_SHUTDOWN_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert launcher_timeout_from_env() == expected


def test_a_torchrun_workers_latch_ends_at_the_agents_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "18")
    monkeypatch.delenv("PET_SHUTDOWN_TIMEOUT", raising=False)
    now = [100.0]
    latch = SigtermLatch(kill_wait=0.0, grace_seconds=20.0, clock=lambda: now[0])
    latch.trigger()
    now[0] += 5.0
    assert latch.seconds_left() == pytest.approx(13.0)
