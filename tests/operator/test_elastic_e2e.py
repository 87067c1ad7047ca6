"""Elastic capacity end to end (issue 40 item 5, docs/elastic.md): a TrainingJob of numNodes 3 with
``spec.elastic`` (minNodes 1, gradientAccumulationSteps 2: sizes 1, 2, 3 and 6 keep the global
batch) and a non-elastic copy of it share the session's ClusterQueue (2 CPU) with pods of 300m;
a high-priority Job of 1200m arrives, so Kueue must preempt both (neither alone frees enough).

- The elastic job stops through its JIT path and is running again on 2 pods while the preemptor
  still holds its quota (it does not wait for the third); the seconds from its last pod's exit to
  its new pods running and to its first step are printed.
- The non-elastic job waits, as today: its next attempt has no pod running while the preemptor
  holds the quota (then it is deleted, to spare the 2 cores).
- When the preemptor ends, the elastic job grows back to 3 pods at a JIT checkpoint (a short
  growCooldownSeconds) and finishes Succeeded with no lost step.
- Exactly once: every optimizer step trained on the same multiset of sample indices as an
  uninterrupted run at the reference size (the toy's ``--record-samples`` events, written by
  every pod to one file on the hostPath; the reference is the toy run here as one process with
  the elastic environment, the same global batches in 6 micro-batches, tests/distributed/
  test_elastic_sizes.py shows why sizes see the same samples).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from preemptible_operator import models
from preemptible_operator import workload as wlib
from tests.cluster.controlplane import ControlPlane
from tests.cluster.helpers import job_manifest, python_container
from tests.cluster.kueue import Kueue
from tests.cluster.node_agent import NodeAgent
from tests.operator.harness import OperatorProcess, TJClient, toy_training_job, wait_for
from trainer_runtime import testing
from trainer_runtime.protocol import ENV_ELASTIC_ACCUMULATION, ENV_ELASTIC_REFERENCE_NODES

pytestmark = [pytest.mark.cluster, pytest.mark.kueue, pytest.mark.slow]

NODES, ACCUMULATION = 3, 2
STEPS = 200
POD_CPU = "300m"  # 3 pods of each job fit the 2 CPU queue together (1800m)
PREEMPTOR_CPU = "1200m"  # 1800 + 1200 > 2000, and preempting one job frees only 900m
HOLD = 30  # seconds the preemptor's container sleeps
COOLDOWN = 45  # growCooldownSeconds: a restart of up to 15 s pays 2 -> 3 pods (P <= C/3)
TOY = [
    "--record-samples", "--gradient-accumulation-steps", str(ACCUMULATION),
    "--logging-steps", "1000", "--batch-size", "4", "--num-samples", "96", "--dropout", "0",
]  # fmt: skip


@pytest.fixture
def netns_agent(node_agent: NodeAgent) -> NodeAgent:
    if node_agent.network is None:
        pytest.skip(f"multi-node pods need network namespaces: {node_agent.network_unavailable}")
    return node_agent


def _job(name: str, root: Path, kueue: Kueue, **spec: Any) -> dict[str, Any]:
    events = root / f"events-{name}.jsonl"
    return toy_training_job(
        name, root, max_steps=STEPS, step_sleep=0.1, save_steps=1000, cpu=POD_CPU,
        extra_args=(*TOY, "--events-file", str(events)), numNodes=NODES,
        queueName=kueue.local_queue, priorityClass=kueue.low_priority, **spec,
    )  # fmt: skip


def _reference(workdir: Path) -> subprocess.Popen[bytes]:
    """The uninterrupted run at the reference size's global batches: one process told it is an
    elastic attempt of 3 reference nodes x accumulation 2 (so it accumulates 6 micro-batches)."""
    env = {**os.environ, ENV_ELASTIC_REFERENCE_NODES: str(NODES)}
    env[ENV_ELASTIC_ACCUMULATION] = str(ACCUMULATION)
    argv = [sys.executable, "-P", "-m", "trainer_runtime.toy", "--max-steps", str(STEPS),
            "--save-steps", "1000", "--threads", "1", *TOY, "--output-dir", str(workdir / "out"),
            "--events-file", str(workdir / "events.jsonl")]  # fmt: skip
    log = (workdir / "reference.log").open("wb")
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)


def _samples(events: list[dict[str, Any]], keep: dict[int, tuple[int, int]]) -> dict[int, list]:
    """step -> the sorted sample indices of the steps each process owns: a process is told
    apart by the step it began at (``keep``: start step -> (start, end] of its attempt)."""
    begun = {e["pid"]: int(e["step"]) for e in events if e["event"] == "train_begin"}
    steps: dict[int, list[int]] = {}
    for e in events:
        if e["event"] != "samples" or e["padding"] or begun.get(e["pid"]) not in keep:
            continue
        start, end = keep[begun[e["pid"]]]
        if start < int(e["step"]) <= end:
            steps.setdefault(int(e["step"]), []).extend(e["indices"])
    return {step: sorted(indices) for step, indices in steps.items()}


def _past_attempt_one(status: dict[str, Any]) -> dict[str, Any] | None:
    return status if status.get("attempt", 1) >= 2 else None


def _attempt_stopped(tj: TJClient, name: str, attempt: int) -> bool:
    """Every container of the attempt's pods has exited (or its pod is gone)."""
    for pod in tj.pods(name, attempt):
        if pod.status.phase in ("Succeeded", "Failed"):
            continue
        states = pod.status.container_statuses or []
        if not states or not all(s.state.terminated for s in states):
            return False
    return True


def _pod_phases(tj: TJClient, name: str, attempt: int) -> list[str]:
    return [p.status.phase for p in tj.pods(name, attempt) if not p.metadata.deletion_timestamp]


def test_elastic_job_shrinks_at_once_grows_back_and_trains_every_sample_once(
    control_plane: ControlPlane,
    netns_agent: NodeAgent,
    kueue: Kueue,
    tj: TJClient,
    least_privilege_operator: OperatorProcess,
    checkpoint_root: Path,
    tmp_path: Path,
) -> None:
    # Only operator/rbac.py's grants and the admission policies: the Workload path needs no more.
    operator = least_privilege_operator
    t0 = time.monotonic()
    marks: dict[str, float] = {}

    def mark(what: str) -> None:
        marks[what] = time.monotonic() - t0
        print(f"[elastic-e2e] {marks[what]:6.1f} s {what}", flush=True)

    (tmp_path / "ref").mkdir()
    reference = _reference(tmp_path / "ref")
    kueue.create_local_queue(tj.ns)
    elastic = {"minNodes": 1, "gradientAccumulationSteps": ACCUMULATION,
               "growCooldownSeconds": COOLDOWN}  # fmt: skip
    tj.create(_job("el", checkpoint_root, kueue, elastic=elastic))
    tj.create(_job("fixed", checkpoint_root, kueue))
    describe = lambda: tj.describe("el") + "\n" + tj.describe("fixed") + operator.tail()  # noqa: E731
    wait_for(
        "both jobs training on 3 pods",
        lambda: all(
            (tj.status(n).get("progress") or {}).get("step", 0) >= 2 for n in ("el", "fixed")
        ),
        on_timeout=describe,
    )
    mark("both jobs training")
    high = job_manifest(
        "high",
        [python_container(f"import time; time.sleep({HOLD})", cpu=PREEMPTOR_CPU)],
        labels=kueue.job_labels(kueue.high_priority),
        suspend=True,
    )
    with control_plane.api_client() as client:
        batch = kubernetes.client.BatchV1Api(client)
        batch.create_namespaced_job(tj.ns, high)
        mark("preemptor created")

        def high_done() -> bool:
            job = batch.read_namespaced_job_status("high", tj.ns)
            return bool(job.status.succeeded)

        # The elastic job's JIT stop: its first attempt's containers all exit.
        wait_for(
            "el's first attempt stopped", lambda: _attempt_stopped(tj, "el", 1),
            interval=0.2, on_timeout=describe,
        )  # fmt: skip
        mark("el attempt 1 stopped")
        wait_for(
            "el's second attempt running on 2 pods",
            lambda: _pod_phases(tj, "el", 2).count("Running") == 2,
            interval=0.2, on_timeout=describe,
        )  # fmt: skip
        mark("el attempt 2: 2 pods running")
        first = tj.status("el")["attempts"][0]
        wait_for(
            "el training again",
            lambda: (tj.status("el").get("progress") or {}).get("step", 0) > first["endStep"],
            interval=0.2, on_timeout=describe,
        )  # fmt: skip
        mark("el attempt 2: a step past the JIT checkpoint")
        assert tj.status("el").get("nodes") == "2/3", describe()
        # Shrunk rather than waited: the preemptor still holds its quota.
        assert not high_done(), "the preemptor ended before the elastic job ran again"
        shrink_s = marks["el attempt 2: 2 pods running"] - marks["el attempt 1 stopped"]
        step_s = (
            marks["el attempt 2: a step past the JIT checkpoint"] - marks["el attempt 1 stopped"]
        )
        print(
            f"[elastic-e2e] running again on 2 pods {shrink_s:.1f} s after the JIT stop "
            f"(its first step {step_s:.1f} s after it)"
        )
        assert shrink_s < HOLD, describe()
        # The non-elastic job waits for all 3 pods' quota, as today: its next attempt's Job
        # stays suspended by Kueue while 2 pods' quota would be free.
        fixed = wait_for(
            "fixed's next attempt created",
            lambda: _past_attempt_one(tj.status("fixed")),
            interval=0.2, on_timeout=describe,
        )  # fmt: skip
        assert fixed.get("phase") in ("Pending", "Queued", "Requeueing"), describe()
        mark("fixed attempt 2 created")
        jobs = [j for j in tj.jobs("fixed") if j.metadata.name.startswith("fixed-a2")]
        assert jobs and all(j.spec.suspend for j in jobs), describe()
        assert "Running" not in _pod_phases(tj, "fixed", fixed["attempt"]), describe()
        assert not high_done(), "the non-elastic job was checked after the preemptor ended"
        tj.custom.delete_namespaced_custom_object(
            models.GROUP, models.VERSION, tj.ns, models.PLURAL, "fixed"
        )
        wait_for("the preemptor finished", high_done, timeout=HOLD + 60, on_timeout=describe)
        mark("preemptor finished")
    wait_for(
        "el's third attempt running on 3 pods",
        lambda: _pod_phases(tj, "el", 3).count("Running") == 3,
        on_timeout=describe,
    )
    mark("el attempt 3: 3 pods running")
    status = wait_for(
        "el finished", lambda: tj.phase_is("el", "Succeeded", "Failed"), on_timeout=describe
    )
    mark("el finished")
    assert status["phase"] == "Succeeded", describe()
    attempts = status["attempts"]
    assert [a.get("nodes") for a in attempts] == [3, 2, 3], describe()
    assert attempts[0]["outcome"] == "Preempted" and attempts[-1]["outcome"] == "Succeeded"
    # The grow: a replacement slice, admitted, finished the old one; the attempt it ended was a
    # resize, neither a preemption nor a failure.
    assert (attempts[1]["outcome"], attempts[1]["reason"]) == ("Suspended", "Resizing"), attempts
    assert status.get("preemptions") == 1 and status.get("failures", 0) == 0, describe()
    assert status.get("workload") == wlib.workload_name("el", 2), describe()
    old = tj.custom.get_namespaced_custom_object(
        wlib.KUEUE_GROUP, wlib.KUEUE_VERSION, tj.ns, "workloads", wlib.workload_name("el", 1)
    )
    finished = [c for c in old["status"]["conditions"] if c["type"] == "Finished"]
    assert finished and finished[0]["reason"] == "WorkloadSliceReplaced", old["status"]
    assert status.get("lostSteps", 0) == 0, describe()
    for before, after in itertools.pairwise(attempts):
        assert after["startStep"] == before["endStep"], describe()
    reasons = [reason for reason, _ in tj.events("el")]
    assert {"ScaledDown", "ScaledUp", "GrowRequested"} <= set(reasons), reasons
    log = operator.log.read_text(errors="replace")
    assert "Forbidden" not in log and " 403" not in log, operator.tail(200)

    # Exactly once: each step's samples, from the attempt that owns the step, are the
    # reference's; each attempt ran one process per pod.
    assert reference.wait(120) == 0, (tmp_path / "ref" / "reference.log").read_text()[-2000:]
    expected = _samples(testing.read_events(tmp_path / "ref" / "events.jsonl"), {0: (0, STEPS)})
    assert sorted(expected) == list(range(1, STEPS + 1))
    events = testing.read_events(checkpoint_root / "events-el.jsonl")
    starts = [a.get("startStep") or 0 for a in attempts]
    keep = {s: (s, a.get("endStep") or STEPS) for s, a in zip(starts, attempts, strict=True)}
    pids = {s: {e["pid"] for e in events if e["event"] == "train_begin" and e["step"] == s}
            for s in keep}  # fmt: skip
    assert [len(pids[s]) for s in starts] == [3, 2, 3], pids
    got = _samples(events, keep)
    assert got == expected, sorted(s for s in expected if got.get(s) != expected[s])[:10]
    print("[elastic-e2e] timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in marks.items()))
