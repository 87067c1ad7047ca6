"""resume_checkpoint: what PREEMPTIBLE_RESUME_FROM the next attempt gets."""

from __future__ import annotations

import pytest

from preemptible_operator.models import CheckpointRef
from preemptible_operator.resume import LATEST, resume_checkpoint

C7 = CheckpointRef(step=7, path="/c/checkpoint-7")
C9 = CheckpointRef(step=9, path="/c/checkpoint-9")


@pytest.mark.parametrize(
    ("attempt", "readable", "storage", "reported", "resume_from", "step"),
    [
        (1, True, None, None, "", 0),
        (2, True, C7, C9, "/c/checkpoint-7", 7),  # storage is verified; reports are not
        (2, True, None, C9, "", 0),  # storage says nothing is complete
        (1, False, None, None, "", 0),
        (2, False, None, C9, LATEST, 9),
        (3, False, None, None, LATEST, None),
        (1, False, None, C7, LATEST, 7),
    ],
)
def test_resume_checkpoint(
    attempt: int,
    readable: bool,
    storage: CheckpointRef | None,
    reported: CheckpointRef | None,
    resume_from: str,
    step: int | None,
) -> None:
    choice = resume_checkpoint(attempt, readable, storage, reported)
    assert (choice.resume_from, choice.step) == (resume_from, step), choice.source
