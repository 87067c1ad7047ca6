"""The figures benchmarks/goodput.py prints (issue 32): the seeded arrival trace, the step
accounting from the toy's events (steps computed, lost across a preemption, at the end), and the
per-policy summary."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.unit.benchmark_modules import load_benchmark

gp = load_benchmark("goodput.py")


def _ev(event: str, pid: int, t: float, step: int) -> str:
    return json.dumps({"event": event, "pid": pid, "time": t, "step": step})


def _process(pid: int, t0: float, start: int, end: int, step_s: float = 0.5) -> list[str]:
    """One process: train_begin at ``start``, then step_end for start+1..end."""
    lines = [_ev("train_begin", pid, t0, start)]
    for i, step in enumerate(range(start + 1, end + 1)):
        lines.append(_ev("step_begin", pid, t0 + i * step_s, step))
        lines.append(_ev("step_end", pid, t0 + (i + 1) * step_s, step))
    return lines


def test_arrival_trace_is_seeded_sorted_and_inside_the_window() -> None:
    trace = gp.arrival_trace(1, 6, 180.0, margin=10.0)
    assert trace == gp.arrival_trace(1, 6, 180.0, margin=10.0)
    assert trace != gp.arrival_trace(2, 6, 180.0, margin=10.0)
    assert trace == sorted(trace) and len(trace) == 6
    assert all(10.0 <= t <= 170.0 for t in trace)
    assert gp.arrival_trace(1, 0, 180.0, margin=10.0) == []
    with pytest.raises(ValueError):
        gp.arrival_trace(1, 3, 20.0, margin=10.0)


def test_segments_follow_processes_in_start_order() -> None:
    # A second process interleaves nothing here, but starts later; a third never began training
    # (killed while loading: events without train_begin) and counts for nothing.
    lines = (
        _process(20, 100.0, 8, 12) + _process(10, 0.0, 0, 10) + [_ev("step_begin", 30, 200.0, 13)]
    )
    segs = gp.segments_from_events(lines)
    assert [(s.pid, s.start_step, s.end_step) for s in segs] == [(10, 0, 10), (20, 8, 12)]
    assert segs[0].step_seconds == pytest.approx((0.5,) * 9)


def test_a_process_that_finished_no_step_ends_where_it_began() -> None:
    (seg,) = gp.segments_from_events([_ev("train_begin", 1, 0.0, 40)])
    assert (seg.start_step, seg.end_step, seg.step_seconds) == (40, 40, ())


@pytest.mark.parametrize(
    ("processes", "running", "ckpt", "computed", "lost"),
    [
        # JIT save at the step reached: the next attempt resumes there, nothing lost.
        ([(0, 10), (10, 25)], True, 20, 25, 0),
        # No JIT: reached 17, resumed from the periodic checkpoint at 10: 7 trained again.
        ([(0, 17), (10, 30)], True, 20, 37, 7),
        # Two preemptions, the last one still waiting to be readmitted at the end: 23 - 20.
        ([(0, 17), (10, 23)], False, 20, 30, 7 + 3),
        # Preempted before any checkpoint: all of it lost at the end.
        ([(0, 9)], False, None, 9, 9),
        ([], False, None, 0, 0),
    ],
)
def test_job_steps(
    processes: list[tuple[int, int]], running: bool, ckpt: int | None, computed: int, lost: int
) -> None:
    lines: list[str] = []
    for i, (start, end) in enumerate(processes):
        lines += _process(100 + i, 1000.0 * i, start, end)
    steps = gp.job_steps(gp.segments_from_events(lines), running, ckpt)
    assert (steps.computed, steps.lost) == (computed, lost)


@pytest.mark.parametrize(
    ("lost", "step_s", "expected"),
    [(0.0, 0.5, 1.0), (10.0, 0.5, 1 - 10 / 1200), (6.0, 1.0, 0.99), (5000.0, 1.0, 0.0)],
)
def test_goodput_at_one_preemption_per_ten_minutes(
    lost: float, step_s: float, expected: float
) -> None:
    assert gp.goodput_at_rate(lost, step_s) == pytest.approx(expected)


def test_summary() -> None:
    jobs = [gp.JobSteps(computed=300, lost=0), gp.JobSteps(computed=100, lost=8)]
    out: dict[str, Any] = gp.summarize(
        jobs,
        preemptions_per_job=[1, 3],
        held_seconds=[2.0, 3.0, 4.0, 3.0],
        preemptor_waits=[3.0, 5.0],
        graces=[10.0, 12.0],
        step_seconds=0.5,
    )
    assert out["steps_computed"] == 400 and out["steps_kept"] == 392
    assert out["goodput"] == 0.98
    assert out["preemptions"] == 4 and out["lost_steps_per_preemption"] == 2.0
    assert out["held_seconds_after_sigterm"] == 12.0
    assert out["held_seconds_per_preemption"] == {"mean": 3.0, "min": 2.0, "max": 4.0, "n": 4}
    assert out["preemptor_wait_seconds"] == {"mean": 4.0, "min": 3.0, "max": 5.0, "n": 2}
    assert out["preemptions_per_job"] == {"mean": 2.0, "min": 1.0, "max": 3.0, "n": 2}
    assert out["goodput_at_1_per_10min"] == pytest.approx(1 - 2 / 1200, abs=1e-4)
    empty = gp.summarize([], [], [], [], [], None)
    assert empty["goodput"] is None and empty["lost_steps_per_preemption"] is None
    table = gp.table({"a": out})
    assert table.splitlines()[2].startswith("| (a) | 0.98 | 392 / 400 | 4 | 2 |")


def _attempt(
    n: int,
    start: int,
    end: int | None,
    outcome: str | None = "Preempted",
    reason: str = "KueuePreempted",
    grace: int = 44,
    **kw: Any,
) -> dict[str, Any]:
    return {"attempt": n, "startStep": start, "endStep": end, "outcome": outcome,
            "reason": reason, "graceSeconds": grace, **kw}  # fmt: skip


@pytest.mark.parametrize(
    ("attempts", "ckpt", "expected"),
    [
        # JIT saves that fit: each attempt resumes where the last one stopped.
        (
            [_attempt(1, 0, 30, grace=300), _attempt(2, 30, 55), _attempt(3, 55, None, None)],
            55,
            {"KueuePreempted": {"attempts": 1, "lost": 0},
             "KueuePreempted on the initial grace": {"attempts": 1, "lost": 0}},
        ),
        # The save did not fit: the next attempt went back to the periodic checkpoint.
        (
            [_attempt(1, 0, 37, reason="DeadlineTooShort", grace=300), _attempt(2, 20, 48,
             killed=True), _attempt(3, 40, None, None)],
            40,
            {"DeadlineTooShort on the initial grace": {"attempts": 1, "lost": 17},
             "KueuePreempted (killed)": {"attempts": 1, "lost": 8}},
        ),
        # The last attempt is preempted and waits: what it did beyond the newest checkpoint.
        ([_attempt(1, 0, 12, grace=30)], 10, {"KueuePreempted": {"attempts": 1, "lost": 2}}),
        # Failures and the running attempt are not preemptions.
        ([_attempt(1, 0, 5, "Failed"), _attempt(2, 0, 9, None)], 0, {}),
    ],
)  # fmt: skip
def test_loss_by_cause_says_where_the_steps_went(
    attempts: list[dict[str, Any]], ckpt: int | None, expected: dict[str, Any]
) -> None:
    assert gp.loss_by_cause(attempts, ckpt, initial_grace=300) == expected


def test_the_causes_of_several_jobs_add_up() -> None:
    one = {"KueuePreempted": {"attempts": 1, "lost": 2}}
    two = {"KueuePreempted": {"attempts": 2, "lost": 1}, "DeadlineTooShort": {"attempts": 1,
           "lost": 9}}  # fmt: skip
    assert gp.merge_causes([one, two]) == {
        "DeadlineTooShort": {"attempts": 1, "lost": 9},
        "KueuePreempted": {"attempts": 3, "lost": 3},
    }
    assert gp.loss_by_cause([_attempt(1, 0, 3)], 0, initial_grace=None) == {
        "KueuePreempted": {"attempts": 1, "lost": 3}
    }


@pytest.mark.parametrize(
    ("events", "status", "within", "relative"),
    [
        (142, 142, True, 0.0),
        (142, 130, True, -0.0845),  # an estimate 8 % short
        (142, 156, True, 0.0986),
        (142, 33, False, -0.7676),  # the last written step alone (before issue 39)
        (51, 11, False, -0.7843),
        (142, 157, False, 0.1056),
        (0, 0, True, None),
        (0, 1, True, None),  # a whole step either way when the count is small
        (5, 4, True, -0.2),
        (5, 3, False, -0.4),
    ],
)
def test_lost_steps_check(events: int, status: int, within: bool, relative: float | None) -> None:
    out = gp.lost_steps_check(events, status, estimated=True)
    assert out["within_tolerance"] is within
    assert out["relative_error"] == relative
    assert (out["events"], out["status"], out["estimated"]) == (events, status, True)


def _seg(start: int, end: int, first: float) -> Any:
    return gp.Segment(pid=1, start_step=start, end_step=end, first_time=first, last_time=first + 9)


# 2026-05-28T20:26:40Z
_T0 = 1_780_000_000.0


@pytest.mark.parametrize(
    ("phase", "attempts", "segments", "running"),
    [
        # attempt 2 still loading: the last process is attempt 1's, which was preempted
        (
            "Running",
            [{"outcome": "Preempted"}, {"startTime": "2026-05-28T20:26:40Z"}],
            [_seg(0, 82, _T0 - 100)],
            False,
        ),
        # attempt 2 began training
        (
            "Running",
            [{"outcome": "Preempted"}, {"startTime": "2026-05-28T20:26:40Z"}],
            [_seg(0, 82, _T0 - 100), _seg(80, 90, _T0 + 5)],
            True,
        ),
        ("Running", [{}], [_seg(0, 5, _T0)], True),  # no start time recorded: as before
        ("Queued", [{"outcome": "Preempted"}], [_seg(0, 5, _T0)], False),
        ("Running", [{}], [], False),
    ],
)
def test_training_at_end(
    phase: str, attempts: list[dict[str, Any]], segments: list[Any], running: bool
) -> None:
    assert gp.training_at_end(phase, attempts, segments) is running


def test_merge_ranks_folds_an_attempts_processes_and_keeps_attempts_apart() -> None:
    # Attempt 1: 3 ranks from step 0 (one reached 11 before the JIT stop settled on 10);
    # attempt 2: 2 ranks from step 10, 40 s later; attempt 3: 3 ranks, again at step 10 (a
    # grow before any step) but 200 s later: another attempt.
    lines = (
        _process(1, 0.0, 0, 10) + _process(2, 0.5, 0, 11) + _process(3, 1.0, 0, 10)
        + _process(4, 40.0, 10, 10) + _process(5, 40.2, 10, 10)
        + _process(6, 240.0, 10, 20) + _process(7, 240.1, 10, 20) + _process(8, 240.3, 10, 20)
    )  # fmt: skip
    merged = gp.merge_ranks(gp.segments_from_events(lines))
    assert [(s.pid, s.start_step, s.end_step, s.processes) for s in merged] == [
        (1, 0, 11, 3),
        (4, 10, 10, 2),
        (6, 10, 20, 3),
    ]
    steps = gp.job_steps(merged, running_at_end=False, checkpoint_step=20)
    assert (steps.computed, steps.lost) == (21, 1)


@pytest.mark.parametrize(
    ("running", "ckpt", "window", "expected"),
    [
        # 2 ranks x 10 steps of 1 s from step 0, then 1 rank x 5 steps from step 8: steps 9 and
        # 10 of the first attempt were trained again (not kept); the last attempt keeps all 5.
        (True, None, (0.0, 1000.0), 2 * 8 + 5),
        # The last attempt preempted and waiting, its newest checkpoint at step 10: 2 kept.
        (False, 10, (0.0, 1000.0), 2 * 8 + 2),
        # Only what falls in the window counts (first attempt's steps 1-8 span 0-8 s).
        (True, None, (4.0, 102.0), 2 * 4 + 2),
    ],
)
def test_useful_node_seconds_count_kept_steps_per_process_within_the_window(
    running: bool, ckpt: int | None, window: tuple[float, float], expected: float
) -> None:
    lines = (
        _process(1, 0.0, 0, 10, step_s=1.0) + _process(2, 0.0, 0, 10, step_s=1.0)
        + _process(3, 100.0, 8, 13, step_s=1.0)
    )  # fmt: skip
    segs = gp.segments_from_events(lines)
    assert gp.useful_node_seconds(segs, running, ckpt, window) == pytest.approx(expected)
