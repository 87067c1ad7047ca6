"""What recording an ended attempt writes into the status: its record (outcome, end step, lost
steps, exit codes, the failure policy's verdict), the timings its pods report and the newest
complete checkpoint. Pure: the pass's working copy of the status and the record are updated in
place (as the pass's other status updates), and everything read (pods, storage, the time) is an
argument; metrics and Events are returned for the pass to post once its status write succeeded.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from preemptible_operator import conditions as cond
from preemptible_operator import models
from preemptible_operator.accounting import (
    attempt_end_step,
    attempt_lost_steps,
    attempt_ran,
    estimated_end_step,
    lost_contact_stopped_at,
    step_rate,
    training_stopped_at,
)
from preemptible_operator.attempts import (
    fallback_message,
    reported_checkpoint_step,
    resumed_from,
)
from preemptible_operator.checkpoint_store import StorageSnapshot
from preemptible_operator.classify import ContainerEnd, Interruption, container_end, killed_at_grace
from preemptible_operator.conditions import Reason
from preemptible_operator.failure_policy import (
    counted_failures,
    decide_failure,
    keep_failure_times,
)
from preemptible_operator.phases import backoff_seconds
from preemptible_operator.scrape import RuntimeMetrics
from preemptible_operator.timestamps import parse_rfc3339

__all__ = [
    "AttemptEnd",
    "apply_metrics",
    "apply_snapshot",
    "max_of",
    "pod_checkpoint_path",
    "record_attempt_end",
    "rfc3339",
    "rfc3339_ms",
    "snapshot_ref",
]

Event = tuple[str, str, str]


def rfc3339(ts: float) -> str:
    """``ts`` (seconds since the epoch) as the apiserver writes times."""
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def rfc3339_ms(ts: float) -> str:
    """``ts`` with milliseconds: a scrape's time, which a lost-steps estimate extrapolates from
    (a second is several steps of a fast job)."""
    moment = dt.datetime.fromtimestamp(ts, dt.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def max_of(*values: float | None) -> float | None:
    """The largest of the known ``values`` (None: none known)."""
    present = [v for v in values if v is not None]
    return max(present) if present else None


def pod_checkpoint_path(spec: models.TrainingJobSpec, reported: str) -> str:
    """The runtime reports the path it wrote; keep it when it is under the URI, else join."""
    uri = spec.checkpoint.uri.rstrip("/")
    if reported.startswith(uri) or "/" in reported:
        return reported
    return f"{uri}/{reported}"


def snapshot_ref(snapshot: StorageSnapshot | None) -> models.CheckpointRef | None:
    """The newest complete checkpoint storage shows (None: none seen, or not looked at)."""
    latest = snapshot.latest_complete if snapshot is not None else None
    if latest is None:
        return None
    return models.CheckpointRef(step=latest.step, path=snapshot.latest_complete_path)


def apply_snapshot(status: models.TrainingJobStatus, snapshot: StorageSnapshot) -> None:
    """What storage shows into the status: the newest complete checkpoint (never an older one
    than already known) with its save time, and the incomplete ones newer than it."""
    latest = snapshot.latest_complete
    current = status.last_complete_checkpoint
    # Never step back to an older checkpoint than one already known (reported by the runtime).
    if latest is not None and (current is None or latest.step >= current.step):
        status.last_complete_checkpoint = models.CheckpointRef(
            step=latest.step,
            path=snapshot.latest_complete_path,
            completed_at=latest.created_at,
            save_seconds=latest.save_seconds,
        )
        timings = status.timings or models.Timings()
        if latest.save_seconds is not None:
            timings.save_seconds_max = max_of(timings.save_seconds_max, latest.save_seconds)
            status.timings = timings
    status.incomplete_checkpoints = [
        models.IncompleteCheckpoint(step=info.step, path=path, reason=info.reason)
        for info, path in snapshot.incomplete
    ] or None


def apply_metrics(
    status: models.TrainingJobStatus,
    m: RuntimeMetrics | None,
    spec: models.TrainingJobSpec,
    attempt: int,
) -> None:
    """Rank 0's /metrics into the status: progress (whose step: ``attempt``), the timings'
    maxima and latest values, and a newer complete checkpoint than the one known. An
    unanswered scrape after one of this attempt's answered ones marks its record
    ``unreachableSince`` (kept until it answers again: the first failure is the bound)."""
    if m is None:
        return
    progress = status.progress or models.Progress()
    record = next((r for r in status.attempts or [] if r.attempt == attempt), None)
    if not m.answered:
        own = progress.attempt == attempt and progress.scraped_at is not None
        if own and m.scraped_at is not None and record is not None and record.end_time is None:
            record.unreachable_since = record.unreachable_since or rfc3339_ms(m.scraped_at)
        return
    if record is not None and record.end_time is None:
        record.unreachable_since = None
    step = m.int("step")
    if step is not None:
        own = progress.attempt == attempt
        if m.scraped_at is not None:
            # This attempt's training rate, for the estimate of what it did after its last
            # scrape should it end without a message (record_attempt_end).
            before = parse_rfc3339(progress.scraped_at) if own else None
            rate = step_rate(
                (progress.step, before) if before is not None and progress.step is not None
                else None,
                (step, m.scraped_at),
                progress.steps_per_second if own else None,
                m.get("step_seconds_ema") or None,
            )  # fmt: skip
            progress.scraped_at = rfc3339_ms(m.scraped_at)
            progress.steps_per_second = round(rate, 4) if rate is not None else None
        elif not own:
            progress.scraped_at = progress.steps_per_second = None
        progress.step = step
        progress.attempt = attempt  # whose step it is: see accounting.attempt_end_step
    if m.int("max_steps"):
        progress.max_steps = m.int("max_steps")
    if m.get("epoch") is not None:
        progress.epoch = round(m.get("epoch") or 0.0, 4)
    status.progress = progress
    t = status.timings or models.Timings()

    def measured(key: str) -> float | None:
        value = m.get(key)  # the runtime exports 0 before its first step / save
        return value if value is not None and value > 0 else None

    t.step_seconds_max = max_of(t.step_seconds_max, measured("step_seconds_max"))
    t.step_seconds_p99 = measured("step_seconds_p99") or t.step_seconds_p99
    t.step_seconds_ema = measured("step_seconds_ema") or t.step_seconds_ema
    t.save_seconds_max = max_of(t.save_seconds_max, measured("save_seconds_max"))
    t.save_seconds_last = measured("save_seconds_last") or t.save_seconds_last
    t.micro_batch_seconds_max = max_of(
        t.micro_batch_seconds_max, measured("micro_batch_seconds_max")
    )
    status.timings = t
    ckpt_step = m.int("last_complete_checkpoint_step")
    if ckpt_step is not None and ckpt_step > 0:
        current = status.last_complete_checkpoint
        if current is None or ckpt_step > current.step:
            status.last_complete_checkpoint = models.CheckpointRef(
                step=ckpt_step,
                path=f"{spec.checkpoint.uri.rstrip('/')}/checkpoint-{ckpt_step}",
            )


def _container_started(pod: dict[str, Any]) -> bool:
    """The training container's terminated state has a start (it ran, however briefly)."""
    for c in (pod.get("status") or {}).get("containerStatuses") or []:
        for state in (c.get("state") or {}, c.get("lastState") or {}):
            if (state.get("terminated") or {}).get("startedAt"):
                return True
    return False


@dataclass
class AttemptEnd:
    """What recording an ended attempt tells the pass besides the status."""

    events: list[Event] = field(default_factory=list)
    lost_steps: int = 0
    """Steps done after the newest complete checkpoint (counted once the status is written)."""
    preempted: str | None = None
    """The preemption's reason when the attempt was preempted (counted once written)."""
    sigterm_to_exit: float | None = None
    """Rank 0's SIGTERM-to-exit time (else the longest of any pod's), when measured."""


def record_attempt_end(
    status: models.TrainingJobStatus,
    record: models.AttemptRecord,
    spec: models.TrainingJobSpec,
    pods: list[dict[str, Any]],
    interruption: Interruption,
    snapshot: StorageSnapshot | None,
    now: str,
    now_s: float,
    generation: int | None,
) -> AttemptEnd:
    """Record the ended attempt ``record`` (an element of ``status.attempts``) from its pods'
    terminated states and messages, the storage ``snapshot`` (None: not looked at or not
    seen) and ``interruption``; for a failure, the failure policy's verdict and the restart
    backoff (status.nextAttemptAfter)."""
    out = AttemptEnd()
    ends: list[ContainerEnd] = [e for e in (container_end(p) for p in pods) if e]
    ends.sort(key=lambda e: (e.index is None, e.index or 0))
    messages = [e.message for e in ends if e.message is not None]
    rank0 = next((e for e in ends if e.index == 0 and e.sigterm_to_exit is not None), None)
    timings = status.timings or models.Timings()
    for end in ends:
        # Ground truth for the grace rule: the runtime's measure or the pod object's (a
        # launcher's teardown after its main worker measured), whichever is longer.
        timings.sigterm_to_exit_seconds_max = max_of(
            timings.sigterm_to_exit_seconds_max, end.sigterm_to_exit
        )
    for msg in messages:
        timings.step_seconds_max = max_of(timings.step_seconds_max, msg.step_seconds.max)
        timings.step_seconds_p99 = msg.step_seconds.p99 or timings.step_seconds_p99
        timings.step_seconds_ema = msg.step_seconds.ema or timings.step_seconds_ema
        timings.save_seconds_max = max_of(timings.save_seconds_max, msg.save_seconds.max)
        timings.save_seconds_last = msg.save_seconds.last or timings.save_seconds_last
        if msg.micro_batch_seconds is not None:
            timings.micro_batch_seconds_max = max_of(
                timings.micro_batch_seconds_max, msg.micro_batch_seconds.max
            )
    # Only a kill at the grace deadline says the grace was too short: not an OOM kill, not
    # ranks killed while they waited for a peer that failed for real.
    killed = killed_at_grace(ends)
    if killed and interruption.outcome != "Succeeded" and record.grace_seconds:
        # It needed more than its grace: a lower bound of the true SIGTERM-to-exit time.
        timings.sigterm_to_exit_seconds_max = max_of(
            timings.sigterm_to_exit_seconds_max, float(record.grace_seconds)
        )
    status.timings = timings

    # What the runtime loaded (an earlier checkpoint after a corrupt one) is the start.
    loaded = resumed_from(messages)
    if loaded is not None:
        fell_back = fallback_message(record.attempt, record.resume_from, record.start_step, loaded)
        if fell_back is not None:
            out.events.append(("Warning", Reason.RESUME_FELL_BACK, fell_back))
        record.resumed_from = pod_checkpoint_path(spec, loaded.path)
        record.start_step = loaded.step
    # Only this attempt's own reports (not the step an earlier attempt left in progress).
    progress = status.progress or models.Progress()
    reported_end = end_step = attempt_end_step(
        record.attempt,
        record.start_step,
        [m.step for m in messages],
        progress.step,
        progress.attempt,
    )
    if progress.attempt == record.attempt and progress.step is not None:
        record.last_scraped_step = progress.step
        record.last_scraped_time = progress.scraped_at
        record.steps_per_second = progress.steps_per_second
    estimated = not messages and interruption.outcome != "Succeeded"
    if estimated:
        # No pod said where it stopped: its last scrape is older than its end (up to a
        # periodic pass or a throttled status write); add the steps at its rate until rank 0
        # stopped training.
        first = next((e for e in ends if e.index in (0, None)), ends[0] if ends else None)
        stopped = (
            training_stopped_at(
                first.finished_at,
                first.observed_sigterm_to_exit,
                spec.grace_period.kill_wait_seconds,
            )
            if first is not None
            else None
        )
        if stopped is None:
            # No end of its own (a lost node): between its last answered scrape and the
            # first unanswered one.
            stopped = lost_contact_stopped_at(
                parse_rfc3339(record.last_scraped_time),
                parse_rfc3339(record.unreachable_since),
                now_s,
            )
        guess = estimated_end_step(
            record.last_scraped_step,
            parse_rfc3339(record.last_scraped_time),
            record.steps_per_second,
            stopped,
            progress.max_steps,
        )
        if guess is not None:
            end_step = max(end_step or 0, guess)
    if snapshot is not None:
        apply_snapshot(status, snapshot)
    # The runtime's own report counts even when storage is readable: a listing can miss
    # the JIT checkpoint just written (another mount, an eventually consistent store).
    for msg in sorted(messages, key=lambda m: m.step):
        if msg.checkpoint and msg.complete:
            current = status.last_complete_checkpoint
            step = reported_checkpoint_step(msg)
            if current is None or step > current.step:
                status.last_complete_checkpoint = models.CheckpointRef(
                    step=step,
                    path=pod_checkpoint_path(spec, msg.checkpoint),
                    completed_at=now,
                    save_seconds=msg.save_seconds.last,
                )
    ckpt = status.last_complete_checkpoint
    lost = attempt_lost_steps(
        end_step,
        record.start_step,
        ckpt.step if ckpt else None,
        interruption.outcome == "Succeeded",
    )
    outcome = interruption.outcome if interruption.outcome != "Active" else "Failed"
    record.end_time = now
    record.reason = interruption.reason
    record.message = interruption.message or None
    record.outcome = outcome  # type: ignore[assignment]
    record.end_step = end_step
    record.checkpoint = ckpt.path if ckpt else None
    record.exit_codes = [e.exit_code for e in ends if e.exit_code is not None] or None
    record.killed = killed
    record.lost_steps = lost
    record.lost_steps_estimated = True if estimated else None
    sigterm = rank0.sigterm_to_exit if rank0 is not None else None
    if sigterm is None:
        sigterm = max_of(None, *(e.sigterm_to_exit for e in ends))
    record.sigterm_to_exit_seconds = sigterm
    out.sigterm_to_exit = sigterm
    if reported_end is not None:
        # What the runtime reported, never an estimate: progress is what it saw.
        progress.step = max(progress.step or 0, reported_end)
        status.progress = progress
    status.lost_steps = (status.lost_steps or 0) + lost
    if estimated:
        status.lost_steps_estimated = True
    out.lost_steps = lost
    if lost:
        out.events.append(
            (
                "Warning",
                Reason.LOST_STEPS,
                f"attempt {record.attempt} reached step {end_step} but the newest complete "
                f"checkpoint is step {ckpt.step if ckpt else 0}: {lost} steps lost"
                + (" (estimated: no termination message)" if estimated else "")
                + (
                    f" (SIGKILLed at the {record.grace_seconds} s grace deadline)" if killed else ""
                ),
            )
        )
    if outcome == "Preempted":
        status.preemptions = (status.preemptions or 0) + 1
        started = bool(messages) or any(_container_started(p) for p in pods)
        if not attempt_ran(record.running_time, started, end_step, record.start_step):
            status.preemptions_before_running = (status.preemptions_before_running or 0) + 1
        out.preempted = interruption.reason
        status.conditions = cond.set_condition(
            status.conditions,
            cond.PREEMPTED,
            "True",
            interruption.reason,
            f"attempt {record.attempt}: {interruption.message}",
            now,
            generation,
        )
    elif outcome == "Failed":
        # The failure policy sees only real failures, and only the exit codes of containers
        # that failed on their own (never 75, a peer's end or a kill at a grace deadline).
        codes = [e.exit_code for e in ends if e.real_failure and e.exit_code is not None]
        policy = spec.failure_policy
        verdict = decide_failure(outcome, interruption.reason, codes, policy)
        record.failure_action = verdict.action if verdict else None
        record.failure_rule = verdict.rule if verdict else None
        if verdict is None or verdict.counts:
            status.failures = (status.failures or 0) + 1
            status.failure_times = keep_failure_times(
                status.failure_times, rfc3339(now_s), spec.max_restarts
            )
        window = policy.restart_window_seconds if policy else None
        counted = counted_failures(status.failures or 0, status.failure_times, now_s, window)
        if verdict is not None and not verdict.counts:
            delay = backoff_seconds(spec.restart_backoff_seconds, 1)
            out.events.append(
                (
                    "Normal",
                    Reason.FAILURE_IGNORED,
                    f"attempt {record.attempt} failed ({interruption.reason}) and "
                    f"failurePolicy rule {verdict.rule} says Ignore: restart in {delay} s, "
                    "not counted against maxRestarts",
                )
            )
        else:
            delay = backoff_seconds(spec.restart_backoff_seconds, counted)
        status.next_attempt_after = rfc3339(now_s + delay)
        restarts = verdict is not None and verdict.action == "Restart"
        if restarts and counted <= spec.max_restarts:
            out.events.append(
                (
                    "Normal",
                    Reason.BACKOFF,
                    f"restart {counted} of {spec.max_restarts} in {delay} s",
                )
            )
    shown_sigterm = "-" if sigterm is None else f"{sigterm:.2f}"
    out.events.append(
        (
            "Warning" if outcome == "Failed" else "Normal",
            interruption.reason,
            f"attempt {record.attempt} ended ({outcome}): {interruption.message}; step "
            f"{end_step}, checkpoint {record.checkpoint}, SIGTERM->exit {shown_sigterm} s, "
            f"grace {record.grace_seconds} s",
        )
    )
    return out
