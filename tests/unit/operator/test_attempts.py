"""What an ended attempt resumed from: the runtime's report wins over the operator's choice."""

from __future__ import annotations

import pytest

from preemptible_operator.attempts import (
    ResumedFrom,
    fallback_message,
    reported_checkpoint_step,
    resumed_from,
)
from trainer_runtime.protocol import TerminationMessage


def _msg(path: str | None = None, step: int | None = None) -> TerminationMessage:
    return TerminationMessage(reason="preempted", step=9, resumed_from=path, resumed_from_step=step)


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ([], None),
        ([_msg()], None),  # a fresh start, or a runtime that does not say
        ([_msg("/c/checkpoint-4", 4)], ResumedFrom("/c/checkpoint-4", 4)),
        # pods in rank order: the first that says (every rank loads the same checkpoint)
        ([_msg(), _msg("/c/checkpoint-4", 4)], ResumedFrom("/c/checkpoint-4", 4)),
        ([_msg("/c/checkpoint-4", None)], None),  # a path without its step is not trusted
    ],
)
def test_resumed_from(messages: list[TerminationMessage], expected: ResumedFrom | None) -> None:
    assert resumed_from(messages) == expected


@pytest.mark.parametrize(
    ("asked", "asked_step", "loaded", "warns"),
    [
        # asked for 6, loaded 4: the runtime fell back from a corrupt checkpoint
        ("/c/checkpoint-6", 6, ResumedFrom("/c/checkpoint-4", 4), True),
        ("latest", 6, ResumedFrom("/c/checkpoint-4", 4), True),
        # loaded what was asked, or newer (latest resolved by the runtime to a newer one)
        ("/c/checkpoint-6", 6, ResumedFrom("/c/checkpoint-6", 6), False),
        ("latest", 6, ResumedFrom("/c/checkpoint-7", 7), False),
        # the operator could not see storage (no expected step): nothing to compare
        ("latest", None, ResumedFrom("/c/checkpoint-4", 4), False),
        ("/c/checkpoint-6", 6, None, False),
    ],
)
def test_fallback_message(
    asked: str, asked_step: int | None, loaded: ResumedFrom | None, warns: bool
) -> None:
    text = fallback_message(3, asked, asked_step, loaded)
    assert (text is not None) is warns
    if text is not None and loaded is not None:
        assert "attempt 3" in text and loaded.path in text and f"step {asked_step}" in text


@pytest.mark.parametrize(
    ("step", "checkpoint", "expected"),
    [
        (5, "/c/run/checkpoint-5", 5),  # a JIT save at the step reached
        # a peer gone at step 7: the newest complete checkpoint it holds is 5, not 7
        (7, "/c/run/checkpoint-5", 5),
        (7, "s3://bucket/run/checkpoint-5/", 5),
        (7, "/c/run/odd-name", 7),  # not our layout: the message's step
    ],
)
def test_reported_checkpoint_step(step: int, checkpoint: str, expected: int) -> None:
    msg = TerminationMessage(reason="failed", step=step, checkpoint=checkpoint, complete=True)
    assert reported_checkpoint_step(msg) == expected
