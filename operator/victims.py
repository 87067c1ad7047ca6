"""Checkpoint-aware victims: what preempting a running attempt would cost now, as a Kueue
priority boost (pure, table-tested; issue 32).

Kueue (v0.19, feature gate ``PriorityBoost``, KEP-7990) adds the integer in a Workload's
``kueue.x-k8s.io/priority-boost`` annotation to the Workload's priority wherever it orders or
compares priorities: the order of preemption candidates (lowest effective priority first, then
the most recently admitted) and the LowerPriority eligibility test (a candidate is preemptible
when its effective priority is strictly below the preemptor's). The operator keeps on each
running attempt's Workload a boost in ``[0, maximum]``:

- ``maximum`` while the attempt is protected (``spec.preemption.minRunSeconds``: it has run less
  than that, or has not written a checkpoint of its own yet), so a job is not preempted again
  before it saved once. Waiting for that checkpoint is bounded (issue 39): only while the
  operator can see the attempt's checkpoints (its /metrics report this attempt's progress), and
  at most one save interval (the attempt's own, else ``UNSAVED_WAIT_SECONDS``) past
  minRunSeconds; a JIT-only job or one whose /metrics are blocked is otherwise protected for its
  whole run;
- else a value in ``[0, maximum - 1]`` that grows with the cost of a preemption now (log scale:
  seconds and hours both stay apart in a small band).

The cost of preempting now, in seconds: when a JIT save is predicted to fit the deadline (the
shorter of the pod's grace and the node's notice) the work is kept and the cluster pays the
seconds the GPUs stay held while the victim stops and saves (kill wait, the step or micro-batch
in flight, the longest save seen); otherwise the work since the newest complete checkpoint is
lost (the seconds of steps since it, or the whole attempt so far when it has not saved yet),
plus the kill wait. Cheapest victims get the lowest boost, so Kueue preempts them first.

The boost is never negative: a pending Workload (boost 0) of the same priority class can then
never become "higher" than a running one, so the boost never lets a job preempt its own class
under ``withinClusterQueue: LowerPriority``. The band's ``maximum`` stays below the next higher
class: :func:`band_top` lowers it, per Workload, to one less than the distance from the
Workload's priority to the closest higher value among the cluster's WorkloadPriorityClasses and
PriorityClasses, so the boost never lifts a job into (or level with) another class.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from preemptible_operator.models import AttemptRecord, TrainingJobSpec, TrainingJobStatus
from preemptible_operator.timestamps import parse_rfc3339
from trainer_runtime.deadline import deadline_budget
from trainer_runtime.grace import stop_seconds_term

__all__ = [
    "BOOST_ANNOTATION",
    "SATURATION_SECONDS",
    "UNSAVED_WAIT_SECONDS",
    "PreemptionCost",
    "VictimInputs",
    "band_top",
    "boost_for_cost",
    "preemption_cost",
    "should_write_boost",
    "victim_boost",
    "victim_inputs",
]

BOOST_ANNOTATION = "kueue.x-k8s.io/priority-boost"
"""Kueue's Workload annotation: a signed int32 in decimal, read under gate PriorityBoost."""

SATURATION_SECONDS = 86_400.0
"""A cost of a day or more gets the highest unprotected boost (``maximum - 1``)."""


UNSAVED_WAIT_SECONDS = 1800.0
"""How long past minRunSeconds an attempt with no checkpoint of its own stays protected when its
save interval is not known (a script's own save_steps): then its cost decides."""


@dataclass(frozen=True)
class VictimInputs:
    """What the operator knows about a running attempt (times in seconds since the epoch)."""

    now: float
    running_since: float
    """When the attempt's pods were first seen running."""
    start_step: int
    """The step the attempt resumed from (0: a fresh start)."""
    step: int | None = None
    """The latest global step scraped from rank 0."""
    checkpoint_step: int | None = None
    """Step of the newest complete checkpoint (of any attempt)."""
    step_seconds: float | None = None
    """Typical step time (EMA, else the longest step)."""
    stop_seconds: float | None = None
    """The work the runtime still does after the kill wait before it saves (the step under
    finish_step, the micro-batch under micro_batch)."""
    save_seconds: float | None = None
    """The longest save seen."""
    kill_wait: float = 0.0
    grace_seconds: float | None = None
    """terminationGracePeriodSeconds of the attempt's pods."""
    node_notice_seconds: float | None = None
    min_run_seconds: int | None = None
    """spec.preemption.minRunSeconds (None: no protection)."""
    checkpoints_visible: bool = True
    """The operator sees this attempt's progress in its /metrics, so it would see its periodic
    checkpoints: False (nothing scraped for this attempt) ends protection at minRunSeconds."""
    save_interval_seconds: float | None = None
    """The periodic save interval the attempt runs with, when the operator set it (None:
    unknown, UNSAVED_WAIT_SECONDS bounds the wait for the first checkpoint)."""


@dataclass(frozen=True)
class PreemptionCost:
    seconds: float
    """What a preemption now costs the cluster (GPU seconds per node, held or lost)."""
    jit_fits: bool
    """A JIT save is predicted to finish before the deadline."""
    saved: bool
    """The attempt has written a complete checkpoint of its own."""
    protected: bool
    """Protected by minRunSeconds (not run long enough, or not saved yet)."""
    reason: str


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) and value >= 0 else None


def preemption_cost(inp: VictimInputs) -> PreemptionCost:
    """The cost of preempting the attempt at ``inp.now`` (see the module docstring)."""
    ran = max(0.0, inp.now - inp.running_since)
    ckpt = inp.checkpoint_step
    saved = ckpt is not None and ckpt > inp.start_step
    kill_wait = _finite(inp.kill_wait) or 0.0
    deadline = deadline_budget(_finite(inp.grace_seconds), _finite(inp.node_notice_seconds))
    stop, save = _finite(inp.stop_seconds), _finite(inp.save_seconds)
    jit_seconds = kill_wait + stop + save if stop is not None and save is not None else None
    jit_fits = deadline is not None and jit_seconds is not None and jit_seconds <= deadline
    protected = inp.min_run_seconds is not None and (
        ran < inp.min_run_seconds or (not saved and ran < _unsaved_limit(inp))
    )
    if jit_fits and jit_seconds is not None:
        seconds = jit_seconds
        reason = f"JIT save fits the {deadline:g} s deadline: {jit_seconds:.1f} s to stop and save"
    else:
        step_seconds = _finite(inp.step_seconds)
        why = (
            "no JIT save prediction (nothing measured)"
            if jit_seconds is None
            else f"a JIT save ({jit_seconds:.1f} s) misses the {deadline} s deadline"
            if deadline is not None
            else "no deadline known"
        )
        if saved and ckpt is not None and inp.step is not None and step_seconds is not None:
            lost = max(0, inp.step - ckpt) * step_seconds
            detail = f"{max(0, inp.step - ckpt)} steps since checkpoint {ckpt}"
        else:
            # Not saved yet (or no step measurements): everything this attempt ran is lost.
            lost = ran
            detail = f"no checkpoint since step {inp.start_step}: {ran:.0f} s of this attempt"
        seconds = kill_wait + lost
        reason = f"{why}; {detail} ({lost:.1f} s lost)"
    if protected:
        reason = (
            f"protected by minRunSeconds {inp.min_run_seconds} (ran {ran:.0f} s, "
            f"{'saved' if saved else 'no checkpoint of its own yet'}); {reason}"
        )
    return PreemptionCost(
        seconds=seconds, jit_fits=jit_fits, saved=saved, protected=protected, reason=reason
    )


def _unsaved_limit(inp: VictimInputs) -> float:
    """Seconds of running after which an attempt without a checkpoint of its own is no longer
    protected: minRunSeconds when the operator cannot see its checkpoints, else one save
    interval more (never forever: a JIT-only job saves only when it is stopped)."""
    min_run = float(inp.min_run_seconds or 0)
    if not inp.checkpoints_visible:
        return min_run
    wait = _finite(inp.save_interval_seconds)
    return min_run + (wait if wait is not None else UNSAVED_WAIT_SECONDS)


def boost_for_cost(
    seconds: float, maximum: int, saturation_seconds: float = SATURATION_SECONDS
) -> int:
    """An unprotected attempt's boost: 0 for no cost, rising with log2(1 + seconds) to
    ``maximum - 1`` at ``saturation_seconds`` and above (``maximum`` is protection's)."""
    if maximum < 1:
        raise ValueError(f"maximum {maximum}: must be >= 1")
    top = maximum - 1
    if not math.isfinite(seconds) or seconds >= saturation_seconds:
        return top
    if seconds <= 0:
        return 0
    scaled = top * math.log2(1.0 + seconds) / math.log2(1.0 + saturation_seconds)
    return min(top, math.floor(scaled))


def band_top(priority: int | None, class_values: Iterable[int] | None, configured: int) -> int:
    """The top of the boost band for a Workload of ``priority``: ``configured``
    (--priority-boost-max), lowered where a class above is closer, so that priority + boost stays
    strictly below the next higher class value (a tie would already stop that class from
    preempting the job). 0 when the next class is one above: no room for a boost.
    ``class_values`` None (the classes could not be read): ``configured``."""
    own = priority or 0
    above = [v for v in class_values or () if v > own]
    if not above:
        return max(0, configured)
    return max(0, min(configured, min(above) - own - 1))


def victim_boost(inp: VictimInputs, maximum: int) -> tuple[int, PreemptionCost]:
    """The boost to keep on the attempt's Workload, and the cost it stands for (0 when the band
    is empty: ``maximum`` 0)."""
    cost = preemption_cost(inp)
    if maximum < 1:
        return 0, cost
    if cost.protected:
        return maximum, cost
    return boost_for_cost(cost.seconds, maximum), cost


def victim_inputs(
    status: TrainingJobStatus,
    spec: TrainingJobSpec,
    record: AttemptRecord | None,
    now: float,
) -> VictimInputs | None:
    """The inputs from the TrainingJob's status (None: the attempt is not running yet)."""
    running_since = parse_rfc3339(record.running_time) if record is not None else None
    if record is None or running_since is None:
        return None
    t = status.timings
    step_max = t.step_seconds_max if t else None
    stop, _ = stop_seconds_term(
        spec.grace_period.stop_policy, step_max, t.micro_batch_seconds_max if t else None
    )
    grace = record.grace_seconds
    if grace is None and status.grace_period is not None:
        grace = status.grace_period.current
    ckpt = status.last_complete_checkpoint
    progress = status.progress
    visible = progress is not None and progress.step is not None
    visible = visible and progress is not None and progress.attempt in (None, record.attempt)
    interval = status.checkpoint_interval
    applied = interval is not None and interval.applied and spec.checkpoint.interval == "auto"
    return VictimInputs(
        now=now,
        running_since=running_since,
        start_step=record.start_step or 0,
        step=status.progress.step if status.progress else None,
        checkpoint_step=ckpt.step if ckpt else None,
        step_seconds=(t.step_seconds_ema or step_max) if t else None,
        stop_seconds=stop,
        save_seconds=t.save_seconds_max if t else None,
        kill_wait=spec.grace_period.kill_wait_seconds,
        grace_seconds=grace,
        node_notice_seconds=spec.grace_period.node_notice_seconds,
        min_run_seconds=spec.preemption.min_run_seconds if spec.preemption else None,
        checkpoints_visible=visible,
        save_interval_seconds=(
            interval.recommended_seconds if applied and interval is not None else None
        ),
    )


def should_write_boost(
    desired: int, current: str | None, last_write: float | None, now: float, min_interval: float
) -> bool:
    """Whether to patch the Workload: only when the value differs from its annotation, and for
    a Workload already written, at most every ``min_interval`` seconds (the operator's periodic
    budget); the first value of an attempt goes out at once."""
    if current is not None and current.strip() == str(desired):
        return False
    return last_write is None or now - last_write >= min_interval
