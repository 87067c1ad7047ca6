"""The pure decisions of the transformers integration's JIT stops (trainer_runtime/hf/stops.py)."""

from __future__ import annotations

import pytest

from trainer_runtime.hf.stops import (
    EvaluationAbandoned,
    best_copy,
    deadline_message,
    stop_policy,
    superseded_copies,
)


class _Args:
    def __init__(self, **kw: object) -> None:
        self.__dict__.update(kw)


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (_Args(), {}, "finish_step"),  # stock TrainingArguments: no field
        (_Args(), {"PREEMPTIBLE_STOP_POLICY": "micro_batch"}, "micro_batch"),
        (_Args(jit_stop_policy="micro_batch"), {}, "micro_batch"),  # ours: the field wins
        (
            _Args(jit_stop_policy="finish_step"),
            {"PREEMPTIBLE_STOP_POLICY": "micro_batch"},
            "finish_step",
        ),
        (_Args(jit_stop_policy=None), {"PREEMPTIBLE_STOP_POLICY": " Micro_Batch "}, "micro_batch"),
        (_Args(), {"PREEMPTIBLE_STOP_POLICY": "whenever"}, "finish_step"),  # unknown: the safe one
    ],
)
def test_stop_policy(args: _Args, env: dict[str, str], expected: str) -> None:
    assert stop_policy(args, env) == expected


@pytest.mark.parametrize(
    ("names", "best", "expected"),
    [
        ([], None, []),
        (["checkpoint-4", "checkpoint-8"], None, ["checkpoint-4", "checkpoint-8"]),
        (
            ["checkpoint-8", "checkpoint-4", "checkpoint-12"],
            "checkpoint-8",
            ["checkpoint-12", "checkpoint-4"],
        ),
        # not a checkpoint directory: never touched (runs/, a user's file, hp-search run dirs)
        (["runs", "checkpoint-4", "notes.txt", "run-3"], "checkpoint-4", []),
        (["checkpoint-4"], "checkpoint-4", []),
    ],
)
def test_superseded_copies(names: list[str], best: str | None, expected: list[str]) -> None:
    assert superseded_copies(names, best) == expected


@pytest.mark.parametrize(
    ("best", "resumed", "expected"),
    [
        (None, "/s/run/checkpoint-10", None),
        ("", "/s/run/checkpoint-10", None),
        # the old pod's scratch path: the same name next to the resumed copy on this pod
        (
            "/old/pod/run/checkpoint-4",
            "/s/run/checkpoint-10",
            ("checkpoint-4", "/s/run/checkpoint-4"),
        ),
        (
            "/old/pod/run/checkpoint-4/",
            "/s/run/checkpoint-10/",
            ("checkpoint-4", "/s/run/checkpoint-4"),
        ),
        # the best one is the resumed one
        (
            "/old/run/checkpoint-10",
            "/s/run/checkpoint-10",
            ("checkpoint-10", "/s/run/checkpoint-10"),
        ),
        ("/old/run/final-model", "/s/run/checkpoint-10", None),  # not a checkpoint directory
    ],
)
def test_best_copy(best: str | None, resumed: str, expected: tuple[str, str] | None) -> None:
    assert best_copy(best, resumed) == expected


def test_deadline_message_names_the_times_and_the_newest_checkpoint() -> None:
    text = deadline_message(
        save_seconds=2.5,
        seconds_left=0.75,
        grace_seconds=1.5,
        node_notice_seconds=None,
        step=7,
        last_complete=4,
    )
    assert text.startswith("deadline too short: the longest save took 2.50 s but 0.75 s")
    assert "grace 1.5 s" in text and "at step 7" in text and "is step 4" in text
    assert "no time" in deadline_message(
        save_seconds=1.0,
        seconds_left=None,
        grace_seconds=None,
        node_notice_seconds=None,
        step=1,
        last_complete=None,
    )


def test_an_abandoned_evaluation_is_not_an_exception_a_script_would_swallow() -> None:
    assert not issubclass(EvaluationAbandoned, Exception)
    assert not issubclass(EvaluationAbandoned, SystemExit)  # never an exit code of its own
