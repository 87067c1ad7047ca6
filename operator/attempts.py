"""What an ended attempt's runtime says it resumed from (pure).

The operator chooses the checkpoint an attempt resumes from (``PREEMPTIBLE_RESUME_FROM``), but
the runtime may load an earlier one: when the chosen checkpoint turns out corrupt on load, every
rank agrees to fall back to the newest complete checkpoint before it and marks the corrupt one
(docs/checkpoints.md, "Resume"). The termination message then carries ``resumed_from`` and
``resumed_from_step``; the attempt's record must say what was loaded, not what was asked for.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from trainer_runtime.checkpoint.layout import parse_step
from trainer_runtime.protocol import TerminationMessage

__all__ = ["ResumedFrom", "fallback_message", "reported_checkpoint_step", "resumed_from"]


@dataclass(frozen=True)
class ResumedFrom:
    """The checkpoint an attempt loaded, as its runtime reported it (a path inside the pod)."""

    path: str
    step: int


def resumed_from(messages: Iterable[TerminationMessage]) -> ResumedFrom | None:
    """The checkpoint the attempt loaded: the first message that names one (every rank loads
    the same one, since ranks agree on any fallback); None when no message says (a fresh start,
    an older runtime, or no message at all)."""
    for msg in messages:
        if msg.resumed_from and msg.resumed_from_step is not None:
            return ResumedFrom(msg.resumed_from, int(msg.resumed_from_step))
    return None


def fallback_message(
    attempt: int, asked: str | None, asked_step: int | None, loaded: ResumedFrom | None
) -> str | None:
    """The Warning to record when the attempt loaded another checkpoint than the operator
    chose (``asked`` as PREEMPTIBLE_RESUME_FROM: a path, or ``latest``), else None. ``latest``
    resolved by the runtime is not a fallback unless it landed below the step the operator
    expected (``asked_step``)."""
    if loaded is None or asked_step is None or loaded.step >= asked_step:
        return None
    return (
        f"attempt {attempt} was to resume from {asked or 'latest'} (step {asked_step}) but "
        f"loaded {loaded.path} (step {loaded.step}): the newer checkpoint was corrupt, so the "
        f"runtime marked it (checkpoint-is-corrupt.txt) and fell back; steps {loaded.step}-"
        f"{asked_step} were trained again"
    )


def reported_checkpoint_step(msg: TerminationMessage) -> int:
    """The step of the checkpoint a termination message names: from its directory name
    (``checkpoint-N``). ``msg.step`` is the step the process reached, which is newer than its
    newest complete checkpoint when it stopped without a JIT save (a failure, a peer gone)."""
    step = parse_step(msg.checkpoint or "")
    return msg.step if step is None else step
