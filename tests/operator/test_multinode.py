"""Multi-node TrainingJobs on the real control plane: two pods on two stand-in nodes, each in its
own network namespace, form one process group through the attempt's headless Service (names
from the node agent in place of cluster DNS) and train with real torch processes.

- Kueue preempts a numNodes: 2 job mid-run, then the Eviction API takes one node's pod of the
  next attempt: each time both ranks stop at the same step, one complete JIT checkpoint, the
  next attempt resumes with no lost steps, and the final weights are bit-identical to an
  uninterrupted 2-node run (which also shows it trains to completion);
- a real failure of one rank (exit 1) fails the attempt promptly.

Node loss (a stand-in node stops renewing its Lease, its processes die; the next attempt waits
until the Node is deleted) is part of the chaos soak, tests/operator/test_chaos_soak.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes
import pytest
import torch

from tests.cluster.controlplane import ControlPlane
from tests.cluster.helpers import job_manifest, python_container
from tests.cluster.kueue import Kueue
from tests.cluster.node_agent import NodeAgent, PodRecord
from tests.operator.harness import OperatorProcess, TJClient, toy_training_job, wait_for
from trainer_runtime.protocol import EXIT_PEER_FAILED, read_termination_message

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

STEPS = 48


@pytest.fixture
def netns_agent(node_agent: NodeAgent) -> NodeAgent:
    if node_agent.network is None:
        pytest.skip(f"multi-node pods need network namespaces: {node_agent.network_unavailable}")
    return node_agent


def _two_nodes(name: str, root: Path, **kw: Any) -> dict[str, Any]:
    body = toy_training_job(name, root, numNodes=2, **kw)
    # One rank per node, as real multi-node training would run.
    body["spec"]["podTemplate"] = {
        "spec": {
            "topologySpreadConstraints": [
                {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                 "whenUnsatisfiable": "DoNotSchedule",
                 "labelSelector": {"matchLabels": {"preemptible.dev/training-job": name}}}
            ]
        }
    }  # fmt: skip
    return body


def _attempt_records(agent: NodeAgent, namespace: str, name: str, attempt: int) -> list[PodRecord]:
    prefix = f"{name}-a{attempt}-"
    records = [r for r in agent.records() if r.namespace == namespace and r.name.startswith(prefix)]
    return sorted(records, key=lambda r: r.name)


def _stop_steps(agent: NodeAgent, namespace: str, name: str, attempt: int) -> list[tuple]:
    """(node, exit code, termination-message step) of each pod of the attempt, once finished."""
    out = []
    for record in _attempt_records(agent, namespace, name, attempt):
        record.done.wait(120)
        run = record.last_run()
        assert run is not None and run.exit is not None, record
        message = read_termination_message(run.message)
        out.append((record.node, run.exit.exit_code, message.step if message else None))
    return out


def _describe(tj: TJClient, op: OperatorProcess, *names: str) -> Any:
    return lambda: "\n".join(tj.describe(n) for n in names) + op.tail()


def _final_weights(root: Path, name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    (directory,) = [p for p in (root / name).glob(f"checkpoint-{STEPS}") if p.is_dir()]
    files = sorted(directory.glob("model*.safetensors"))
    assert files, f"no model weights in {directory}: {sorted(directory.iterdir())}"
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights


def test_two_nodes_preempted_by_kueue_then_one_pod_evicted_resume_bit_identical(
    control_plane: ControlPlane,
    netns_agent: NodeAgent,
    kueue: Kueue,
    tj: TJClient,
    operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    """Attempt 1 is preempted by Kueue, attempt 2 loses one node's pod to the Eviction API;
    each time both ranks stop at one step, and attempt 3 ends bit-identical to a 2-node run that
    was never interrupted (which also shows 2-node training runs to completion)."""
    kueue.create_local_queue(tj.ns)
    per_node = str(int(kueue.quota["cpu"]) // 2)  # the two pods take the whole quota
    common = {"max_steps": STEPS, "step_sleep": 0.3, "save_steps": STEPS}
    # The uninterrupted reference, outside Kueue, at the same time.
    tj.create(_two_nodes("ref", checkpoint_root, **common))
    tj.create(
        _two_nodes("mn", checkpoint_root, cpu=per_node, queueName=kueue.local_queue,
                   priorityClass=kueue.low_priority, **common)
    )  # fmt: skip
    describe = _describe(tj, operator, "mn", "ref")
    wait_for(
        "mn training (step >= 4)",
        lambda: (tj.status("mn").get("progress") or {}).get("step", 0) >= 4,
        on_timeout=describe,
    )
    high = job_manifest(
        "high",
        [python_container("import time; time.sleep(3)", cpu=kueue.quota["cpu"])],
        labels=kueue.job_labels(kueue.high_priority),
        suspend=True,
    )
    with control_plane.api_client() as client:
        kubernetes.client.BatchV1Api(client).create_namespaced_job(tj.ns, high)

    def attempt_2_training() -> int | None:
        s = tj.status("mn")
        attempts = s.get("attempts") or []
        if s.get("attempt") != 2 or s.get("phase") != "Running" or not attempts:
            return None
        step = (s.get("progress") or {}).get("step", 0)
        return step if step >= (attempts[0].get("endStep") or 0) + 2 else None

    wait_for("attempt 2 training past its start", attempt_2_training, on_timeout=describe)
    # SIGTERM to one node's pod only.
    (victim,) = [p for p in tj.pods("mn", 2) if p.metadata.name.startswith("mn-a2-1-")]
    tj.evict(victim.metadata.name)
    for name in ("mn", "ref"):
        status = wait_for(
            f"{name} finished",
            lambda name=name: tj.phase_is(name, "Succeeded", "Failed"),
            on_timeout=describe,
        )
        assert status["phase"] == "Succeeded", describe()
    ref = tj.status("ref")
    assert ref["attempt"] == 1 and ref["progress"]["step"] == STEPS, describe()
    status = tj.status("mn")
    first, second, third = status["attempts"]
    assert (first["outcome"], first["reason"]) == ("Preempted", "KueuePreempted"), describe()
    assert (second["outcome"], second["reason"]) == ("Preempted", "PodEvicted"), describe()
    for attempt, record in ((1, first), (2, second)):
        assert record["exitCodes"] == [75, 75] and record["lostSteps"] == 0, describe()
        # Both nodes stopped at the same step, the one the complete JIT checkpoint holds.
        stops = _stop_steps(netns_agent, tj.ns, "mn", attempt)
        assert sorted(node for node, _, _ in stops) == ["node-1", "node-2"], stops
        assert {(code, step) for _, code, step in stops} == {(75, record["endStep"])}, stops
        assert record["checkpoint"].endswith(f"checkpoint-{record['endStep']}"), record
    for before, after in ((first, second), (second, third)):
        assert after["resumeFrom"] == before["checkpoint"], describe()
        assert after["startStep"] == before["endStep"], describe()
    assert (status["preemptions"], status.get("lostSteps", 0)) == (2, 0), describe()
    ours, theirs = _final_weights(checkpoint_root, "mn"), _final_weights(checkpoint_root, "ref")
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), "weights differ"


def test_a_real_failure_of_one_rank_fails_the_attempt_promptly(
    netns_agent: NodeAgent, tj: TJClient, operator: OperatorProcess, checkpoint_root: Path
) -> None:
    body = _two_nodes(
        "rf", checkpoint_root, max_steps=40, step_sleep=0.25, save_steps=100,
        grace={"initialSeconds": 90, "min": 5, "max": 120}, maxRestarts=0,
    )  # fmt: skip
    # Only rank 1 fails: its container's command fails at step 3, rank 0's trains on.
    body["spec"]["env"] = [{"name": "FAIL_RANK", "value": "1"}]
    body["spec"]["command"] = [
        "sh", "-c",
        'if [ "$RANK" = "$FAIL_RANK" ]; then exec python -m trainer_runtime.toy "$@" '
        '--fail-at-step 3; else exec python -m trainer_runtime.toy "$@"; fi', "toy",
    ]  # fmt: skip
    tj.create(body)
    describe = _describe(tj, operator, "rf")
    status = wait_for(
        "rf failed", lambda: tj.phase_is("rf", "Failed", "Succeeded"), on_timeout=describe
    )
    assert status["phase"] == "Failed", describe()
    records = _attempt_records(netns_agent, tj.ns, "rf", 1)
    for record in records:
        record.done.wait(120)
    runs = [(r.name, r.last_run()) for r in records]
    codes = {name: run.exit.exit_code for name, run in runs if run and run.exit}
    # The failing rank exits 1 (a SIGTERM from the Job's end is latched); the other notices
    # within seconds and exits EXIT_PEER_FAILED naming it; the attempt names the failing pod.
    assert sorted((name.split("-")[2], code) for name, code in codes.items()) == [
        ("0", EXIT_PEER_FAILED),
        ("1", 1),
    ], codes
    failed = status["attempts"][0]
    assert "-a1-1-" in failed["message"] and "injected failure" in failed["message"], failed
    # The healthy rank did not sit until the grace deadline (90 s) in the stop vote.
    finished = [run.exited_at for _, run in runs if run and run.exited_at]
    assert len(finished) == 2 and max(finished) - min(finished) < 30, (codes, finished)
