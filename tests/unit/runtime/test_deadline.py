"""The JIT stop decisions against the deadline (trainer_runtime.deadline), as tables."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer_runtime.deadline import (
    EXIT_TEARDOWN_SECONDS,
    UNMEASURED_POST_COMMIT_SECONDS,
    Action,
    DueSave,
    deadline_budget,
    due_save_action,
    exit_reserve,
    micro_batch_action,
    save_action,
)
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


@pytest.mark.parametrize(
    ("post_commit", "expected"),
    [
        # nothing measured yet: the floor (post-commit guess + teardown)
        (None, UNMEASURED_POST_COMMIT_SECONDS + EXIT_TEARDOWN_SECONDS),
        (float("nan"), UNMEASURED_POST_COMMIT_SECONDS + EXIT_TEARDOWN_SECONDS),
        # measured: the longest post-commit work plus the teardown no save measures
        (0.2, 0.2 + EXIT_TEARDOWN_SECONDS),
        (6.0, 6.0 + EXIT_TEARDOWN_SECONDS),  # slow rotation deletes on an object store
        (-1.0, EXIT_TEARDOWN_SECONDS),
    ],
)
def test_exit_reserve(post_commit: float | None, expected: float) -> None:
    assert exit_reserve(post_commit) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("left", "save", "exit_s", "expected"),
    [
        # the save fits, and so does what follows its commit
        (10.0, 3.0, 2.0, Action.CONTINUE),
        (5.0, 3.0, 2.0, Action.CONTINUE),  # exactly
        # fits only without the exit reserve: not started (the pod would die before its message)
        (4.0, 3.0, 2.0, Action.SKIP_SAVE),
        (3.0, 3.0, 0.5, Action.SKIP_SAVE),
        # a measured slow post-commit (6 s of rotation) weighs as much as the save
        (8.0, 1.0, 7.0, Action.CONTINUE),
        (7.9, 1.0, 7.0, Action.SKIP_SAVE),
        # unknown save or no deadline: nothing says it cannot fit
        (1.0, None, 2.0, Action.CONTINUE),
        (None, 3.0, 2.0, Action.CONTINUE),
    ],
)
def test_save_action_keeps_the_exit_reserve(
    left: float | None, save: float | None, exit_s: float, expected: Action
) -> None:
    assert save_action(seconds_left=left, save_seconds=save, exit_seconds=exit_s) == expected


@pytest.mark.parametrize(
    ("left", "exit_s", "expected"),
    [
        (12.0, 2.0, GO),  # 3 x 2 + 3 + 2 = 11 <= 12
        (10.0, 2.0, DROP),  # 11 > 10: the step fits with the save, not with the exit
        (9.0, 0.0, GO),  # without a reserve the old answer
    ],
)
def test_micro_batch_action_keeps_the_exit_reserve(
    left: float, exit_s: float, expected: Action
) -> None:
    got = micro_batch_action(
        policy="finish_step",
        acting=True,
        seconds_left=left,
        micro_batches_left=3,
        micro_batch_seconds=2.0,
        save_seconds=3.0,
        exit_seconds=exit_s,
    )
    assert got == expected


@pytest.mark.parametrize(
    ("jit", "sigterm", "finished", "expected"),
    [
        (True, 0, False, DueSave.PERIODIC),  # no SIGTERM: the periodic save
        (True, 2, False, DueSave.JIT_NOW),  # kill_wait over: this save is the stop's JIT save
        (True, 1, False, DueSave.DEFER),  # kill_wait running: left to the stop's JIT save
        (False, 2, False, DueSave.PERIODIC),  # JIT off: a periodic save as before
        (True, 2, True, DueSave.PERIODIC),  # the last step: the run completes (exit 0)
        (True, 1, True, DueSave.PERIODIC),
    ],
)
def test_due_save_action(jit: bool, sigterm: int, finished: bool, expected: DueSave) -> None:
    got = due_save_action(jit_enabled=jit, sigterm=sigterm, training_finished=finished)
    assert got is expected


def test_due_save_actions_are_ordered_by_urgency() -> None:
    # Ranks agree on the SIGTERM level with an all-reduce MAX
    assert DueSave.PERIODIC < DueSave.DEFER < DueSave.JIT_NOW


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


@pytest.mark.parametrize(
    ("content", "grace", "env_notice", "expected"),
    [
        # The node's notice (the operator's pod annotation, a downward-API file) shortens the
        # deadline like $PREEMPTIBLE_NODE_NOTICE_SECONDS does; the shortest of the three wins.
        ("15", 243.0, None, 15.0),
        ("15\n", 243.0, 30.0, 15.0),
        ("120", 243.0, 30.0, 30.0),
        ("120", 60.0, None, 60.0),
        ("15", None, None, 15.0),
        # Nothing known (kubelet writes an empty file for a missing annotation) or garbage.
        ("", 243.0, None, 243.0),
        ("", 243.0, 30.0, 30.0),
        ("soon", 243.0, None, 243.0),
        ("0", 243.0, None, 243.0),
        ("-3", 243.0, None, 243.0),
        (None, 243.0, None, 243.0),  # no file at all
    ],
)
def test_node_notice_file_shortens_the_deadline(
    tmp_path: Path,
    content: str | None,
    grace: float | None,
    env_notice: float | None,
    expected: float | None,
) -> None:
    path = tmp_path / "notice-seconds"
    now = [100.0]
    latch = SigtermLatch(
        kill_wait=0,
        grace_seconds=grace,
        node_notice_seconds=env_notice,
        node_notice_file=str(path),
        clock=lambda: now[0],
    )
    # Written after the process started (the operator annotates the pod once it is bound): the
    # file is read at SIGTERM, not at start.
    if content is not None:
        path.write_text(content)
    latch.trigger()
    now[0] = 102.0
    assert latch.budget_seconds == expected
    assert latch.seconds_left() == expected - 2.0
    # Read once: a later change (the pod is already terminating) no longer counts.
    path.write_text("1")
    assert latch.budget_seconds == expected


def test_node_notice_file_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "notice-seconds"
    path.write_text("15")
    monkeypatch.setenv("PREEMPTIBLE_NODE_NOTICE_FILE", str(path))
    monkeypatch.setenv("PREEMPTIBLE_GRACE_SECONDS", "243")
    latch = SigtermLatch(kill_wait=0)
    assert latch.budget_seconds == 243.0  # before the SIGTERM the file is not read
    latch.trigger()
    assert latch.budget_seconds == 15.0 and latch.node_notice_seconds == 15.0


def test_a_node_notice_shorter_than_the_save_skips_the_save(tmp_path: Path) -> None:
    """The DeadlineTooShort decision follows the file: a 2 s save does not fit a 1 s notice
    even with 243 s of grace, and is started with a 30 s notice."""
    for notice, action in (("1", Action.SKIP_SAVE), ("30", Action.CONTINUE)):
        path = tmp_path / f"notice-{notice}"
        path.write_text(notice)
        now = [0.0]
        latch = SigtermLatch(
            kill_wait=0,
            grace_seconds=243.0,
            node_notice_file=str(path),
            clock=lambda now=now: now[0],
        )
        latch.trigger()
        now[0] = 0.2
        assert save_action(seconds_left=latch.seconds_left(), save_seconds=2.0) == action
