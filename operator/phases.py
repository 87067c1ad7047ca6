"""The TrainingJob state machine as one pure function: observations in, phase and action out."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from preemptible_operator.classify import Interruption
from preemptible_operator.conditions import Reason
from preemptible_operator.models import Phase, Progress, Timings
from preemptible_operator.timestamps import parse_rfc3339

__all__ = [
    "MAX_ATTEMPT_RECORDS",
    "TERMINAL_PHASES",
    "Action",
    "Decision",
    "PhaseInputs",
    "backoff_seconds",
    "bound_attempts",
    "deadline_remaining",
    "estimate_progress",
    "next_attempt_number",
    "next_phase",
    "ttl_remaining",
]

T = TypeVar("T")

TERMINAL_PHASES: frozenset[str] = frozenset({"Succeeded", "Failed"})

Action = Literal[
    "none",  # observe only (status still refreshed)
    "fail_invalid",  # spec is semantically invalid: Failed/InvalidSpec, stop any attempt
    "fail",  # activeDeadlineSeconds passed: Failed, stop the attempt and drop its Job
    "create_attempt",  # create the next attempt's Job (after cleaning up the previous one)
    "stop_attempt",  # the user suspended: delete the attempt's pods gracefully (JIT checkpoint)
    "deactivate_workload",  # Kueue evicted: never let it re-admit this attempt
    "stop_previous",  # an earlier attempt's pods or Job may still run: stop them first
    "record_attempt",  # the attempt is over and its pods are gone: record it
    "wait_backoff",  # a failure restart is due later
    "finish",  # terminal: release what is left (pod finalizers)
    "cleanup",  # suspended: release what is left
]


@dataclass(frozen=True)
class PhaseInputs:
    """What one reconcile pass observed."""

    invalid: bool = False
    current_phase: str | None = None
    suspend: bool = False
    attempt: int = 0
    """Current attempt number (0: none yet)."""
    recorded_outcome: str | None = None
    """Outcome recorded for the current attempt (None while it is not over)."""
    recorded_reason: str | None = None
    """Reason recorded for the current attempt (None while it is not over)."""
    job_exists: bool = False
    job_suspended: bool = False
    interruption: Interruption = field(
        default_factory=lambda: Interruption("Active", Reason.STARTED)
    )
    pods_finished: bool = True
    """Every pod of the current attempt finished (vacuously true without pods)."""
    pods: int = 0
    running_pods: int = 0
    failures: int = 0
    max_restarts: int = 0
    backoff_remaining: float = 0.0
    kueue: bool = False
    pending_detail: str | None = None
    """Why the pods do not run yet (classify.pending_detail), shown while Pending."""
    spec_rejected: bool = False
    """The spec was edited into an invalid one after the job had run: hold (no new attempt,
    even when the running attempt's spec is at hand) until it is fixed, never fail for it."""
    previous_pods_active: int = 0
    """Pods of an earlier TrainingJob of the same name (another uid) that may still run and
    write to the same checkpoint storage."""
    earlier_attempts_active: int = 0
    """Pods (not finished) and Jobs (able to start pods) of this TrainingJob's attempts before
    the one a create would make: a stale cache, a Job Kueue re-admitted during the backoff."""
    active_deadline_seconds: int | None = None
    """spec.activeDeadlineSeconds (None: no deadline)."""
    deadline_remaining: float | None = None
    """Seconds left before it (deadline_remaining); <= 0: it passed."""
    preemptions: int = 0
    """status.preemptions, the attempt just recorded included."""
    max_preemptions: int | None = None
    """spec.maxPreemptions (None: no limit)."""
    recorded_failure_action: str | None = None
    """What spec.failurePolicy decided for the current attempt when it failed (FailJob,
    Restart, Ignore)."""
    recorded_failure_rule: str | None = None
    """The failure-policy rule it matched (None: no rule matched)."""
    restart_window_seconds: int | None = None
    """failurePolicy.restartWindowSeconds: ``failures`` counts only that window."""


@dataclass(frozen=True)
class Decision:
    phase: Phase
    action: Action
    reason: str
    message: str = ""


MAX_ATTEMPT_RECORDS = 20
"""Attempt records kept in status.attempts (about 750 bytes each; an object may hold 1.5 MiB,
and a job preempted every hour for months would otherwise outgrow it)."""


def bound_attempts(attempts: list[T], keep: int = MAX_ATTEMPT_RECORDS) -> tuple[list[T], int]:
    """The newest ``keep`` records (the current attempt is always the newest) and how many older
    ones were dropped."""
    if keep < 1 or len(attempts) <= keep:
        return attempts, 0
    return attempts[-keep:], len(attempts) - keep


def next_attempt_number(attempt: int, recorded: bool) -> int:
    """The attempt a create makes: the next one once the current is recorded (or none exists),
    else the current one again (its Job was never created or was deleted before it ran)."""
    return attempt + 1 if (recorded or attempt == 0) else attempt


def backoff_seconds(base: int, failures: int, cap: int = 3600) -> int:
    """Exponential restart backoff: base, 2*base, 4*base... for failure 1, 2, 3..., capped."""
    if failures < 1 or base <= 0:
        return 0
    return min(cap, base * 2 ** (failures - 1))


def _seconds_left(since: str | None, seconds: int | None, now: float) -> float | None:
    start = parse_rfc3339(since)
    if seconds is None or start is None:
        return None
    return start + seconds - now


def deadline_remaining(
    start_time: str | None, deadline_seconds: int | None, now: float
) -> float | None:
    """Seconds left of spec.activeDeadlineSeconds, counted from status.startTime (the first
    attempt's creation); None without a deadline or before the first attempt."""
    return _seconds_left(start_time, deadline_seconds, now)


def ttl_remaining(
    phase: str | None, completion_time: str | None, ttl_seconds: int | None, now: float
) -> float | None:
    """Seconds before a finished TrainingJob is deleted (spec.ttlSecondsAfterFinished, counted
    from status.completionTime); <= 0: delete it now. None while it runs or without a TTL."""
    if phase not in TERMINAL_PHASES:
        return None
    return _seconds_left(completion_time, ttl_seconds, now)


def estimate_progress(
    progress: Progress | None, timings: Timings | None, phase: str | None
) -> Progress | None:
    """status.progress with progressPercentage and estimatedRemainingSeconds from the runtime's
    step / maxSteps and the measured mean step time (timings.stepSecondsEma)."""
    out = (progress or Progress()).model_copy()
    out.progress_percentage = None
    out.estimated_remaining_seconds = None
    step, total = out.step, out.max_steps
    ema = timings.step_seconds_ema if timings else None
    if phase == "Succeeded":
        out.progress_percentage, out.estimated_remaining_seconds = 100, 0
    elif step is not None and total is not None and total > 0:
        done = min(max(step, 0), total)
        out.progress_percentage = 100 * done // total
        if phase != "Failed" and ema is not None and ema >= 0:
            out.estimated_remaining_seconds = math.ceil((total - done) * ema)
    if progress is None and out == Progress():
        return None
    return out


def next_phase(obs: PhaseInputs) -> Decision:
    """Decide the phase and the one action of this pass (level-triggered: only observations).

    No attempt is created while pods of an earlier TrainingJob of the same name still run:
    they may be writing their JIT checkpoint to the same storage."""
    decision = _next_phase(obs)
    if decision.action == "create_attempt" and obs.spec_rejected:
        return Decision(
            "Requeueing" if obs.attempt else "Pending",
            "none",
            Reason.SPEC_CHANGE_REJECTED,
            "the spec was changed into an invalid one; fix it to continue",
        )
    if decision.action == "create_attempt" and obs.earlier_attempts_active:
        return Decision(
            decision.phase,
            "stop_previous",
            Reason.PREVIOUS_ATTEMPT_STOPPING,
            f"waiting for {obs.earlier_attempts_active} pod(s) or Job(s) of earlier attempts to "
            "stop before the next attempt starts (two attempts never write at once)",
        )
    if decision.action == "create_attempt" and obs.previous_pods_active:
        return Decision(
            "Pending",
            "none",
            Reason.PREVIOUS_PODS_STOPPING,
            f"waiting for {obs.previous_pods_active} pod(s) of an earlier TrainingJob of this "
            "name to stop before the next attempt starts",
        )
    return decision


def _next_phase(obs: PhaseInputs) -> Decision:
    if obs.current_phase in TERMINAL_PHASES:
        return Decision(obs.current_phase, "finish", Reason.COMPLETED)  # type: ignore[arg-type]
    if obs.invalid:
        return Decision("Failed", "fail_invalid", Reason.INVALID_SPEC)
    if _deadline_passed(obs):
        return _deadline_decision(obs)
    if obs.attempt == 0:
        if obs.suspend:
            return Decision(
                "Suspended", "none", Reason.SUSPENDED, "suspended before the first attempt"
            )
        return Decision("Pending", "create_attempt", Reason.ATTEMPT_CREATED)

    if obs.recorded_outcome is not None:
        outcome = obs.recorded_outcome
        if outcome == "Succeeded":
            return Decision("Succeeded", "finish", Reason.COMPLETED)
        if outcome == "Failed":
            if obs.recorded_failure_action == "FailJob":
                return Decision(
                    "Failed",
                    "finish",
                    Reason.FAILED_BY_POLICY,
                    f"attempt {obs.attempt} failed ({obs.recorded_reason}) and failurePolicy "
                    f"rule {obs.recorded_failure_rule or '?'} says FailJob",
                )
            if obs.failures > obs.max_restarts:
                window = (
                    f" in the last {obs.restart_window_seconds} s"
                    if obs.restart_window_seconds is not None
                    else ""
                )
                return Decision(
                    "Failed",
                    "finish",
                    Reason.RESTARTS_EXHAUSTED,
                    f"{obs.failures} failures{window}, maxRestarts is {obs.max_restarts}",
                )
            if obs.suspend:
                return Decision("Suspended", "cleanup", Reason.SUSPENDED)
            if obs.backoff_remaining > 0:
                return Decision(
                    "Requeueing",
                    "wait_backoff",
                    Reason.BACKOFF,
                    f"restart {obs.failures} of {obs.max_restarts} in "
                    f"{obs.backoff_remaining:.0f} s",
                )
            return Decision("Requeueing", "create_attempt", Reason.REQUEUED)
        if (
            outcome == "Preempted"
            and obs.max_preemptions is not None
            and obs.preemptions > obs.max_preemptions
        ):
            return Decision(
                "Failed",
                "finish",
                Reason.PREEMPTION_LIMIT_EXCEEDED,
                f"{obs.preemptions} preemptions, maxPreemptions is {obs.max_preemptions}",
            )
        if obs.suspend:
            if obs.recorded_reason == Reason.WORKLOAD_DEACTIVATED:
                return Decision(
                    "Suspended",
                    "cleanup",
                    Reason.WORKLOAD_DEACTIVATED,
                    "suspended because someone else deactivated the attempt's Kueue Workload; "
                    "set spec.suspend to false to resume with a new Workload",
                )
            return Decision("Suspended", "cleanup", Reason.SUSPENDED)
        reason = Reason.RESUMED if outcome == "Suspended" else Reason.REQUEUED
        return Decision("Requeueing", "create_attempt", reason)

    intr = obs.interruption
    if not obs.job_exists and not intr.over and obs.pods == 0:
        # Created in a pass that crashed before the Job existed, or deleted by someone: (re)create
        # the same attempt (deterministic name).
        return Decision("Pending", "create_attempt", Reason.ATTEMPT_CREATED)
    if intr.over:
        if obs.pods_finished:
            phase: Phase = {
                "Succeeded": "Succeeded",
                "Suspended": "Suspended",
            }.get(intr.outcome, "Requeueing")  # type: ignore[assignment]
            return Decision(phase, "record_attempt", intr.reason, intr.message)
        if intr.outcome == "Succeeded":
            return Decision("Running", "none", Reason.STARTED, "ranks are finishing")
        if intr.outcome == "Suspended":
            return Decision("Checkpointing", "stop_attempt", intr.reason, intr.message)
        if intr.reason in (Reason.KUEUE_PREEMPTED, Reason.KUEUE_EVICTED, Reason.PODS_NEVER_READY):
            return Decision("Checkpointing", "deactivate_workload", intr.reason, intr.message)
        if intr.reason == Reason.RESUMED_UNSEEN:
            # The restarted pods are deleted gracefully (JIT checkpoint); their Job then fails
            # (exit 75 is FailJob), so nothing admits this attempt again, Workload or not.
            return Decision("Checkpointing", "stop_attempt", intr.reason, intr.message)
        if intr.outcome == "Preempted":
            return Decision("Checkpointing", "none", intr.reason, intr.message)
        return Decision("Running", "none", intr.reason, f"stopping the other ranks: {intr.message}")
    if obs.suspend:
        return Decision("Checkpointing", "stop_attempt", Reason.SUSPENDED, "suspend requested")
    if obs.job_suspended:
        waiting = "waiting for Kueue admission" if obs.kueue else "Job suspended"
        return Decision("Queued", "none", Reason.QUEUED, waiting)
    if obs.running_pods > 0:
        return Decision("Running", "none", Reason.STARTED)
    return Decision(
        "Pending", "none", Reason.POD_PENDING, obs.pending_detail or "waiting for pods to start"
    )


def _deadline_passed(obs: PhaseInputs) -> bool:
    """activeDeadlineSeconds passed, and the job has not succeeded (an attempt that finished
    its training first is recorded as a success: the deadline never fails a finished job)."""
    if obs.deadline_remaining is None or obs.deadline_remaining > 0:
        return False
    if obs.recorded_outcome == "Succeeded":
        return False
    return not (obs.recorded_outcome is None and obs.interruption.outcome == "Succeeded")


def _deadline_decision(obs: PhaseInputs) -> Decision:
    """The deadline passed: a running attempt is stopped the normal way (its pods get SIGTERM
    and write their JIT checkpoint), recorded once its pods are gone (its end, checkpoint and
    lost steps, like a preemption), and only then is the job Failed: the finalizers that hold
    its pods are released after the record, never while they write."""
    base = (
        f"activeDeadlineSeconds ({obs.active_deadline_seconds}) passed since the first attempt "
        "started"
    )
    running = obs.attempt and obs.recorded_outcome is None and (obs.job_exists or obs.pods)
    if not running:
        return Decision("Failed", "fail", Reason.DEADLINE_EXCEEDED, f"{base}: the job is over")
    if not obs.pods_finished:
        return Decision(
            "Checkpointing",
            "stop_attempt",
            Reason.DEADLINE_EXCEEDED,
            f"{base}: stopping attempt {obs.attempt} (its pods write a checkpoint)",
        )
    return Decision(
        "Failed",
        "record_attempt",
        Reason.DEADLINE_EXCEEDED,
        f"{base}: attempt {obs.attempt} was stopped and recorded; the job is over",
    )
