"""Goodput under Kueue preemptions, three checkpoint policies on one arrival trace (``python -P
benchmarks/goodput.py``; issue 32).

Starts the real control plane of the cluster test tier (etcd, kube-apiserver, controller-manager,
scheduler), Kueue (PriorityBoost gate on) with a ClusterQueue of K CPUs, the stand-in node agent
with ONE node of K CPUs (a preemptor needs its victim's quota and its place on the node), and
then, per policy, the operator and M low-priority TrainingJobs of 1 CPU each (K run, the rest
queue). Their pods run ``trainer_runtime.toy`` (the real trainer_runtime Trainer on a tiny MLP,
``--step-sleep`` seconds per step, every checkpoint file written with ``--save-sleep`` of delay,
saves synchronous). High-priority batch Jobs of 1 CPU (the preemptors, each holding its CPU for
``--hold`` seconds) arrive at seeded random times; Kueue preempts a TrainingJob for each. The same
arrival trace is replayed under each policy:

(a) ours, with the product's defaults: JIT checkpoint on SIGTERM, the measured (automatic)
    grace period as a spec without ``gracePeriod`` gets it (300 s before anything is measured,
    then the rule, within [30, 3600] s), checkpoint-aware victims (operator ``--priority-boost``,
    ``spec.preemption.minRunSeconds: 0``) and ``spec.checkpoint.interval: auto``;
(b) periodic checkpoints only: the toy's ``--jit-checkpoint false`` (a SIGTERM ends the process
    with no save, as a Trainer without a SIGTERM handler), a pinned 30 s grace, no boost;
(c) transformers-style JIT: a JIT save on SIGTERM, the pinned 30 s grace, no boost (Kueue's own
    victim order) and no interval: auto. transformers' own Trainer is not run here: its JIT save
    on SIGTERM is emulated by our runtime's (see docs/operator.md, "Goodput benchmark").

(e) ours + elastic (issue 40): (a) with ``spec.elastic`` (minNodes 1, the job's own Workload
    admitted at the size that fits, grown back at a checkpoint); needs ``--nodes`` of 2 or more.

All of them keep the script's periodic schedule (``--save-steps``). ``--nodes N`` gives every
TrainingJob N pods of 1 CPU and ``--accumulation A`` the same global batch in every policy;
``--max-steps S`` makes the jobs finite, and each policy then waits for them and prints the time
to finish, next to the useful node-seconds (seconds of kept steps, summed over the pods) within
the trace's window.

Per policy it prints: goodput (steps kept / steps computed), lost steps per preemption, GPU (here
CPU slot) seconds held after SIGTERM, the preemptor's wait until its pod runs, preemptions per
job, and the grace the preempted attempts had. Steps come from the toy's events file (one
``train_begin`` and one ``step_end`` line per step, per process), which is exact even where a
process dies without a termination message (policy b); the operator's own ``status.lostSteps``
(an estimate where an attempt left no message, ``lostStepsEstimated``) is checked against it:
within 10 % (at least one step) per policy, printed, and the exit status is 1 when a policy is
outside. The pure parts (the trace, the step accounting, the
summary) are table-tested in tests/unit/benchmarks/test_goodput.py.

    python -P benchmarks/goodput.py [--k 2] [--m 3] [--arrivals 6] [--duration 240] [--seed 1]
        [--hold 30] [--step-sleep 0.5] [--save-steps 20] [--save-sleep 0.1]
        [--policies a,b,c,e] [--nodes 1] [--accumulation 1] [--grow-cooldown 60]
        [--max-steps S] [--finish-timeout 1800]

docs/operator.md ("Goodput benchmark") records a run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import itertools
import json
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

POLL = 0.2
POLICIES = ("a", "b", "c", "e")
POLICY_NAMES = {
    "a": "ours: JIT + measured grace + checkpoint-aware victims + interval auto",
    "b": "periodic checkpoints only, fixed 30 s grace",
    "c": "JIT on SIGTERM, fixed 30 s grace, no victim choice",
    "e": "ours + elastic: (a) with spec.elastic (minNodes 1), shrinks and grows back",
}
FIXED_GRACE = 30


# ------------------------------------------------------------------------- pure computations
def arrival_trace(seed: int, count: int, duration: float, margin: float) -> list[float]:
    """``count`` arrival times (seconds from the start), uniform in [margin, duration - margin]
    from ``random.Random(seed)``, sorted, rounded to 0.1 s: the same trace for every policy."""
    if count < 0 or duration <= 2 * margin:
        raise ValueError(f"count {count} must be >= 0 and duration {duration} > 2 x {margin}")
    rng = random.Random(seed)
    return sorted(round(rng.uniform(margin, duration - margin), 1) for _ in range(count))


@dataclass(frozen=True)
class Segment:
    """One training process (one attempt's rank 0) as its events file tells it."""

    pid: int
    start_step: int
    """Step it began at (``train_begin``: the checkpoint it resumed from, 0 fresh)."""
    end_step: int
    """Last step it finished (``step_end``); its start when it finished none."""
    first_time: float
    last_time: float
    step_seconds: tuple[float, ...] = ()
    """Wall seconds between its consecutive ``step_end`` events."""
    step_ends: tuple[float, ...] = ()
    """Times of its ``step_end`` events, one per step from start_step + 1 (the first of each
    step when a step ended twice)."""
    begin_time: float | None = None
    """Time of its ``train_begin`` (the checkpoint loaded, the first step about to start)."""
    processes: int = 1
    """Processes (ranks) this segment stands for: :func:`merge_ranks` folds an attempt's."""


def segments_from_events(lines: Iterable[str]) -> list[Segment]:
    """The processes of one job in the order they started, from the toy's JSON event lines."""
    by_pid: dict[int, dict[str, Any]] = {}
    for line in lines:
        line = line.strip()
        if not line:
            continue
        ev = json.loads(line)
        seg = by_pid.setdefault(
            ev["pid"],
            {"start": None, "end": None, "first": ev["time"], "ends": [], "by_step": {}},
        )
        seg["last"] = ev["time"]
        if ev["event"] == "train_begin" and seg["start"] is None:
            seg["start"] = int(ev["step"])
            seg["begin"] = ev["time"]
        elif ev["event"] == "step_end":
            seg["end"] = max(seg["end"] or 0, int(ev["step"]))
            seg["ends"].append(ev["time"])
            seg["by_step"].setdefault(int(ev["step"]), ev["time"])
    out = []
    for pid, seg in by_pid.items():
        if seg["start"] is None:  # never began training (killed while loading): no steps
            continue
        ends = seg["ends"]
        out.append(
            Segment(
                pid=pid,
                start_step=seg["start"],
                end_step=max(seg["start"], seg["end"] or 0),
                first_time=seg["first"],
                last_time=seg["last"],
                step_seconds=tuple(b - a for a, b in itertools.pairwise(ends)),
                step_ends=tuple(
                    t for step, t in sorted(seg["by_step"].items()) if step > seg["start"]
                ),
                begin_time=seg.get("begin"),
            )
        )
    return sorted(out, key=lambda s: s.first_time)


def merge_ranks(segments: Sequence[Segment], gap: float = 60.0) -> list[Segment]:
    """One segment per attempt where a job runs several processes (numNodes > 1, each rank
    writes the same events file): segments in start order that began at the same step within
    ``gap`` seconds of the attempt's first are its ranks. The attempt's segment is its first
    rank's, reaching the furthest step any rank finished; ``processes`` counts them."""
    out: list[Segment] = []
    for seg in segments:
        last = out[-1] if out else None
        if (
            last is not None
            and seg.start_step == last.start_step
            and seg.first_time - last.first_time <= gap
        ):
            out[-1] = Segment(
                pid=last.pid, start_step=last.start_step,
                end_step=max(last.end_step, seg.end_step), first_time=last.first_time,
                last_time=max(last.last_time, seg.last_time), step_seconds=last.step_seconds,
                step_ends=last.step_ends, begin_time=last.begin_time,
                processes=last.processes + seg.processes,
            )  # fmt: skip
        else:
            out.append(seg)
    return out


def useful_node_seconds(
    segments: Sequence[Segment],
    running_at_end: bool,
    checkpoint_step: int | None,
    window: tuple[float, float],
    gap: float = 60.0,
) -> float:
    """Seconds of training kept, summed over processes (one per pod: node-seconds), within
    ``window`` (epoch seconds): each step a process finished counts from its previous step's
    end (or its ``train_begin``) to its own end, when the job kept it: at most the step the
    next attempt began at, or, for the last attempt when it is not training at the end, the
    newest complete checkpoint. Time spent loading, saving after the last kept step, or
    waiting for quota counts for nothing."""
    attempts = merge_ranks(segments, gap)
    bounds: dict[tuple[int, float], int] = {}
    for a, b in itertools.pairwise(attempts):
        bounds[(a.start_step, a.first_time)] = b.start_step
    if attempts:
        last = attempts[-1]
        bounds[(last.start_step, last.first_time)] = (
            last.end_step if running_at_end else min(last.end_step, checkpoint_step or 0)
        )
    lo, hi = window
    total = 0.0
    for attempt in attempts:
        keep = bounds[(attempt.start_step, attempt.first_time)]
        for seg in segments:
            if seg.start_step != attempt.start_step or not (
                0 <= seg.first_time - attempt.first_time <= gap
            ):
                continue
            previous = seg.begin_time if seg.begin_time is not None else seg.first_time
            for step, end in enumerate(seg.step_ends, start=seg.start_step + 1):
                if step <= keep:
                    total += max(0.0, min(end, hi) - max(previous, lo))
                previous = end
    return round(total, 1)


@dataclass(frozen=True)
class JobSteps:
    computed: int
    """Steps its processes finished, counting each step each time it was trained."""
    lost: int
    """Steps trained again (or, at the end, not in the checkpoint the job would resume from)."""


def job_steps(
    segments: Sequence[Segment], running_at_end: bool, checkpoint_step: int | None
) -> JobSteps:
    """Each process computes ``end - start`` steps; the steps a process reached beyond the step
    the next one resumed from are lost. The last process, when it is no longer running at the
    end (preempted, waiting to be readmitted), loses what is beyond ``checkpoint_step`` (the
    newest complete checkpoint, what it will resume from)."""
    computed = sum(s.end_step - s.start_step for s in segments)
    lost = sum(max(0, a.end_step - b.start_step) for a, b in itertools.pairwise(segments))
    if segments and not running_at_end:
        lost += max(0, segments[-1].end_step - (checkpoint_step or 0))
    return JobSteps(computed=computed, lost=lost)


def training_at_end(
    phase: str | None, attempts: Sequence[dict[str, Any]], segments: Sequence[Segment]
) -> bool:
    """Whether the job's last process is its running attempt's, still training: the job is
    Running, its newest attempt has not ended, and the last process began after that attempt's
    Job was created. An attempt still loading (no process of it began yet) is not: the previous
    process then lost what it did beyond the checkpoint the new one resumes from."""
    if phase != "Running" or not attempts or attempts[-1].get("outcome") or not segments:
        return False
    created = _epoch(attempts[-1].get("startTime"))
    return created is None or segments[-1].first_time >= created


def _epoch(rfc3339: str | None) -> float | None:
    if not rfc3339:
        return None
    return dt.datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


def attempt_cause(attempt: dict[str, Any], initial_grace: int | None) -> str:
    """How a preempted attempt ended, for the loss breakdown: its reason, whether a container
    was SIGKILLed, and whether it ran on the grace given before anything was measured."""
    cause = str(attempt.get("reason") or "unknown")
    if attempt.get("killed"):
        cause += " (killed)"
    if initial_grace is not None and attempt.get("graceSeconds") == initial_grace:
        cause += " on the initial grace"
    return cause


def loss_by_cause(
    attempts: Sequence[dict[str, Any]], checkpoint_step: int | None, initial_grace: int | None
) -> dict[str, dict[str, int]]:
    """Steps lost per preempted attempt, grouped by :func:`attempt_cause`: an attempt's endStep
    (its termination message, exact; else the last scraped step, an undercount) minus the step
    the next attempt started from, or, for a last attempt preempted and waiting, minus the newest
    complete checkpoint. The exact total comes from the events (:func:`job_steps`); this says
    where it went."""
    out: dict[str, dict[str, int]] = {}
    for i, a in enumerate(attempts):
        if a.get("outcome") != "Preempted":
            continue
        resumed = attempts[i + 1].get("startStep") if i + 1 < len(attempts) else checkpoint_step
        lost = max(0, int(a.get("endStep") or 0) - int(resumed or 0))
        entry = out.setdefault(attempt_cause(a, initial_grace), {"attempts": 0, "lost": 0})
        entry["attempts"] += 1
        entry["lost"] += lost
    return out


LOST_STEPS_TOLERANCE = 0.10
"""How far status.lostSteps may be from the events' count (a fraction of it): the operator's
estimate for attempts without a termination message (issue 39)."""


def lost_steps_check(
    events_lost: int, status_lost: int, estimated: bool, tolerance: float = LOST_STEPS_TOLERANCE
) -> dict[str, Any]:
    """status.lostSteps (summed over a policy's jobs; ``estimated``: some attempt left no
    termination message) against the steps the events say were lost: within ``tolerance`` of
    the events' count, and never more than one step off when that count is small (an estimate
    is whole steps)."""
    error = status_lost - events_lost
    allowed = max(tolerance * events_lost, 1.0)
    return {
        "events": events_lost,
        "status": status_lost,
        "estimated": estimated,
        "relative_error": round(error / events_lost, 4) if events_lost else None,
        "within_tolerance": abs(error) <= allowed,
    }


def attempt_accounting(attempt: dict[str, Any]) -> dict[str, Any]:
    """What an attempt's record says about its steps (for the per-job output)."""
    keys = ("attempt", "startStep", "endStep", "lastScrapedStep", "stepsPerSecond",
            "unreachableSince", "lostSteps", "lostStepsEstimated", "outcome")  # fmt: skip
    return {k: attempt[k] for k in keys if attempt.get(k) is not None}


def merge_causes(parts: Iterable[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for part in parts:
        for cause, entry in part.items():
            into = out.setdefault(cause, {"attempts": 0, "lost": 0})
            into["attempts"] += entry["attempts"]
            into["lost"] += entry["lost"]
    return dict(sorted(out.items()))


def goodput_at_rate(
    lost_per_preemption: float, step_seconds: float, seconds_between: float = 600.0
) -> float:
    """Goodput at one preemption per ``seconds_between`` of running: a preemption costs
    ``lost_per_preemption`` of the ``seconds_between / step_seconds`` steps computed."""
    computed = seconds_between / step_seconds
    return max(0.0, 1.0 - lost_per_preemption / computed)


def _stats(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "min": None, "max": None, "n": 0}
    return {"mean": round(statistics.fmean(values), 2), "min": round(min(values), 2),
            "max": round(max(values), 2), "n": len(values)}  # fmt: skip


def summarize(
    jobs: Sequence[JobSteps],
    preemptions_per_job: Sequence[int],
    held_seconds: Sequence[float],
    preemptor_waits: Sequence[float],
    graces: Sequence[float],
    step_seconds: float | None,
) -> dict[str, Any]:
    """The figures of one policy (held seconds: one per preempted pod, SIGTERM to exit)."""
    computed = sum(j.computed for j in jobs)
    lost = sum(j.lost for j in jobs)
    preemptions = sum(preemptions_per_job)
    per = lost / preemptions if preemptions else None
    return {
        "steps_computed": computed,
        "steps_kept": computed - lost,
        "steps_lost": lost,
        "goodput": round((computed - lost) / computed, 4) if computed else None,
        "preemptions": preemptions,
        "lost_steps_per_preemption": round(per, 2) if per is not None else None,
        "held_seconds_after_sigterm": round(sum(held_seconds), 1),
        "held_seconds_per_preemption": _stats(held_seconds),
        "preemptor_wait_seconds": _stats(preemptor_waits),
        "grace_seconds_used": _stats(graces),
        "preemptions_per_job": _stats([float(p) for p in preemptions_per_job]),
        "step_seconds": round(step_seconds, 3) if step_seconds else None,
        "goodput_at_1_per_10min": (
            round(goodput_at_rate(per, step_seconds), 4)
            if per is not None and step_seconds
            else None
        ),
    }


# ------------------------------------------------------------------------------- the cluster
def _say(msg: str) -> None:
    print(msg, flush=True)


def _wait(what: str, fn: Any, timeout: float = 300.0) -> Any:
    from benchmarks.preemptor_wait import wait_until  # the cluster's modules: only when run

    return wait_until(what, fn, timeout, poll=0.5)


@dataclass
class PodMarks:
    job: str
    created: float | None = None
    terminating: float | None = None
    exited: float | None = None
    running: float | None = None


@dataclass
class Monitor:
    """Polls the namespace's pods every POLL seconds from a thread: when each one ran, got its
    deletionTimestamp (SIGTERM) and exited (or vanished)."""

    client: Any
    ns: str
    pods: dict[str, PodMarks] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        return thread

    def _run(self) -> None:
        import kubernetes

        core = kubernetes.client.CoreV1Api(self.client)
        while not self.stop.is_set():
            now = time.monotonic()
            try:
                items = core.list_namespaced_pod(self.ns).items
            except Exception:  # a slow apiserver: try again next poll
                time.sleep(POLL)
                continue
            seen = set()
            for p in items:
                uid = p.metadata.uid
                seen.add(uid)
                marks = self.pods.setdefault(
                    uid, PodMarks(job=(p.metadata.labels or {}).get("job-name", ""))
                )
                states = p.status.container_statuses or []
                if marks.running is None and any(s.state.running for s in states):
                    marks.running = now
                if marks.terminating is None and p.metadata.deletion_timestamp is not None:
                    marks.terminating = now
                if marks.exited is None and any(s.state.terminated for s in states):
                    marks.exited = now
                    if marks.running is None:  # ran and ended between two polls
                        marks.running = now
            for uid, marks in self.pods.items():
                if uid not in seen and marks.exited is None and marks.terminating is not None:
                    marks.exited = now
            time.sleep(POLL)


def policy_spec(policy: str, name: str, root: Path, kueue: Any, args: argparse.Namespace) -> dict:
    from tests.operator.harness import toy_training_job

    events = root / f"events-{name}.jsonl"
    extra = ["--save-sleep", str(args.save_sleep), "--save-async", "false"]
    extra += ["--events-file", str(events), "--logging-steps", "1000"]
    if args.accumulation > 1:  # every policy trains the same global batch
        extra += ["--gradient-accumulation-steps", str(args.accumulation)]
    spec: dict[str, Any] = {}
    grace: dict[str, Any] | None = None
    if policy == "e":
        spec["elastic"] = {
            "minNodes": 1,
            "gradientAccumulationSteps": args.accumulation,
            "growCooldownSeconds": args.grow_cooldown,
        }
    if policy in ("a", "e"):
        # The product's defaults: no gracePeriod at all (automatic, GracePolicy's defaults),
        # unless --a-initial-grace asks for the short first grace earlier runs used.
        if args.a_initial_grace is not None:
            grace = {"initialSeconds": args.a_initial_grace, "min": 5, "max": 120}
        spec["checkpoint"] = {"uri": f"{root}/{name}", "interval": "auto"}
        spec["preemption"] = {"minRunSeconds": 0}
    else:
        grace = {"seconds": FIXED_GRACE}
        if policy == "b":
            extra += ["--jit-checkpoint", "false"]
    body = toy_training_job(
        name,
        root,
        max_steps=args.max_steps or 1_000_000,
        step_sleep=args.step_sleep,
        save_steps=args.save_steps,
        extra_args=tuple(extra),
        cpu="1",
        queueName=kueue.local_queue,
        priorityClass=kueue.low_priority,
        numNodes=args.nodes,
        **spec,
    )
    if grace is None:
        del body["spec"]["gracePeriod"]  # the harness's test default is not the product's
    else:
        body["spec"]["gracePeriod"] = grace
    return body


def run_policy(
    cp: Any, kueue: Any, policy: str, ckpt_root: Path, workdir: Path, args: argparse.Namespace,
    trace: list[float],
) -> dict[str, Any]:  # fmt: skip
    import kubernetes

    from benchmarks.operator_scale import Operator
    from preemptible_operator import models
    from tests.cluster.helpers import job_manifest, python_container
    from trainer_runtime.grace import GracePolicy

    ns = f"goodput-{policy}"
    root = ckpt_root / policy
    root.mkdir(parents=True)
    with cp.api_client() as client:
        kubernetes.client.CoreV1Api(client).create_namespace({"metadata": {"name": ns}})
    kueue.create_local_queue(ns)
    extra = ["--checkpoint-path-map", f"{ckpt_root}={ckpt_root}"]
    if policy in ("a", "e"):
        extra.append("--priority-boost")
    op = Operator(cp.kubeconfig, workdir / f"operator-{policy}.log", extra)
    names = [f"job-{i}" for i in range(args.m)]
    try:
        with cp.api_client() as client:
            custom = kubernetes.client.CustomObjectsApi(client)
            batch = kubernetes.client.BatchV1Api(client)
            core = kubernetes.client.CoreV1Api(client)
            tj = (models.GROUP, models.VERSION, ns, models.PLURAL)

            def status(name: str) -> dict[str, Any]:
                return custom.get_namespaced_custom_object(*tj, name).get("status") or {}

            created_at: dict[str, float] = {}
            finished_at: dict[str, float] = {}
            for name in names:
                custom.create_namespaced_custom_object(
                    *tj[:3], tj[3], policy_spec(policy, name, root, kueue, args)
                )
                created_at[name] = time.monotonic()
            # Warm-up: K jobs training before the first arrival's clock starts.
            _wait(
                "K jobs training",
                lambda: (
                    sum((status(n).get("progress") or {}).get("step", 0) >= 1 for n in names)
                    >= min(args.k // args.nodes, args.m)
                ),
                timeout=600,
            )
            monitor = Monitor(client, ns)
            thread = monitor.start()
            t0 = time.monotonic()
            window_start = time.time()
            created: dict[str, float] = {}
            for i, at in enumerate(trace):
                time.sleep(max(0.0, t0 + at - time.monotonic()))
                pre = f"pre-{i}"
                body = job_manifest(
                    pre,
                    [python_container(f"import time; time.sleep({args.hold})", cpu="1")],
                    labels=kueue.job_labels(kueue.high_priority),
                    suspend=True,
                )
                created[pre] = time.monotonic()
                batch.create_namespaced_job(ns, body)
                _say(f"  [{policy}] t={at:6.1f} s preemptor {pre} created")
            time.sleep(max(0.0, t0 + args.duration - time.monotonic()))
            window_end = time.time()

            # Settle: every preemptor ran; no training pod is still stopping.
            def settled() -> bool:
                ran = all(
                    any(m.job == pre and m.running for m in monitor.pods.values())
                    for pre in created
                )
                stopping = any(
                    m.terminating and not m.exited
                    for m in monitor.pods.values()
                    if not m.job.startswith("pre-")
                )
                return ran and not stopping

            with contextlib.suppress(TimeoutError):
                _wait("settled", settled, timeout=args.hold + 120)
            if args.max_steps:  # run to the end: the time to finish

                def all_finished() -> bool:
                    for n in names:
                        if n not in finished_at and status(n).get("phase") in (
                            "Succeeded",
                            "Failed",
                        ):
                            finished_at[n] = time.monotonic()
                    return len(finished_at) == len(names)

                with contextlib.suppress(TimeoutError):
                    _wait("all jobs finished", all_finished, timeout=args.finish_timeout)
            time.sleep(2 * POLL)
            monitor.stop.set()
            thread.join()
            statuses = {n: status(n) for n in names}
    finally:
        # Delete while the operator runs (it holds the finalizers), then stop it.
        with contextlib.suppress(Exception), cp.api_client() as client:
            custom = kubernetes.client.CustomObjectsApi(client)
            batch = kubernetes.client.BatchV1Api(client)
            core = kubernetes.client.CoreV1Api(client)
            tj = (models.GROUP, models.VERSION, ns, models.PLURAL)
            for name in names:
                with contextlib.suppress(Exception):
                    custom.delete_namespaced_custom_object(*tj, name)
            for job in batch.list_namespaced_job(ns).items:
                with contextlib.suppress(Exception):
                    batch.delete_namespaced_job(
                        job.metadata.name, ns, propagation_policy="Background"
                    )
            _wait(
                "policy cleaned up",
                lambda: (
                    not core.list_namespaced_pod(ns).items
                    and not custom.list_namespaced_custom_object(*tj)["items"]
                ),
                timeout=180,
            )
        op.stop()

    jobs, preemptions, graces, sigterm = [], [], [], []
    causes: list[dict[str, dict[str, int]]] = []
    initial = None
    if policy == "a":
        initial = args.a_initial_grace or GracePolicy.initial_seconds
    step_times: list[float] = []
    segs_by_job: dict[str, list[Segment]] = {}
    node_seconds = 0.0
    for name in names:
        st = statuses[name]
        events = root / f"events-{name}.jsonl"
        ranks = segments_from_events(events.read_text().splitlines() if events.exists() else [])
        segs = merge_ranks(ranks)  # one per attempt (numNodes > 1: every rank writes events)
        segs_by_job[name] = segs
        attempts = st.get("attempts") or []
        running = training_at_end(st.get("phase"), attempts, segs)
        ckpt = (st.get("lastCompleteCheckpoint") or {}).get("step")
        jobs.append(job_steps(segs, running, ckpt))
        node_seconds += useful_node_seconds(
            ranks, running or st.get("phase") == "Succeeded", ckpt, (window_start, window_end)
        )
        causes.append(loss_by_cause(attempts, ckpt, initial))
        preemptions.append(int(st.get("preemptions") or 0))
        for a in attempts:
            if a.get("outcome") == "Preempted":
                if a.get("graceSeconds") is not None:
                    graces.append(float(a["graceSeconds"]))
                if a.get("sigtermToExitSeconds") is not None:
                    sigterm.append(float(a["sigtermToExitSeconds"]))
        for s in segs:
            step_times.extend(s.step_seconds)
    held = [
        m.exited - m.terminating
        for m in monitor.pods.values()
        if not m.job.startswith("pre-") and m.terminating and m.exited
    ]
    waits = []
    for pre, at in created.items():
        ran = [m.running for m in monitor.pods.values() if m.job == pre and m.running]
        if ran:
            waits.append(min(ran) - at)
    summary = summarize(
        jobs,
        preemptions,
        held,
        waits,
        graces,
        statistics.median(step_times) if step_times else None,
    )
    summary["lost_steps_by_cause"] = merge_causes(causes)
    summary["useful_node_seconds_in_window"] = round(node_seconds, 1)
    summary["node_seconds_in_window"] = round(args.k * (window_end - window_start), 1)
    summary["time_to_finish_seconds"] = _stats(
        [finished_at[n] - created_at[n] for n in names if n in finished_at]
    )
    summary["unfinished"] = [n for n in names if args.max_steps and n not in finished_at]
    summary["nodes_per_attempt"] = {
        n: [a.get("nodes") for a in statuses[n].get("attempts") or []] for n in names
    }
    summary["operator_lost_steps"] = sum(int(s.get("lostSteps") or 0) for s in statuses.values())
    summary["operator_lost_steps_check"] = lost_steps_check(
        summary["steps_lost"],
        summary["operator_lost_steps"],
        any(bool(s.get("lostStepsEstimated")) for s in statuses.values()),
    )
    summary["sigterm_to_exit_seconds_records"] = _stats(sigterm)
    summary["per_job"] = {
        n: {"computed": j.computed, "lost": j.lost, "preemptions": p, "phase": statuses[n].get(
            "phase"), "status_lost": int(statuses[n].get("lostSteps") or 0),
            "segments": [(s.start_step, s.end_step) for s in segs_by_job[n]],
            "attempts": [attempt_accounting(a) for a in statuses[n].get("attempts") or []]}
        for n, j, p in zip(names, jobs, preemptions, strict=True)
    }  # fmt: skip
    return summary


def table(results: dict[str, dict[str, Any]]) -> str:
    """The Markdown table the docs keep."""

    def fmt(v: Any) -> str:
        return "-" if v is None else f"{v:g}" if isinstance(v, float) else str(v)

    rows = [
        "| policy | goodput | steps kept / computed | preemptions | lost steps / preemption "
        "| held after SIGTERM, s (total; mean, max per pod) | preemptor wait, s (mean; max) "
        "| grace used, s (mean) | preemptions per job (mean; max) | goodput at 1 per 10 min |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p, r in results.items():
        h, w, g, j = (r["held_seconds_per_preemption"], r["preemptor_wait_seconds"],
                      r["grace_seconds_used"], r["preemptions_per_job"])  # fmt: skip
        rows.append(
            f"| ({p}) | {fmt(r['goodput'])} | {r['steps_kept']} / {r['steps_computed']} "
            f"| {r['preemptions']} | {fmt(r['lost_steps_per_preemption'])} "
            f"| {fmt(r['held_seconds_after_sigterm'])}; {fmt(h['mean'])}, {fmt(h['max'])} "
            f"| {fmt(w['mean'])}; {fmt(w['max'])} | {fmt(g['mean'])} "
            f"| {fmt(j['mean'])}; {fmt(j['max'])} | {fmt(r['goodput_at_1_per_10min'])} |"
        )
    return "\n".join(rows)


def elastic_table(results: dict[str, dict[str, Any]]) -> str:
    """The Markdown table of useful node-seconds and time to finish (the elastic comparison)."""

    def fmt(v: Any) -> str:
        return "-" if v is None else f"{v:g}" if isinstance(v, float) else str(v)

    rows = [
        "| policy | useful node-seconds in the window (of the quota's) | time to finish, s "
        "(mean; max) | pods per attempt |",
        "|---|---|---|---|",
    ]
    for p, r in results.items():
        f = r["time_to_finish_seconds"]
        sizes = "; ".join(
            ",".join(fmt(n) for n in nodes) for nodes in r["nodes_per_attempt"].values()
        )
        rows.append(
            f"| ({p}) | {fmt(r['useful_node_seconds_in_window'])} "
            f"({fmt(r['node_seconds_in_window'])}) | {fmt(f['mean'])}; {fmt(f['max'])}"
            f"{' (unfinished: ' + ', '.join(r['unfinished']) + ')' if r['unfinished'] else ''} "
            f"| {sizes} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=2, help="quota: jobs that run at once")
    parser.add_argument("--m", type=int, default=3, help="low-priority TrainingJobs")
    parser.add_argument("--arrivals", type=int, default=6, help="high-priority preemptors")
    parser.add_argument("--duration", type=float, default=240.0, help="seconds per policy")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--hold", type=float, default=30.0, help="seconds a preemptor runs")
    parser.add_argument("--step-sleep", type=float, default=0.5, help="seconds per toy step")
    parser.add_argument("--save-steps", type=int, default=20, help="periodic checkpoint every N")
    parser.add_argument("--save-sleep", type=float, default=0.1, help="delay per checkpoint file")
    parser.add_argument("--policies", default="a,b,c")
    parser.add_argument(
        "--a-initial-grace",
        type=int,
        default=None,
        help="policy (a) with gracePeriod {initialSeconds: N, min: 5, max: 120} instead of the "
        "product's defaults (the setup of the runs before issue 37)",
    )
    parser.add_argument("--nodes", type=int, default=1, help="numNodes of each TrainingJob")
    parser.add_argument(
        "--accumulation", type=int, default=1,
        help="gradient accumulation at --nodes pods (every policy; (e)'s elastic sizes keep "
        "the global batch: --nodes 3 --accumulation 2 allows 1, 2 and 3 pods)",
    )  # fmt: skip
    parser.add_argument("--grow-cooldown", type=int, default=60, help="(e): growCooldownSeconds")
    parser.add_argument(
        "--max-steps", type=int, default=None,
        help="steps per job; then each policy also waits for its jobs to finish and prints the "
        "time to finish (default: the jobs never finish within the window)",
    )  # fmt: skip
    parser.add_argument("--finish-timeout", type=float, default=1800.0)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    if unknown := set(policies) - set(POLICIES):
        parser.error(f"unknown policies {sorted(unknown)}: choose from {POLICIES}")
    if "e" in policies and args.nodes < 2:
        parser.error("policy e (elastic) needs --nodes 2 or more")
    if args.nodes > args.k:
        parser.error(f"--nodes {args.nodes} pods of 1 CPU cannot fit --k {args.k}")
    trace = arrival_trace(args.seed, args.arrivals, args.duration, margin=10.0)
    _say(f"trace (seed {args.seed}): preemptors at {trace} s, each holding 1 CPU {args.hold} s")

    from benchmarks.operator_scale import AgentProcess
    from tests.cluster.binaries import find_binaries
    from tests.cluster.controlplane import ControlPlane
    from tests.cluster.kueue import Kueue
    from tests.operator.harness import install_crd

    workdir = Path(tempfile.mkdtemp(prefix="preemptible-goodput-"))
    ckpt_root = workdir / "ckpt"
    ckpt_root.mkdir()
    binaries = find_binaries()
    cp = ControlPlane(binaries, workdir / "cluster")
    kueue = agent = None
    results: dict[str, dict[str, Any]] = {}
    t_start = time.monotonic()
    try:
        cp.start()
        kueue = Kueue(cp, quota_cpu=str(args.k), quota_memory="8Gi")
        kueue.start()
        agent = AgentProcess(
            cp,
            workdir / "node-agent",
            nodes=["bench-0"],
            capacity={"cpu": str(args.k), "memory": "16Gi", "pods": "64",
                      "ephemeral-storage": "20Gi"},
            k8s_version=binaries.k8s_version,
        )  # fmt: skip
        with cp.api_client() as client:
            install_crd(client)
        for policy in policies:
            _say(f"policy ({policy}): {POLICY_NAMES[policy]} ...")
            t = time.monotonic()
            results[policy] = run_policy(cp, kueue, policy, ckpt_root, workdir, args, trace)
            _say(f"policy ({policy}) in {time.monotonic() - t:.0f} s: "
                 f"{json.dumps(results[policy])}")  # fmt: skip
    finally:
        if agent is not None:
            agent.stop()
        if kueue is not None:
            kueue.stop()
        cp.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    out = {"args": vars(args) | {"json": None}, "trace": trace, "results": results,
           "seconds": round(time.monotonic() - t_start)}  # fmt: skip
    print(json.dumps(out, indent=2))
    print(table(results))
    if args.max_steps or "e" in results:
        print(elastic_table(results))
    for policy, r in results.items():
        for cause, entry in r["lost_steps_by_cause"].items():
            print(f"({policy}) {cause}: {entry['attempts']} attempts, {entry['lost']} steps lost")
    outside = []
    for policy, r in results.items():
        check = r["operator_lost_steps_check"]
        print(
            f"({policy}) status.lostSteps {check['status']}"
            f"{' (estimated)' if check['estimated'] else ''} against {check['events']} from the "
            f"events: error {fmt_error(check['relative_error'])}, "
            f"{'within' if check['within_tolerance'] else 'OUTSIDE'} "
            f"{LOST_STEPS_TOLERANCE:.0%}"
        )
        if not check["within_tolerance"]:
            outside.append(policy)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 1 if outside else 0


def fmt_error(relative: float | None) -> str:
    return "-" if relative is None else f"{relative:+.1%}"


if __name__ == "__main__":
    sys.exit(main())
