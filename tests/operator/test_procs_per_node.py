"""Pods of several processes (``numProcPerNode``) on the real control plane: two pods on two
stand-in nodes, two training processes each (4 ranks, gloo), every pod ending as one unit.

- our launcher (the operator starts the command through ``trainer-runtime launch``), two
  DataLoader workers per rank: Kueue preempts the job mid-run; both pods exit 75 with one
  message each at one step, the next attempt resumes with no lost steps and ends bit-identical
  to an uninterrupted 2 x 2 run;
- a stock transformers script under plain torchrun (``python -m torch.distributed.run``, which
  reads the PET_* variables the operator renders): preempted by Kueue, the pods exit with
  torchrun's own code after a complete JIT checkpoint, the attempt is a preemption with no lost
  steps, and the resumed run ends bit-identical to an uninterrupted one;
- ``accelerate launch`` as users write it (``command: [accelerate, launch]`` with the flags
  docs/operator.md gives) running a transformers script with only the import changed, which
  parses its arguments with ``HfArgumentParser`` and loads data with two DataLoader workers per
  rank: preempted by Kueue, it writes its JIT checkpoint, the next attempt resumes from the newest
  complete checkpoint with no lost steps, and ends bit-identical to an uninterrupted run;
- one local worker raising: the attempt fails promptly, naming the pod, local rank and rank, the
  grace is not doubled.
"""

from __future__ import annotations

import json
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
from trainer_runtime.checkpoint.layout import CheckpointStore
from trainer_runtime.protocol import EXIT_PEER_FAILED, EXIT_PREEMPTED, read_termination_message

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

STEPS = 24
STOCK_SCRIPT = Path(__file__).resolve().parents[1] / "runtime" / "hf_stock_script.py"
PARSER_SCRIPT = Path(__file__).resolve().parents[1] / "runtime" / "hf_parser_script.py"


@pytest.fixture
def netns_agent(node_agent: NodeAgent) -> NodeAgent:
    if node_agent.network is None:
        pytest.skip(f"multi-node pods need network namespaces: {node_agent.network_unavailable}")
    return node_agent


def _two_by_two(name: str, root: Path, **kw: Any) -> dict[str, Any]:
    body = toy_training_job(name, root, numNodes=2, numProcPerNode=2, **kw)
    # One pod per node, as real multi-node training would run.
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


def _records(agent: NodeAgent, namespace: str, name: str, attempt: int) -> list[PodRecord]:
    prefix = f"{name}-a{attempt}-"
    records = [r for r in agent.records() if r.namespace == namespace and r.name.startswith(prefix)]
    return sorted(records, key=lambda r: r.name)


def _ends(agent: NodeAgent, namespace: str, name: str, attempt: int) -> list[tuple]:
    """(node, exit code, termination message) of each pod of the attempt, once finished."""
    out = []
    for record in _records(agent, namespace, name, attempt):
        record.done.wait(120)
        run = record.last_run()
        assert run is not None and run.exit is not None, record
        out.append((record.node, run.exit.exit_code, read_termination_message(run.message)))
    return out


def _describe(tj: TJClient, op: OperatorProcess, *names: str) -> Any:
    return lambda: "\n".join(tj.describe(n) for n in names) + op.tail()


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(directory.glob("model*.safetensors"))
    assert files, f"no model weights in {directory}: {sorted(directory.iterdir())}"
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights


def _preempt_with_a_high_priority_job(
    control_plane: ControlPlane, kueue: Kueue, namespace: str
) -> None:
    high = job_manifest(
        "high",
        [python_container("import time; time.sleep(3)", cpu=kueue.quota["cpu"])],
        labels=kueue.job_labels(kueue.high_priority),
        suspend=True,
    )
    with control_plane.api_client() as client:
        kubernetes.client.BatchV1Api(client).create_namespaced_job(namespace, high)


def _check_preempted_attempt(
    agent: NodeAgent, tj: TJClient, name: str, record: dict[str, Any], describe: Any
) -> None:
    assert (record["outcome"], record["reason"]) == ("Preempted", "KueuePreempted"), describe()
    assert record["lostSteps"] == 0, describe()
    ends = _ends(agent, tj.ns, name, 1)
    assert sorted(node for node, _, _ in ends) == ["node-1", "node-2"], ends
    for _, _, msg in ends:
        # One message per pod, for the step the complete JIT checkpoint holds.
        assert msg is not None and msg.reason == "preempted" and msg.complete, ends
        assert msg.step == record["endStep"], (ends, record)
    assert record["checkpoint"].endswith(f"checkpoint-{record['endStep']}"), record


def test_two_by_two_preempted_by_kueue_resumes_bit_identical(
    control_plane: ControlPlane,
    netns_agent: NodeAgent,
    kueue: Kueue,
    tj: TJClient,
    operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    kueue.create_local_queue(tj.ns)
    per_node = str(int(kueue.quota["cpu"]) // 2)  # the two pods take the whole quota
    # 4 DDP ranks resume bit-identical with full determinism (docs/distributed.md); two
    # DataLoader workers per rank, as GPU jobs run (the launcher's SIGTERM reaches them too).
    common = {
        "max_steps": STEPS, "step_sleep": 0.3, "save_steps": STEPS,
        "extra_args": ("--full-determinism", "--dataloader-num-workers", "2"),
    }  # fmt: skip
    tj.create(_two_by_two("ref", checkpoint_root, **common))
    tj.create(
        _two_by_two("pp", checkpoint_root, cpu=per_node, queueName=kueue.local_queue,
                    priorityClass=kueue.low_priority, **common)
    )  # fmt: skip
    describe = _describe(tj, operator, "pp", "ref")
    wait_for(
        "pp training (step >= 4)",
        lambda: (tj.status("pp").get("progress") or {}).get("step", 0) >= 4,
        on_timeout=describe,
    )
    _preempt_with_a_high_priority_job(control_plane, kueue, tj.ns)
    for name in ("pp", "ref"):
        status = wait_for(
            f"{name} finished",
            lambda name=name: tj.phase_is(name, "Succeeded", "Failed"),
            on_timeout=describe,
        )
        assert status["phase"] == "Succeeded", describe()
    ref = tj.status("ref")
    assert ref["attempt"] == 1 and ref["progress"]["step"] == STEPS, describe()
    status = tj.status("pp")
    first, second = status["attempts"]
    assert first["exitCodes"] == [EXIT_PREEMPTED, EXIT_PREEMPTED], describe()
    _check_preempted_attempt(netns_agent, tj, "pp", first, describe)
    # The launcher's SIGTERM-to-exit (to the last worker's end) is what the attempt records.
    assert 0 < first["sigtermToExitSeconds"] < first["graceSeconds"], first
    assert second["resumeFrom"] == first["checkpoint"], describe()
    assert second["startStep"] == first["endStep"], describe()
    assert (status["preemptions"], status.get("lostSteps", 0)) == (1, 0), describe()
    # The ranks shared the JIT checkpoint (issue 28): the model's and the optimizer's tensors
    # are spread over shards written by several ranks, each group with its index. (The toy's
    # 16 tensors are split by bytes, so not every rank holds a tensor of both groups.)
    jit = checkpoint_root / "pp" / f"checkpoint-{first['endStep']}"
    for stem in ("model", "optimizer"):
        shards = sorted(p.name for p in jit.glob(f"{stem}-*-of-*.safetensors"))
        assert len(shards) >= 2 and (jit / f"{stem}.safetensors.index.json").is_file(), shards
    ours = _weights(checkpoint_root / "pp" / f"checkpoint-{STEPS}")
    theirs = _weights(checkpoint_root / "ref" / f"checkpoint-{STEPS}")
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), "weights differ"


def _stock_under_torchrun(name: str, root: Path, **kw: Any) -> dict[str, Any]:
    """The unmodified transformers script under plain torchrun, through the no-code runner:
    torchrun's options all come from the PET_* variables the operator renders."""
    body = _two_by_two(name, root, **kw)
    body["spec"]["command"] = ["python", "-m", "torch.distributed.run"]
    body["spec"]["args"] = [
        "-m", "trainer_runtime.hf.run", str(STOCK_SCRIPT), "--output-dir", "unused",
        "--max-steps", str(STEPS), "--save-steps", str(STEPS), "--step-sleep", "0.3",
    ]  # fmt: skip
    body["spec"]["resourcesPerNode"]["requests"]["memory"] = "1Gi"
    return body


def test_stock_transformers_script_under_plain_torchrun_preempted_by_kueue(
    control_plane: ControlPlane,
    netns_agent: NodeAgent,
    kueue: Kueue,
    tj: TJClient,
    operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    kueue.create_local_queue(tj.ns)
    per_node = str(int(kueue.quota["cpu"]) // 2)
    tj.create(_stock_under_torchrun("sref", checkpoint_root))
    tj.create(
        _stock_under_torchrun("st", checkpoint_root, cpu=per_node, queueName=kueue.local_queue,
                              priorityClass=kueue.low_priority)
    )  # fmt: skip
    describe = _describe(tj, operator, "st", "sref")
    wait_for(
        "st training (step >= 3)",
        lambda: (tj.status("st").get("progress") or {}).get("step", 0) >= 3,
        on_timeout=describe,
    )
    _preempt_with_a_high_priority_job(control_plane, kueue, tj.ns)
    for name in ("st", "sref"):
        status = wait_for(
            f"{name} finished",
            lambda name=name: tj.phase_is(name, "Succeeded", "Failed"),
            on_timeout=describe,
        )
        assert status["phase"] == "Succeeded", describe()
    status = tj.status("st")
    first, second = status["attempts"]
    # torchrun's own exit code (1: its workers exited 75 and it was signalled), not 75; only
    # local rank 0 of each pod wrote the pod's message.
    assert EXIT_PREEMPTED not in first["exitCodes"], first
    _check_preempted_attempt(netns_agent, tj, "st", first, describe)
    assert not first.get("killed"), first
    # The attempt's SIGTERM-to-exit is the pod's (from the pod object: torchrun's teardown of
    # both workers), never shorter than what rank 0 measured inside its worker.
    (_, _, msg0), _ = _ends(netns_agent, tj.ns, "st", 1)
    assert msg0 is not None and msg0.sigterm_to_exit_seconds is not None
    assert first["sigtermToExitSeconds"] >= msg0.sigterm_to_exit_seconds, (first, msg0)
    assert second["resumeFrom"] == first["checkpoint"], describe()
    assert second["startStep"] == first["endStep"], describe()
    assert (status["preemptions"], status.get("lostSteps", 0)) == (1, 0), describe()
    ours = _weights(checkpoint_root / "st" / f"checkpoint-{STEPS}")
    theirs = _weights(checkpoint_root / "sref" / f"checkpoint-{STEPS}")
    assert sorted(ours) == sorted(theirs)
    different = [k for k in ours if not torch.equal(ours[k], theirs[k])]
    assert not different, f"weights differ: {different[:5]}"


def _parser_script_under_accelerate(name: str, root: Path, **kw: Any) -> dict[str, Any]:
    """``command: [accelerate, launch]`` with docs/operator.md's flags, running a transformers
    script with only the import changed (arguments from ``HfArgumentParser``), as a user writes
    it: two DataLoader workers per rank, periodic saves between which the stop falls."""
    body = _two_by_two(name, root, **kw)
    body["spec"]["command"] = ["accelerate", "launch"]
    body["spec"]["args"] = [
        "--multi_gpu", "--num_machines", "$(PET_NNODES)", "--num_processes", "$(WORLD_SIZE)",
        "--machine_rank", "$(NODE_RANK)", "--main_process_ip", "$(MASTER_ADDR)",
        "--main_process_port", "$(MASTER_PORT)", "--max_restarts", "0",
        str(PARSER_SCRIPT),
        "--max_steps", str(STEPS), "--save_steps", "4", "--step_sleep", "0.3",
        "--dataloader_num_workers", "2", "--per_device_train_batch_size", "4",
        # One epoch for the whole run (4 ranks x 4 samples a step): the stop never meets the
        # start of an epoch's workers (that window is the runtime tier's to test).
        "--num_samples", str(STEPS * 16),
        # This CPU machine's only difference from a GPU job: accelerate forms a CPU (gloo) group
        # only when told (without it each rank would train alone, in transformers too).
        "--use_cpu", "true",
        # Bit-identical resume with 4 DDP ranks (docs/distributed.md).
        "--full_determinism", "true",
    ]  # fmt: skip
    body["spec"]["resourcesPerNode"]["requests"]["memory"] = "1Gi"
    return body


def _newest_complete(root: Path) -> str | None:
    """Path of the newest complete checkpoint on the volume."""
    info = CheckpointStore(str(root)).latest_complete()
    return info.path if info is not None else None


def test_accelerate_launch_of_an_hf_parser_script_with_dataloader_workers_preempted_by_kueue(
    control_plane: ControlPlane,
    netns_agent: NodeAgent,
    kueue: Kueue,
    tj: TJClient,
    operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    """Issue 37's user shape end to end: the JIT checkpoint is written through accelerate's
    torchrun and the DataLoader workers, the next attempt is told the newest complete checkpoint
    (not an older one the operator heard of), no step is lost, the end is bit-identical."""
    kueue.create_local_queue(tj.ns)
    per_node = str(int(kueue.quota["cpu"]) // 2)
    tj.create(_parser_script_under_accelerate("aref", checkpoint_root))
    tj.create(
        _parser_script_under_accelerate("acc", checkpoint_root, cpu=per_node,
                                        queueName=kueue.local_queue,
                                        priorityClass=kueue.low_priority)
    )  # fmt: skip
    describe = _describe(tj, operator, "acc", "aref")
    # After the first periodic save (checkpoint-4), before the second.
    wait_for(
        "acc training (step >= 6)",
        lambda: (tj.status("acc").get("progress") or {}).get("step", 0) >= 6,
        on_timeout=describe,
    )
    _preempt_with_a_high_priority_job(control_plane, kueue, tj.ns)
    # What the volume holds when attempt 1 is recorded, before attempt 2 can write anything.
    wait_for(
        "acc attempt 1 recorded",
        lambda: ((tj.status("acc").get("attempts") or [{}])[0]).get("outcome"),
        interval=0.2,
        on_timeout=describe,
    )
    newest = _newest_complete(checkpoint_root / "acc")
    for name in ("acc", "aref"):
        status = wait_for(
            f"{name} finished",
            lambda name=name: tj.phase_is(name, "Succeeded", "Failed"),
            on_timeout=describe,
        )
        assert status["phase"] == "Succeeded", describe()
    status = tj.status("acc")
    first, second = status["attempts"]
    # accelerate launch exits 143 when signalled, whatever its workers did (docs/operator.md).
    assert first["exitCodes"] == [143, 143], describe()
    _check_preempted_attempt(netns_agent, tj, "acc", first, describe)
    assert not first.get("killed") and first["sigtermToExitSeconds"] > 0, first
    # The JIT checkpoint is the newest complete one, and the next attempt was told it.
    assert newest is not None and newest.endswith(f"checkpoint-{first['endStep']}"), (newest, first)
    assert second["resumeFrom"] == first["checkpoint"] == newest, describe()
    assert second["startStep"] == first["endStep"], describe()
    assert (status["preemptions"], status.get("lostSteps", 0)) == (1, 0), describe()
    ours = _weights(checkpoint_root / "acc" / f"checkpoint-{STEPS}")
    theirs = _weights(checkpoint_root / "aref" / f"checkpoint-{STEPS}")
    assert sorted(ours) == sorted(theirs)
    different = [k for k in ours if not torch.equal(ours[k], theirs[k])]
    assert not different, f"weights differ: {different[:5]}"


def test_a_local_worker_failure_fails_the_attempt_promptly_without_doubling_the_grace(
    netns_agent: NodeAgent, tj: TJClient, operator: OperatorProcess, checkpoint_root: Path
) -> None:
    grace = {"initialSeconds": 90, "min": 5, "max": 300}
    # Global rank 1 is pod 0's second process; it raises at step 3.
    body = _two_by_two(
        "lf", checkpoint_root, max_steps=40, step_sleep=0.25, save_steps=100, grace=grace,
        maxRestarts=0, extra_args=("--fail-at-step", "3", "--fail-rank", "1"),
    )  # fmt: skip
    tj.create(body)
    describe = _describe(tj, operator, "lf")
    status = wait_for(
        "lf failed", lambda: tj.phase_is("lf", "Failed", "Succeeded"), on_timeout=describe
    )
    assert status["phase"] == "Failed", describe()
    (record,) = status["attempts"]
    assert (record["outcome"], record["reason"]) == ("Failed", "TrainingFailed"), describe()
    # The pod, the local and global rank, and the error, in one line.
    assert "-a1-0-" in record["message"] and "local rank 1 (rank 1)" in record["message"], record
    assert "injected failure at step 3" in record["message"], record
    assert not record.get("killed") and record["exitCodes"] == [1, EXIT_PEER_FAILED], record
    # No grace doubling: the grace recommended for a next attempt is still the initial one.
    assert status["gracePeriod"]["recommended"] == grace["initialSeconds"], status["gracePeriod"]
    ends = _ends(netns_agent, tj.ns, "lf", 1)
    finished = [r.last_run().exited_at for r in _records(netns_agent, tj.ns, "lf", 1)]
    # Promptly: the healthy pod did not sit until the 90 s grace deadline.
    assert max(finished) - min(finished) < 30, (ends, finished)
    (_, code0, msg0), (_, code1, msg1) = ends
    # Pod 0: its local rank 1 raised (exit 1, or killed by torchrun's SIGTERM while it wound
    # down), its local rank 0 saw it gone (69); pod 1's ranks saw it gone too.
    assert code0 == 1 and msg0 is not None and (msg0.local_rank, msg0.rank) == (1, 1), ends
    assert msg0.exit_codes is not None and msg0.exit_codes[0] == EXIT_PEER_FAILED, ends
    assert code1 == EXIT_PEER_FAILED and msg1 is not None and msg1.peer_gone, ends


def test_a_shared_four_rank_checkpoint_resumes_at_two_ranks(
    netns_agent: NodeAgent, tj: TJClient, operator: OperatorProcess, checkpoint_root: Path
) -> None:
    """Issue 28's shared saves at another world size on the cluster: a 2 x 2 job is suspended
    (a graceful JIT stop: each of the 4 ranks writes its share), edited to one process per pod,
    and resumed: the 2 ranks of the next attempt read the union of the 4 ranks' shards, the
    data position re-sharded, and train to the end with no lost step."""
    tj.create(_two_by_two("ws", checkpoint_root, max_steps=STEPS, step_sleep=0.3, save_steps=STEPS))
    describe = _describe(tj, operator, "ws")
    wait_for(
        "ws training (step >= 4)",
        lambda: (tj.status("ws").get("progress") or {}).get("step", 0) >= 4,
        on_timeout=describe,
    )
    tj.patch_spec("ws", {"suspend": True})
    status = wait_for("ws suspended", lambda: tj.phase_is("ws", "Suspended"), on_timeout=describe)
    (first,) = status["attempts"]
    jit = checkpoint_root / "ws" / f"checkpoint-{first['endStep']}"
    assert first["checkpoint"].endswith(jit.name) and first.get("lostSteps", 0) == 0, first
    assert (jit / "optimizer.safetensors.index.json").is_file(), sorted(jit.iterdir())
    tj.patch_spec("ws", {"numProcPerNode": 1, "suspend": False})
    status = wait_for(
        "ws finished", lambda: tj.phase_is("ws", "Succeeded", "Failed"), on_timeout=describe
    )
    assert status["phase"] == "Succeeded", describe()
    second = status["attempts"][-1]
    assert second["resumeFrom"] == first["checkpoint"], describe()
    assert second["startStep"] == first["endStep"] and status.get("lostSteps", 0) == 0, status
    assert status["progress"]["step"] == STEPS, status
    final = checkpoint_root / "ws" / f"checkpoint-{STEPS}"
    manifest = json.loads((final / "manifest.json").read_text())
    assert manifest["world_size"] == 2, manifest  # the 2 ranks of the resumed attempt
