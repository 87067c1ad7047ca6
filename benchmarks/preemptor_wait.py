"""How long a Kueue preemptor waits for its victim's quota and node (``python -P
benchmarks/preemptor_wait.py``).

Starts the real control plane of the cluster test tier (etcd, kube-apiserver, controller-manager,
scheduler), Kueue (the version the tier pins) with a ClusterQueue of 2 CPUs, the stand-in node
agent with ONE node of 2 CPUs (so the preemptor needs both the victim's quota and the victim's
place on the node), and the operator. Then, per run:

- a low-priority TrainingJob (the victim: ``trainer_runtime.toy``, grace G =
  ``--grace`` seconds, every checkpoint file written with ``--save-sleep`` seconds of delay, so
  its JIT save takes S seconds) takes the whole quota and trains;
- a high-priority batch Job (the preemptor, 2 CPUs) is created; Kueue preempts the victim.

Printed per run, in seconds from the preemptor's creation: its Workload admitted (quota
reserved), the victim's pod terminating (deletionTimestamp), the victim's container exited, the
preemptor's pod bound to the node, and its container running; plus the victim's own
``sigtermToExitSeconds`` and JIT save seconds from the TrainingJob's attempt record. The clocks are
this process's polls (every 0.05 s) of the API, so each figure is +-0.1 s.

    python -P benchmarks/preemptor_wait.py [--runs 3] [--grace 30] [--save-sleep 0.3]

docs/operator.md ("Kueue: quota release") records a run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.operator_scale import AgentProcess, Operator  # noqa: E402
from preemptible_operator import models  # noqa: E402
from tests.cluster.binaries import find_binaries  # noqa: E402
from tests.cluster.controlplane import ControlPlane  # noqa: E402
from tests.cluster.helpers import job_manifest, python_container  # noqa: E402
from tests.cluster.kueue import KUEUE_GROUP, KUEUE_VERSION, Kueue  # noqa: E402
from tests.operator.harness import install_crd, toy_training_job  # noqa: E402

POLL = 0.05


def say(msg: str) -> None:
    print(msg, flush=True)


def wait_until(what: str, fn: Any, timeout: float = 300.0, poll: float = POLL) -> Any:
    """``fn()``'s first truthy value, polled every ``poll`` seconds; TimeoutError(what) after
    ``timeout`` (shared by the benchmarks on the control plane)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(what)


def one_run(
    client: kubernetes.client.ApiClient,
    kueue: Kueue,
    ns: str,
    root: Path,
    run: int,
    grace: int,
    save_sleep: float,
) -> dict[str, Any]:
    core = kubernetes.client.CoreV1Api(client)
    batch = kubernetes.client.BatchV1Api(client)
    custom = kubernetes.client.CustomObjectsApi(client)
    victim, preemptor = f"victim-{run}", f"preemptor-{run}"
    body = toy_training_job(
        victim,
        root,
        max_steps=100_000,
        step_sleep=0.2,
        extra_args=("--save-sleep", str(save_sleep), "--save-async", "false"),
        grace={"initialSeconds": grace, "min": grace, "max": grace, "killWaitSeconds": 0.5},
        cpu=kueue.quota["cpu"],
        queueName=kueue.local_queue,
        priorityClass=kueue.low_priority,
    )
    custom.create_namespaced_custom_object(models.GROUP, models.VERSION, ns, models.PLURAL, body)

    def tj_status() -> dict[str, Any]:
        obj = custom.get_namespaced_custom_object(
            models.GROUP, models.VERSION, ns, models.PLURAL, victim
        )
        return obj.get("status") or {}

    wait_until("victim training", lambda: (tj_status().get("progress") or {}).get("step", 0) >= 3)
    (victim_pod,) = [
        p
        for p in core.list_namespaced_pod(ns, label_selector=f"job-name={victim}-a1").items
        if p.status.phase == "Running"
    ]

    high = job_manifest(
        preemptor,
        [python_container("import time; time.sleep(1)", cpu=kueue.quota["cpu"])],
        labels=kueue.job_labels(kueue.high_priority),
        suspend=True,
    )
    t0 = time.monotonic()
    batch.create_namespaced_job(ns, high)
    marks: dict[str, float] = {}

    def mark(key: str, cond: bool) -> None:
        if cond and key not in marks:
            marks[key] = round(time.monotonic() - t0, 2)

    keys = ("admitted", "victim_terminating", "victim_exited", "bound", "running")
    while len(marks) < len(keys) and time.monotonic() - t0 < 300:
        wls = custom.list_namespaced_custom_object(KUEUE_GROUP, KUEUE_VERSION, ns, "workloads")
        for wl in wls["items"]:
            if wl["metadata"]["name"].startswith(f"job-{preemptor}-"):
                conds = (wl.get("status") or {}).get("conditions") or []
                mark(
                    "admitted",
                    any(c["type"] == "QuotaReserved" and c["status"] == "True" for c in conds),
                )
        try:
            vp = core.read_namespaced_pod(victim_pod.metadata.name, ns)
            mark("victim_terminating", vp.metadata.deletion_timestamp is not None)
            states = vp.status.container_statuses or []
            mark("victim_exited", any(s.state.terminated is not None for s in states))
        except ApiException as exc:
            if exc.status != 404:
                raise
            mark("victim_terminating", True)
            mark("victim_exited", True)
        for p in core.list_namespaced_pod(ns, label_selector=f"job-name={preemptor}").items:
            mark("bound", bool(p.spec.node_name))
            states = p.status.container_statuses or []
            mark("running", any(s.state.running or s.state.terminated for s in states))
        time.sleep(POLL)
    record = wait_until(
        "victim's attempt recorded",
        lambda: next((a for a in tj_status().get("attempts") or [] if a.get("outcome")), None),
    )
    timings = tj_status().get("timings") or {}
    custom.delete_namespaced_custom_object(models.GROUP, models.VERSION, ns, models.PLURAL, victim)
    wait_until("preemptor done", lambda: batch.read_namespaced_job(preemptor, ns).status.succeeded)
    batch.delete_namespaced_job(preemptor, ns, propagation_policy="Background")
    wait_until("quota free", lambda: not core.list_namespaced_pod(ns).items, timeout=120)
    return {
        **marks,
        "victim_sigterm_to_exit": record.get("sigtermToExitSeconds"),
        "victim_outcome": f"{record.get('outcome')}/{record.get('reason')}",
        "victim_checkpoint": Path(record.get("checkpoint") or "").name,
        "victim_save_seconds": timings.get("saveSecondsLast"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--grace", type=int, default=30, help="the victim's grace G, seconds")
    parser.add_argument(
        "--save-sleep", type=float, default=0.3, help="delay per checkpoint file (sets S)"
    )
    args = parser.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="preemptible-bench-"))
    root = workdir / "ckpt"
    root.mkdir()
    binaries = find_binaries()
    cp = ControlPlane(binaries, workdir / "cluster")
    kueue: Kueue | None = None
    agent: AgentProcess | None = None
    op: Operator | None = None
    runs: list[dict[str, Any]] = []
    try:
        cp.start()
        kueue = Kueue(cp, quota_cpu="2", quota_memory="4Gi")
        kueue.start()
        agent = AgentProcess(
            cp,
            workdir / "node-agent",
            nodes=["bench-0"],
            capacity={"cpu": "2", "memory": "8Gi", "pods": "32", "ephemeral-storage": "20Gi"},
            k8s_version=binaries.k8s_version,
        )
        ns = "bench"
        with cp.api_client() as client:
            install_crd(client)
            kubernetes.client.CoreV1Api(client).create_namespace({"metadata": {"name": ns}})
        kueue.create_local_queue(ns)
        op = Operator(cp.kubeconfig, workdir / "operator.log")
        with cp.api_client() as client:
            for run in range(args.runs):
                result = one_run(client, kueue, ns, root, run, args.grace, args.save_sleep)
                say(f"run {run}: {json.dumps(result)}")
                runs.append(result)
    finally:
        if op is not None:
            op.stop()
        if agent is not None:
            agent.stop()
        if kueue is not None:
            kueue.stop()
        cp.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    summary = {
        key: statistics.median(r[key] for r in runs)
        for key in ("admitted", "victim_terminating", "victim_exited", "bound", "running")
        if runs and all(key in r for r in runs)
    }
    print(json.dumps({"grace": args.grace, "runs": runs, "median": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
