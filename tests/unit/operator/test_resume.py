"""resume_checkpoint: what PREEMPTIBLE_RESUME_FROM the next attempt gets; attempt_fence: the
PREEMPTIBLE_ATTEMPT value that keeps increasing across re-created TrainingJobs."""

from __future__ import annotations

import pytest

from preemptible_operator.models import CheckpointRef
from preemptible_operator.resume import FENCE_STRIDE, LATEST, attempt_fence, resume_checkpoint

C7 = CheckpointRef(step=7, path="/c/checkpoint-7")
C9 = CheckpointRef(step=9, path="/c/checkpoint-9")


@pytest.mark.parametrize(
    ("seen", "storage", "reported", "resume_from", "step"),
    [
        (True, C9, C7, "/c/checkpoint-9", 9),  # storage is newer than the last report
        (True, C9, None, "/c/checkpoint-9", 9),  # a re-created job over its old checkpoints
        (True, C9, C9, "/c/checkpoint-9", 9),  # a tie: storage's verified path
        # The listing missed the newest JIT checkpoint: the operator's view is not the newest,
        # and the report may not be either; the runtime looks (at least step 9 expected).
        (True, C7, C9, LATEST, 9),
        # Seen without a complete checkpoint (another volume than the pods'?): the runtime looks.
        (True, None, C9, LATEST, 9),
        # Seen empty, nothing reported: the runtime looks (it starts fresh over an empty
        # root); the operator never forces a fresh start, not even for a first attempt.
        (True, None, None, LATEST, None),
        # Not visible (unmapped, missing, unreadable, timed out): the runtime decides. A report
        # alone is never sent as a path (issue 37: checkpoint-80 was sent, checkpoint-120 was
        # complete on the volume, and 40 steps were trained twice).
        (False, None, None, LATEST, None),
        (False, None, C9, LATEST, 9),
        (False, None, C7, LATEST, 7),
    ],
)
def test_resume_checkpoint(
    seen: bool,
    storage: CheckpointRef | None,
    reported: CheckpointRef | None,
    resume_from: str,
    step: int | None,
) -> None:
    choice = resume_checkpoint(seen, storage, reported)
    assert (choice.resume_from, choice.step) == (resume_from, step), choice.source


@pytest.mark.parametrize(
    ("created", "attempt", "fence"),
    [
        (None, 3, 3),
        ("", 1, 1),
        ("not a time", 2, 2),
        ("1970-01-01T00:00:10Z", 1, 10 * FENCE_STRIDE + 1),
        ("2026-12-01T17:00:00Z", 5, 1796144400 * FENCE_STRIDE + 5),
    ],
)
def test_attempt_fence(created: str | None, attempt: int, fence: int) -> None:
    assert attempt_fence(created, attempt) == fence


def test_a_recreated_job_fences_above_every_attempt_of_the_old_one() -> None:
    old = [attempt_fence("2026-12-01T17:00:00Z", n) for n in range(1, 500)]
    new = attempt_fence("2026-12-01T17:00:01Z", 1)
    assert new > max(old)
    assert old == sorted(old)
    assert max(old) < 2**53
