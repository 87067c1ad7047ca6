"""Checkpoint-aware victims on the real control plane with Kueue (feature gate PriorityBoost on,
tests/cluster/kueue.py; issue 32): the operator runs with --priority-boost, two running
TrainingJobs of the same priority class share the quota, and a higher-class Job needs half of it.

Both jobs' nodes give a 1 s notice (spec.gracePeriod.nodeNoticeSeconds), so no JIT save fits the
deadline and a preemption loses the work since the newest complete checkpoint. Left to itself
Kueue preempts the most recently admitted of equal-priority candidates; each test admits the job
the boost must save last, so without the boost Kueue would preempt the other one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from preemptible_operator.victims import BOOST_ANNOTATION
from tests.cluster.controlplane import ControlPlane
from tests.cluster.helpers import job_manifest, python_container
from tests.cluster.kueue import Kueue
from tests.cluster.node_agent import NodeAgent
from tests.operator.harness import (
    OperatorProcess,
    TJClient,
    delete_training_jobs,
    free_port,
    toy_training_job,
    wait_for,
)

pytestmark = [pytest.mark.cluster, pytest.mark.kueue, pytest.mark.slow]

BAND = 100  # low=100, high=1000 in tests/cluster/kueue.py: the band stays inside the gap
NOTICE = {"initialSeconds": 30, "min": 5, "max": 120, "nodeNoticeSeconds": 1}


@pytest.fixture
def boosting_operator(
    control_plane: ControlPlane,
    tj_crd: None,
    kueue_namespace: str,
    checkpoint_root: Path,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> Iterator[OperatorProcess]:
    band = getattr(request, "param", BAND)
    op = OperatorProcess(
        control_plane.kubeconfig,
        kueue_namespace,
        checkpoint_root,
        tmp_path / "operator.log",
        extra=("--priority-boost", "--priority-boost-max", str(band)),
        metrics_port=free_port(),
    )
    op.start()
    try:
        yield op
    finally:
        failed = getattr(request.node, "rep_call", None)
        if failed is not None and failed.failed:
            print(f"--- operator log ({op.log}) ---\n{op.tail(150)}")
        with control_plane.api_client() as client:
            delete_training_jobs(client, kueue_namespace, op)
        op.kill()


def _job(
    kueue: Kueue, checkpoint_root: Path, name: str, *, save_steps: int, **spec: Any
) -> dict[str, Any]:
    return toy_training_job(
        name,
        checkpoint_root,
        max_steps=5000,
        step_sleep=0.5,
        save_steps=save_steps,
        cpu="1",  # two of them fill the ClusterQueue's 2 CPUs
        grace=NOTICE,
        queueName=kueue.local_queue,
        priorityClass=kueue.low_priority,
        **spec,
    )


def _boost(kueue: Kueue, tj: TJClient, name: str) -> int | None:
    jobs = tj.jobs(name)
    if len(jobs) != 1:
        return None
    workload = kueue.workload_for_job(tj.ns, jobs[0].metadata.uid)
    value = ((workload or {}).get("metadata", {}).get("annotations") or {}).get(BOOST_ANNOTATION)
    return int(value) if value is not None else None


def _start(tj: TJClient, op: OperatorProcess, body: dict[str, Any], min_step: int) -> None:
    name = body["metadata"]["name"]
    tj.create(body)
    wait_for(
        f"{name} running at step >= {min_step}",
        lambda: (tj.status(name).get("progress") or {}).get("step", 0) >= min_step,
        timeout=180,
        on_timeout=lambda: tj.describe(name) + op.tail(),
    )


def _create_high(control_plane: ControlPlane, kueue: Kueue, tj: TJClient, seconds: int) -> None:
    """A high-priority batch Job that needs one CPU for ``seconds``."""
    high = job_manifest(
        "high",
        [python_container(f"import time; time.sleep({seconds})", cpu="1")],
        labels=kueue.job_labels(kueue.high_priority),
        suspend=True,
    )
    kubernetes.client.BatchV1Api(control_plane.api_client()).create_namespaced_job(tj.ns, high)


def _preempt_one(
    control_plane: ControlPlane, kueue: Kueue, tj: TJClient, op: OperatorProcess
) -> str:
    """A high-priority Job that needs one of the two CPUs: Kueue preempts one TrainingJob; its
    name."""
    _create_high(control_plane, kueue, tj, seconds=20)

    def preempted() -> list[str]:
        return [
            name
            for name in ("a", "b")
            if any(
                r.get("reason") == "KueuePreempted" for r in tj.status(name).get("attempts") or []
            )
        ]

    names = wait_for(
        "a TrainingJob preempted by Kueue",
        preempted,
        timeout=120,
        on_timeout=lambda: tj.describe("a") + tj.describe("b") + op.tail(),
    )
    assert len(names) == 1, names
    return names[0]


def test_kueue_preempts_the_job_with_the_fresher_checkpoint(
    control_plane: ControlPlane,
    node_agent: NodeAgent,
    kueue: Kueue,
    kueue_namespace: str,
    tj: TJClient,
    boosting_operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    op = boosting_operator
    # a: a checkpoint every step (admitted first); b: none yet (admitted last: Kueue's own pick).
    _start(tj, op, _job(kueue, checkpoint_root, "a", save_steps=1), min_step=3)
    _start(tj, op, _job(kueue, checkpoint_root, "b", save_steps=100_000), min_step=3)
    assert (tj.status("a").get("lastCompleteCheckpoint") or {}).get("step", 0) >= 2
    assert tj.status("b").get("lastCompleteCheckpoint") is None
    boosts = wait_for(
        "both Workloads boosted, the fresher checkpoint lower",
        lambda: (
            (a := _boost(kueue, tj, "a")) is not None
            and (b := _boost(kueue, tj, "b")) is not None
            and a < b
            and (a, b)
        ),
        timeout=60,
        on_timeout=lambda: (
            f"boosts {_boost(kueue, tj, 'a')}, {_boost(kueue, tj, 'b')}\n" + op.tail()
        ),
    )
    assert all(0 <= v < BAND for v in boosts), boosts

    assert _preempt_one(control_plane, kueue, tj, op) == "a"
    b = tj.status("b")
    assert (b.get("attempt"), b.get("preemptions") or 0, b.get("phase")) == (1, 0, "Running")
    assert "priority boost" in op.log.read_text(errors="replace")


def test_min_run_seconds_protects_a_job_inside_its_window(
    control_plane: ControlPlane,
    node_agent: NodeAgent,
    kueue: Kueue,
    kueue_namespace: str,
    tj: TJClient,
    boosting_operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    op = boosting_operator
    # a: no checkpoint, the costlier victim, admitted first. b: a checkpoint every step (the
    # cheaper victim, and admitted last) but inside its minRunSeconds window: protected.
    _start(tj, op, _job(kueue, checkpoint_root, "a", save_steps=100_000), min_step=3)
    _start(
        tj,
        op,
        _job(kueue, checkpoint_root, "b", save_steps=1, preemption={"minRunSeconds": 600}),
        min_step=3,
    )
    wait_for(
        "b protected at the top of the band, a boosted below it",
        lambda: _boost(kueue, tj, "b") == BAND and (_boost(kueue, tj, "a") or BAND) < BAND,
        timeout=60,
        on_timeout=lambda: (
            f"boosts {_boost(kueue, tj, 'a')}, {_boost(kueue, tj, 'b')}\n" + op.tail()
        ),
    )

    assert _preempt_one(control_plane, kueue, tj, op) == "a"
    b = tj.status("b")
    assert (b.get("attempt"), b.get("preemptions") or 0, b.get("phase")) == (1, 0, "Running")
    # a's next attempt waits in the queue without a boost: its old Workload lost it when the
    # operator deactivated it, the new one never had one.
    wait_for("a's attempt 2 created", lambda: tj.status("a").get("attempt") == 2, timeout=60)
    for job in tj.jobs("a"):
        workload = kueue.workload_for_job(tj.ns, job.metadata.uid) or {}
        annotations = workload.get("metadata", {}).get("annotations") or {}
        assert BOOST_ANNOTATION not in annotations, (job.metadata.name, annotations)


WIDE = 5000  # wider than the gap between low (100) and high (1000)


@pytest.mark.parametrize("boosting_operator", [WIDE], indirect=True)
def test_a_band_wider_than_the_class_gap_never_lifts_a_job_level_with_a_higher_class(
    control_plane: ControlPlane,
    node_agent: NodeAgent,
    kueue: Kueue,
    kueue_namespace: str,
    tj: TJClient,
    boosting_operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    """--priority-boost-max 5000 would put a protected low job (100 + 5000) above the high
    class (1000) and Kueue would never preempt it; the operator narrows the band to 899."""
    op = boosting_operator
    body = toy_training_job(
        "a",
        checkpoint_root,
        max_steps=5000,
        step_sleep=0.5,
        save_steps=1,
        cpu="2",  # the whole quota: the high Job needs a preemption
        grace=NOTICE,
        queueName=kueue.local_queue,
        priorityClass=kueue.low_priority,
        preemption={"minRunSeconds": 600},
    )
    _start(tj, op, body, min_step=2)
    top = kueue.priorities["high"] - kueue.priorities["low"] - 1
    wait_for(
        f"a protected at the narrowed top of the band ({top})",
        lambda: _boost(kueue, tj, "a") == top,
        timeout=60,
        on_timeout=lambda: f"boost {_boost(kueue, tj, 'a')}\n" + op.tail(),
    )
    _create_high(control_plane, kueue, tj, seconds=5)
    wait_for(
        "a preempted by the higher class despite its protection",
        lambda: any(
            r.get("reason") == "KueuePreempted" for r in tj.status("a").get("attempts") or []
        ),
        timeout=120,
        on_timeout=lambda: tj.describe("a") + op.tail(),
    )
    assert "band for priority 100 narrowed from 5000 to 899" in op.log.read_text(errors="replace")
