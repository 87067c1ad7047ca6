"""The JIT stop decisions against the deadline (trainer_runtime.deadline), as tables."""

from __future__ import annotations

import pytest

from trainer_runtime.deadline import Action, deadline_budget, micro_batch_action, save_action
from trainer_runtime.signals import SigtermLatch

DROP, GO = Action.DROP_STEP, Action.CONTINUE


@pytest.mark.parametrize(
    ("policy", "acting", "left", "batches_left", "per_batch", "save", "expected"),
    [
        # no SIGTERM acted on yet (none, or kill_wait running): always go on
        ("micro_batch", False, 5.0, 3, 1.0, 1.0, GO),
        ("finish_step", False, 0.1, 3, 1.0, 1.0, GO),
        # micro_batch: the next boundary after kill_wait always drops the step
        ("micro_batch", True, None, 3, None, None, DROP),
        ("micro_batch", True, 100.0, 1, 0.1, 0.1, DROP),
        # finish_step: finish when the rest of the step + the save fit
        ("finish_step", True, 10.0, 3, 2.0, 3.0, GO),  # 6 + 3 = 9 <= 10
        ("finish_step", True, 8.0, 3, 2.0, 3.0, DROP),  # 9 > 8
        ("finish_step", True, 9.0, 3, 2.0, 3.0, GO),  # exactly fits
        ("finish_step", True, 5.0, 1, 2.0, None, GO),  # save unknown: counted 0
        ("finish_step", True, 1.0, 1, 2.0, None, DROP),
        # nothing to decide with: finish the step, as the policy says
        ("finish_step", True, None, 3, 2.0, 3.0, GO),  # no deadline known
        ("finish_step", True, 1.0, 3, None, 3.0, GO),  # no micro-batch measured
        # past the deadline already: drop (the save may still fit a longer node notice)
        ("finish_step", True, -1.0, 2, 0.5, 0.5, DROP),
        # last micro-batch: nothing left to drop (the step ends anyway)
        ("micro_batch", True, 1.0, 0, 1.0, 1.0, GO),
    ],
)
def test_micro_batch_action(
    policy: str,
    acting: bool,
    left: float | None,
    batches_left: int,
    per_batch: float | None,
    save: float | None,
    expected: Action,
) -> None:
    got = micro_batch_action(
        policy=policy,  # type: ignore[arg-type]
        acting=acting,
        seconds_left=left,
        micro_batches_left=batches_left,
        micro_batch_seconds=per_batch,
        save_seconds=save,
    )
    assert got == expected


@pytest.mark.parametrize(
    ("left", "save", "expected"),
    [
        (10.0, 3.0, Action.CONTINUE),
        (3.0, 3.0, Action.CONTINUE),
        (2.9, 3.0, Action.SKIP_SAVE),
        (-0.5, 0.1, Action.SKIP_SAVE),
        (None, 3.0, Action.CONTINUE),  # no deadline known
        (1.0, None, Action.CONTINUE),  # never saved: nothing says it cannot fit
        (float("inf"), 3.0, Action.CONTINUE),
    ],
)
def test_save_action(left: float | None, save: float | None, expected: Action) -> None:
    assert save_action(seconds_left=left, save_seconds=save) == expected


def test_actions_are_ordered_by_urgency() -> None:
    # Ranks agree with an all-reduce MAX: the most urgent wish must be the largest.
    assert Action.CONTINUE < Action.DROP_STEP < Action.SKIP_SAVE


@pytest.mark.parametrize(
    ("grace", "notice", "expected"),
    [
        (60.0, None, 60.0),
        (None, 30.0, 30.0),
        (243.0, 30.0, 30.0),
        (20.0, 30.0, 20.0),
        (None, None, None),
    ],
)
def test_deadline_is_the_shorter_of_grace_and_node_notice(
    grace: float | None, notice: float | None, expected: float | None
) -> None:
    assert deadline_budget(grace, notice) == expected
    now = [100.0]
    latch = SigtermLatch(
        kill_wait=0, grace_seconds=grace, node_notice_seconds=notice, clock=lambda: now[0]
    )
    latch.trigger()
    now[0] = 105.0
    left = latch.seconds_left()
    assert left == (None if expected is None else expected - 5.0)


def test_node_notice_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREEMPTIBLE_NODE_NOTICE_SECONDS", "30")
    monkeypatch.setenv("PREEMPTIBLE_GRACE_SECONDS", "243")
    latch = SigtermLatch(kill_wait=0)
    assert latch.node_notice_seconds == 30.0 and latch.budget_seconds == 30.0
