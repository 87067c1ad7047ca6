"""Checkpoint-aware victims (issue 32): the cost of a preemption now, the Kueue priority boost it
maps to, the minRunSeconds protection, and when the operator writes the boost."""

from __future__ import annotations

from typing import Any

import kubernetes
import pytest

from preemptible_operator import cli, models
from preemptible_operator.classify import DEACTIVATED_BY_OPERATOR_ANNOTATION
from preemptible_operator.reconcile import OperatorConfig, Reconciler, _Observed
from preemptible_operator.victims import (
    BOOST_ANNOTATION,
    SATURATION_SECONDS,
    VictimInputs,
    boost_for_cost,
    preemption_cost,
    should_write_boost,
    victim_boost,
    victim_inputs,
)
from tests.unit.operator.builders import make_spec

T0 = 1_800_000_000.0
RUN_START = "2027-01-15T08:00:00Z"  # = T0


def _inputs(**kw: Any) -> VictimInputs:
    base: dict[str, Any] = {
        "now": T0 + 600,
        "running_since": T0,
        "start_step": 0,
        "step": 100,
        "checkpoint_step": 90,
        "step_seconds": 2.0,
        "stop_seconds": 3.0,
        "save_seconds": 20.0,
        "kill_wait": 2.0,
        "grace_seconds": 60,
    }
    base.update(kw)
    return VictimInputs(**base)


@pytest.mark.parametrize(
    ("kw", "seconds", "jit_fits", "saved"),
    [
        # JIT fits the grace: the GPUs stay held kill wait + the step in flight + the save.
        ({}, 2 + 3 + 20, True, True),
        ({"grace_seconds": 25}, 25, True, True),  # exactly at the deadline
        # The node's notice is shorter than the grace: the save misses it, work is lost
        # (10 steps of 2 s since checkpoint 90) plus the kill wait.
        ({"node_notice_seconds": 20}, 2 + 10 * 2.0, False, True),
        ({"grace_seconds": 24}, 2 + 20.0, False, True),
        # Nothing measured: no prediction, the work since the checkpoint counts.
        ({"save_seconds": None}, 2 + 20.0, False, True),
        ({"stop_seconds": None, "save_seconds": None}, 2 + 20.0, False, True),
        # No deadline known (no grace, no notice): no prediction either.
        ({"grace_seconds": None}, 2 + 20.0, False, True),
        # The attempt has not written a checkpoint of its own: everything it ran (600 s).
        ({"grace_seconds": 10, "checkpoint_step": None}, 2 + 600.0, False, False),
        ({"grace_seconds": 10, "checkpoint_step": 90, "start_step": 90}, 2 + 600.0, False, False),
        ({"grace_seconds": 10, "checkpoint_step": 80, "start_step": 90}, 2 + 600.0, False, False),
        # A fresh checkpoint: nothing lost but the kill wait.
        ({"grace_seconds": 10, "checkpoint_step": 100}, 2.0, False, True),
        # The scraped step lags the checkpoint the runtime reported: never negative.
        ({"grace_seconds": 10, "checkpoint_step": 105}, 2.0, False, True),
        # Saved, but no step time: fall back to the whole attempt (an upper bound).
        ({"grace_seconds": 10, "step_seconds": None}, 2 + 600.0, False, True),
        # The micro-batch stop policy's term is what the caller passes as stop_seconds.
        ({"stop_seconds": 0.5, "grace_seconds": 23}, 22.5, True, True),
        # Clock skew: the attempt "started" in the future counts as 0 s run.
        ({"grace_seconds": 10, "checkpoint_step": None, "now": T0 - 5}, 2.0, False, False),
    ],
)
def test_preemption_cost(kw: dict[str, Any], seconds: float, jit_fits: bool, saved: bool) -> None:
    cost = preemption_cost(_inputs(**kw))
    assert (cost.seconds, cost.jit_fits, cost.saved) == (pytest.approx(seconds), jit_fits, saved)
    assert not cost.protected and cost.reason


@pytest.mark.parametrize(
    ("seconds", "maximum", "expected"),
    [
        (0.0, 100, 0),
        (-3.0, 100, 0),
        (1.0, 100, 6),  # 99 * log2(2) / log2(86401) = 6.0
        (25.0, 100, 28),
        (600.0, 100, 55),
        (3600.0, 100, 71),
        (SATURATION_SECONDS, 100, 99),  # the top of the unprotected range
        (10 * SATURATION_SECONDS, 100, 99),
        (float("inf"), 100, 99),
        (3600.0, 1, 0),  # a band of one: only protected (1) or not (0)
        (3600.0, 10, 6),
    ],
)
def test_boost_for_cost(seconds: float, maximum: int, expected: int) -> None:
    assert boost_for_cost(seconds, maximum) == expected


def test_boost_is_monotone_and_inside_the_band() -> None:
    costs = [0.0, 0.1, 1, 2, 5, 10, 30, 60, 300, 1800, 7200, 43_200, 86_400, 1e9]
    for maximum in (1, 2, 10, 100, 899):
        boosts = [boost_for_cost(c, maximum) for c in costs]
        assert boosts == sorted(boosts)
        assert all(0 <= b <= maximum - 1 for b in boosts)
    with pytest.raises(ValueError, match="must be >= 1"):
        boost_for_cost(1.0, 0)


_UNSAVED = {"min_run_seconds": 300, "checkpoint_step": None}


@pytest.mark.parametrize(
    ("kw", "protected", "boost"),
    [
        # No minRunSeconds: the cost alone (JIT fits: 25 s).
        ({}, False, 28),
        ({"checkpoint_step": None}, False, 28),  # JIT fits: nothing lost even without a save
        # Ran less than minRunSeconds: protected, whatever the cost.
        ({"min_run_seconds": 900}, True, 100),
        ({"min_run_seconds": 600}, False, 28),  # 600 s run: the window is over
        # Ran long enough but has not saved once in this attempt: protected until it has.
        ({"min_run_seconds": 300, "checkpoint_step": None}, True, 100),
        ({"min_run_seconds": 300, "checkpoint_step": 50, "start_step": 50}, True, 100),
        ({"min_run_seconds": 0, "checkpoint_step": None}, True, 100),
        ({"min_run_seconds": 0}, False, 28),
        # Bounded (issue 39). Checkpoints the operator cannot see (its /metrics blocked, nothing
        # scraped for this attempt): protected for minRunSeconds only.
        ({"min_run_seconds": 900, "checkpoints_visible": False}, True, 100),
        ({**_UNSAVED, "checkpoints_visible": False}, False, 28),
        # The attempt's save interval known: one interval past minRunSeconds at most.
        ({**_UNSAVED, "save_interval_seconds": 400}, True, 100),
        ({**_UNSAVED, "save_interval_seconds": 200}, False, 28),
        ({"min_run_seconds": 0, "checkpoint_step": None, "save_interval_seconds": 120}, False, 28),
        # A JIT-only job (it saves only when stopped): not protected for its whole run.
        ({"min_run_seconds": 300, "checkpoint_step": None, "now": T0 + 2200}, False, 28),
        ({"min_run_seconds": 300, "checkpoint_step": None, "now": T0 + 2000}, True, 100),
    ],
)
def test_min_run_seconds_protection(kw: dict[str, Any], protected: bool, boost: int) -> None:
    value, cost = victim_boost(_inputs(**kw), 100)
    assert (cost.protected, value) == (protected, boost)
    if protected:
        assert "minRunSeconds" in cost.reason


def test_fresher_checkpoint_is_the_cheaper_victim() -> None:
    """Two equal jobs on nodes with a short notice (no JIT save fits): the one that saved more
    recently gets the lower boost, so Kueue preempts it first."""
    short = {"node_notice_seconds": 5}
    fresh, _ = victim_boost(_inputs(checkpoint_step=99, **short), 100)
    stale, _ = victim_boost(_inputs(checkpoint_step=20, **short), 100)
    never, _ = victim_boost(_inputs(checkpoint_step=None, **short), 100)
    assert fresh < stale < never < 100


@pytest.mark.parametrize("gap", [900, 101])
def test_the_boost_never_crosses_into_another_class(gap: int) -> None:
    """Kueue's effective priority = class value + boost: with a band below the gap, a boosted
    low job stays below an unboosted high one, and a pending job of the same class (boost 0)
    never exceeds a running one (LowerPriority never preempts within the class)."""
    low, high, maximum = 100, 100 + gap, 100
    for kw in ({}, {"min_run_seconds": 10_000}, {"checkpoint_step": None, "grace_seconds": 1}):
        boost, _ = victim_boost(_inputs(**kw), maximum)
        assert low <= low + boost < high


@pytest.mark.parametrize(
    ("desired", "current", "last_write", "now", "expected"),
    [
        (5, None, None, 100.0, True),  # first value of the attempt: at once
        (5, "5", None, 100.0, False),  # unchanged: no write
        (5, " 5", 90.0, 100.0, False),
        (6, "5", None, 100.0, True),  # set by someone else (or a restart): ours at once
        (6, "5", 90.0, 100.0, False),  # changed, inside the budget interval (15 s)
        (6, "5", 85.0, 100.0, True),  # changed, the interval has passed
        (6, "x", 85.0, 100.0, True),
    ],
)
def test_should_write_boost(
    desired: int, current: str | None, last_write: float | None, now: float, expected: bool
) -> None:
    assert should_write_boost(desired, current, last_write, now, 15.0) is expected


def _status(**kw: Any) -> models.TrainingJobStatus:
    raw: dict[str, Any] = {
        "progress": {"step": 40},
        "timings": {
            "stepSecondsMax": 4.0,
            "stepSecondsEma": 3.0,
            "saveSecondsMax": 12.0,
            "microBatchSecondsMax": 1.0,
        },
        "lastCompleteCheckpoint": {"step": 30, "path": "/ckpt/run/checkpoint-30"},
        "gracePeriod": {"current": 45},
    }
    raw.update(kw)
    return models.TrainingJobStatus.model_validate(raw)


def _record(**kw: Any) -> models.AttemptRecord:
    raw: dict[str, Any] = {
        "attempt": 2,
        "jobName": "tj-a2",
        "runningTime": RUN_START,
        "startStep": 10,
        "graceSeconds": 50,
    }
    raw.update(kw)
    return models.AttemptRecord.model_validate(raw)


def test_victim_inputs_from_the_status() -> None:
    spec = make_spec(
        gracePeriod={"killWaitSeconds": 1.5, "nodeNoticeSeconds": 30},
        preemption={"minRunSeconds": 120},
    )
    inp = victim_inputs(_status(), spec, _record(), T0 + 60)
    assert inp == VictimInputs(
        now=T0 + 60,
        running_since=T0,
        start_step=10,
        step=40,
        checkpoint_step=30,
        step_seconds=3.0,
        stop_seconds=4.0,
        save_seconds=12.0,
        kill_wait=1.5,
        grace_seconds=50,
        node_notice_seconds=30,
        min_run_seconds=120,
    )
    micro = make_spec(gracePeriod={"stopPolicy": "micro_batch"})
    got = victim_inputs(_status(), micro, _record(graceSeconds=None), T0)
    assert got is not None
    assert (got.stop_seconds, got.grace_seconds, got.min_run_seconds) == (1.0, 45, None)
    bare = victim_inputs(models.TrainingJobStatus(), make_spec(), _record(startStep=None), T0)
    assert bare is not None
    assert (bare.start_step, bare.step, bare.checkpoint_step, bare.save_seconds) == (
        0,
        None,
        None,
        None,
    )
    assert not bare.checkpoints_visible  # nothing scraped: no evidence of its checkpoints
    # Not running yet (queued, or its pods not seen running): no boost at all.
    assert victim_inputs(_status(), spec, _record(runningTime=None), T0) is None
    assert victim_inputs(_status(), spec, None, T0) is None


@pytest.mark.parametrize(
    ("progress", "interval", "spec_interval", "visible", "save_interval"),
    [
        ({"step": 40, "attempt": 2}, None, None, True, None),
        ({"step": 40, "attempt": 1}, None, None, False, None),  # an earlier attempt's report
        (None, None, None, False, None),  # /metrics blocked: nothing scraped
        ({"step": 40}, {"recommendedSeconds": 600, "applied": True}, "auto", True, 600),
        ({"step": 40}, {"recommendedSeconds": 600, "applied": False}, None, True, None),
    ],
)
def test_victim_inputs_checkpoint_evidence(
    progress: dict[str, Any] | None,
    interval: dict[str, Any] | None,
    spec_interval: str | None,
    visible: bool,
    save_interval: float | None,
) -> None:
    """What bounds the wait for an attempt's first checkpoint (issue 39)."""
    spec = make_spec(
        preemption={"minRunSeconds": 120},
        checkpoint={"uri": "/ckpt/run", "interval": spec_interval},
    )
    status = _status(progress=progress, checkpointInterval=interval)
    inp = victim_inputs(status, spec, _record(), T0)
    assert inp is not None
    assert (inp.checkpoints_visible, inp.save_interval_seconds) == (visible, save_interval)


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ({"minRunSeconds": 0}, None),
        ({"minRunSeconds": 3600}, None),
        ({}, None),
        ({"minRunSeconds": -1}, "greater than or equal to 0"),
        ({"minRunSeconds": 604_801}, "less than or equal to 604800"),
        ({"minRunSecs": 5}, "Extra inputs"),
    ],
)
def test_preemption_spec_validation(value: dict[str, Any], error: str | None) -> None:
    if error is None:
        spec = make_spec(preemption=value)
        assert spec.preemption is not None
        assert spec.preemption.min_run_seconds == value.get("minRunSeconds")
    else:
        with pytest.raises(ValueError, match=error):
            make_spec(preemption=value)


def test_cli_flags() -> None:
    args = cli.build_parser().parse_args(["run"])
    assert (args.priority_boost, args.priority_boost_max) == (False, 100)
    on = cli.build_parser().parse_args(["run", "--priority-boost", "--priority-boost-max", "50"])
    assert (on.priority_boost, on.priority_boost_max) == (True, 50)
    assert OperatorConfig().priority_boost is False


def test_cli_rejects_an_empty_band(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--priority-boost-max", "0"]) == 2
    assert "--priority-boost-max 0: must be >= 1" in capsys.readouterr().err


# ------------------------------------------------------------- the Reconciler's Workload writes
class _Recorder:
    """Stands in for CustomObjectsApi: records the Workload patches of the Reconciler."""

    def __init__(self) -> None:
        self.patches: list[tuple[str, dict[str, Any]]] = []

    def patch_namespaced_custom_object(self, *args: Any) -> dict[str, Any]:
        self.patches.append((args[4], args[5]))
        return {}


def _workload(boost: str | None = None, admitted: bool = True) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "job-tj-a2-x", "namespace": "ns", "uid": "w-1"}
    if boost is not None:
        meta["annotations"] = {BOOST_ANNOTATION: boost}
    conds = [{"type": "Admitted", "status": "True"}] if admitted else []
    return {"metadata": meta, "spec": {"active": True}, "status": {"conditions": conds}}


def _observed(workload: dict[str, Any] | None) -> _Observed:
    return _Observed(
        obj={"metadata": {"name": "tj", "namespace": "ns"}},
        status=models.TrainingJobStatus(),
        spec=None,
        invalid=None,
        jobs={},
        pods_by_attempt={},
        attempt=2,
        job=None,
        pods=[],
        workload=workload,
        workload_version="v1beta2",
        node_ready={},
    )


def test_the_reconciler_writes_the_boost_only_when_it_changes() -> None:
    clock = [T0 + 60]
    r = Reconciler(
        kubernetes.client.ApiClient(),
        OperatorConfig(priority_boost=True, status_progress_interval=15.0),
        clock=lambda: clock[0],
    )
    rec = _Recorder()
    r.custom = rec  # type: ignore[assignment]
    spec = make_spec(preemption={"minRunSeconds": 300})
    status, record = _status(), _record()
    r._update_priority_boost(_observed(_workload()), spec, status, record)
    assert rec.patches == [
        ("job-tj-a2-x", {"metadata": {"annotations": {BOOST_ANNOTATION: "100"}}})
    ]  # protected: ran 60 s of 300
    # The cache shows it: nothing to write.
    r._update_priority_boost(_observed(_workload("100")), spec, status, record)
    # The window is over but the last write was just now: wait for the budget interval.
    clock[0] = T0 + 400
    r._update_priority_boost(_observed(_workload("100")), spec, status, record)
    assert len(rec.patches) == 1
    r._boosted[("ns", "tj")] = ("w-1", r._boosted[("ns", "tj")][1] - 16)
    r._update_priority_boost(_observed(_workload("100")), spec, status, record)
    # JIT fits the 50 s grace: 3 s kill wait + 4 s step + 12 s save = 19 s -> 26.
    assert rec.patches[-1][1]["metadata"]["annotations"][BOOST_ANNOTATION] == "26"
    # Not admitted (evicted, queued), deactivated, or no Workload: never boosted.
    inactive = _workload(admitted=True)
    inactive["spec"]["active"] = False
    for obs in (_observed(_workload(admitted=False)), _observed(inactive), _observed(None)):
        r._update_priority_boost(obs, spec, status, record)
    assert len(rec.patches) == 2
    r.forget("ns", "tj")
    assert ("ns", "tj") not in r._boosted


# The operator marks its own deactivations (an unmarked inactive Workload is an admin's).
MARK = DEACTIVATED_BY_OPERATOR_ANNOTATION


@pytest.mark.parametrize(
    ("boost", "patch"),
    [
        (
            None,
            {"spec": {"active": False}, "metadata": {"annotations": {MARK: "true"}}},
        ),
        (
            "40",
            {
                "spec": {"active": False},
                "metadata": {"annotations": {MARK: "true", BOOST_ANNOTATION: None}},
            },
        ),
    ],
)
def test_a_deactivated_victim_drops_its_boost(boost: str | None, patch: dict[str, Any]) -> None:
    """An evicted Workload must not wait in the queue with a boost: a pending Workload above a
    running one of its class could preempt it."""
    r = Reconciler(kubernetes.client.ApiClient(), OperatorConfig())
    rec = _Recorder()
    r.custom = rec  # type: ignore[assignment]
    r._deactivate_workload("ns", _workload(boost), "v1beta2")
    assert rec.patches == [("job-tj-a2-x", patch)]


class _Refusing(_Recorder):
    def patch_namespaced_custom_object(self, *args: Any) -> dict[str, Any]:
        raise kubernetes.client.exceptions.ApiException(status=403, reason="Forbidden")


def test_a_refused_boost_write_does_not_fail_the_pass(caplog: pytest.LogCaptureFixture) -> None:
    r = Reconciler(kubernetes.client.ApiClient(), OperatorConfig(priority_boost=True))
    r.custom = _Refusing()  # type: ignore[assignment]
    r._update_priority_boost(_observed(_workload()), make_spec(), _status(), _record())
    assert "priority boost not written: Forbidden" in caplog.text
    # Tried again only after the budget interval, as after a write.
    r._update_priority_boost(_observed(_workload()), make_spec(), _status(), _record())
    assert caplog.text.count("not written") == 1
