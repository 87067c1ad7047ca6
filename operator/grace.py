"""Grace period decisions of the operator, on top of trainer_runtime.grace (the shared rule)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from preemptible_operator.models import GracePeriodSpec, Timings
from trainer_runtime.grace import GracePolicy, GraceRecommendation, recommend_grace

__all__ = [
    "GraceDecision",
    "grace_sufficiency",
    "next_grace",
    "policy_from_spec",
]


def policy_from_spec(spec: GracePeriodSpec) -> GracePolicy:
    """The runtime's GracePolicy for a TrainingJob's spec.gracePeriod."""
    return GracePolicy(
        initial_seconds=spec.initial_seconds,
        minimum=spec.min,
        maximum=spec.max,
        headroom=spec.headroom,
        kill_wait=spec.kill_wait_seconds,
        exit_margin=spec.exit_margin,
        stop_policy=spec.stop_policy,
    )


@dataclass(frozen=True)
class GraceDecision:
    """Grace for the next attempt and what the measurements say is needed."""

    seconds: int
    """What the next attempt gets (pinned, or the rule's recommendation)."""
    required: int | None
    """What the measurements need (unclamped); None before any measurement."""
    reason: str
    inputs: dict[str, float]


def next_grace(
    spec: GracePeriodSpec, timings: Timings | None, killed_at_grace: int | None = None
) -> GraceDecision:
    """Grace for the next attempt.

    ``timings``: the maxima measured so far (step, save, SIGTERM-to-exit). ``killed_at_grace``:
    the grace of the last attempt when one of its containers was SIGKILLed at the deadline. It
    needed more than that, so it counts as an observed exit time, and the automatic grace at
    least doubles (bounded by max, and by spec.nodeNoticeSeconds: a node that gives a fixed
    notice does not wait longer, whatever the pod asks). Under stopPolicy micro_batch the rule's
    step term is the longest micro-batch (``timings.micro_batch_seconds_max``).
    """
    t = timings or Timings()
    observed = t.sigterm_to_exit_seconds_max
    if killed_at_grace is not None:
        observed = max(observed or 0.0, float(killed_at_grace))
    rec: GraceRecommendation = recommend_grace(
        t.step_seconds_max,
        t.save_seconds_max,
        observed,
        policy_from_spec(spec),
        micro_batch_max=t.micro_batch_seconds_max,
    )
    measured = any(v is not None for v in (t.step_seconds_max, t.save_seconds_max, observed))
    required = rec.required_seconds if measured else None
    seconds, reason = rec.seconds, rec.reason
    if killed_at_grace is not None:
        doubled = min(2 * killed_at_grace, spec.max)
        if spec.node_notice_seconds is not None and doubled > spec.node_notice_seconds:
            # Doubling past the node's notice buys nothing on a spot reclaim.
            doubled = max(killed_at_grace, spec.node_notice_seconds)
        if doubled > seconds:
            seconds, reason = doubled, f"{reason}; SIGKILLed at {killed_at_grace} s: doubled"
        required = max(required or 0, seconds)
    if spec.seconds is not None:
        reason = f"pinned by spec.gracePeriod.seconds ({spec.seconds} s); rule says: {reason}"
        seconds = spec.seconds
    inputs = {
        k: float(v)
        for k, v in {
            "stepMax": t.step_seconds_max,
            "saveMax": t.save_seconds_max,
            "observedExitMax": observed,
            "killWait": spec.kill_wait_seconds,
            "headroom": spec.headroom,
            "microBatchMax": t.micro_batch_seconds_max,
            "nodeNotice": spec.node_notice_seconds,
        }.items()
        if v is not None and math.isfinite(float(v))
    }
    return GraceDecision(seconds=seconds, required=required, reason=reason, inputs=inputs)


def grace_sufficiency(current: int | None, decision: GraceDecision) -> tuple[bool, str]:
    """(sufficient, message) for condition GracePeriodSufficient of the running attempt."""
    if current is None:
        return True, "no attempt yet"
    if decision.required is None:
        return True, f"grace {current} s; nothing measured yet"
    if current >= decision.required:
        return True, f"grace {current} s covers the measured need of {decision.required} s"
    return False, (
        f"grace {current} s is below the measured need of {decision.required} s "
        f"({decision.reason}); a pod's grace cannot change while it runs, so the next attempt "
        f"gets {decision.seconds} s"
    )
