"""Grace period decisions of the operator, on top of trainer_runtime.grace (the shared rule)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from preemptible_operator import conditions as cond
from preemptible_operator import models
from preemptible_operator.conditions import Event, Reason
from preemptible_operator.models import GracePeriodSpec, Timings
from trainer_runtime.grace import GracePolicy, GraceRecommendation, recommend_grace

__all__ = [
    "GraceDecision",
    "GraceOutcome",
    "cap_grace",
    "grace_status",
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


def cap_grace(decision: GraceDecision, cap: int | None) -> GraceDecision:
    """``decision`` with its seconds clamped to the operator's ``--max-grace-seconds``."""
    if cap is None or decision.seconds <= cap:
        return decision
    return dataclasses.replace(
        decision,
        seconds=cap,
        reason=f"{decision.reason}; capped at {cap} s by the operator (--max-grace-seconds)",
    )


@dataclass(frozen=True)
class GraceOutcome:
    """status.gracePeriod's recommendation and condition GracePeriodSufficient."""

    grace_period: models.GraceStatus
    conditions: list[models.Condition]
    event: Event | None
    """A Warning when the grace turns (or stays, for a new reason) insufficient."""
    recommended: int
    """The next attempt's grace (also exported as a metric)."""


def grace_status(
    status: models.TrainingJobStatus,
    spec: models.TrainingJobSpec,
    max_grace_seconds: int | None,
    now: str,
    generation: int | None,
) -> GraceOutcome:
    """The next attempt's grace from the measurements so far, and whether the current (or last)
    attempt's grace sufficed: a kill at the grace deadline or a deadline too short to start a
    JIT save say no whatever the measurements."""
    last = (status.attempts or [])[-1] if status.attempts else None
    killed_grace = last.grace_seconds if last and last.killed and last.end_time else None
    decision = cap_grace(
        next_grace(spec.grace_period, status.timings, killed_grace), max_grace_seconds
    )
    gp = (status.grace_period or models.GraceStatus()).model_copy()
    gp.recommended = decision.seconds
    gp.reason = decision.reason
    gp.inputs = decision.inputs or None
    current = gp.current
    if last is not None and last.end_time is None:
        ok, message = grace_sufficiency(current, decision)
        reason = Reason.GRACE_SUFFICIENT if ok else Reason.GRACE_TOO_SHORT
    elif last is not None and last.reason == Reason.DEADLINE_TOO_SHORT:
        ok, reason = False, Reason.DEADLINE_TOO_SHORT
        message = (
            f"attempt {last.attempt} did not start its JIT save: it could not finish before "
            f"the deadline ({last.message}); the grace is not raised past what the node "
            "gives: save more often (status.checkpointInterval, spec.checkpoint.interval: auto)"
        )
    elif last is not None and last.killed:
        ok, reason = False, Reason.GRACE_KILLED
        message = (
            f"attempt {last.attempt} was SIGKILLed at its {last.grace_seconds} s grace "
            f"deadline; the next attempt gets {decision.seconds} s"
        )
    else:
        ok, message = grace_sufficiency(current, decision)
        reason = Reason.GRACE_SUFFICIENT if ok else Reason.GRACE_TOO_SHORT
    if decision.required is None and ok:
        reason = Reason.NOT_MEASURED
    before = cond.find_condition(status.conditions, cond.GRACE_PERIOD_SUFFICIENT)
    after = cond.set_condition(
        status.conditions,
        cond.GRACE_PERIOD_SUFFICIENT,
        "True" if ok else "False",
        reason,
        message,
        now,
        generation,
    )
    event: Event | None = None
    if not ok and (before is None or before.status != "False" or before.reason != reason):
        event = ("Warning", reason, message)
    return GraceOutcome(gp, after, event, decision.seconds)
