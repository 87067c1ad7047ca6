"""`helm upgrade` and `helm uninstall` with TrainingJobs in flight, on the real control plane.

One scenario, in the order docs/install.md gives for an upgrade. Four TrainingJobs: `steady`
(running throughout), `holder` (holds the whole Kueue quota), `queued` (waits behind it) and
`ckpt` (its pod evicted just before the upgrade, so it is in the middle of its just-in-time
checkpoint while the operator is down). Then:

1. upgrade: the operator stops, the CRD is replaced by one with an added optional field
   (`kubectl apply --server-side`, as documented: helm never touches crds/ on upgrade), `helm
   upgrade` to a chart with a new version, and the operator starts again with the new release's
   arguments and ServiceAccount. The test control plane's node agent cannot run the chart's own
   operator pod (it gives pods no in-cluster credentials), so the "new version" is the same code
   restarted outside the cluster, exactly as the Deployment would run it;
2. uninstall: the operator stops, `helm uninstall` removes the release; CRD, TrainingJobs, Jobs
   and training pods stay, training continues unsupervised, a TrainingJob deleted meanwhile waits
   on the operator's finalizer; `helm install --skip-crds` of the same version brings everything
   back under control.

Throughout, a watcher records every phase each TrainingJob shows: none may go backwards or visit
a phase its story does not have; at the end none lost a step, and only `ckpt` (the preempted one)
has a second attempt.
"""

from __future__ import annotations

import contextlib
import copy
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from kubernetes.client.rest import ApiException

from preemptible_operator import crd, models
from tests.cluster.controlplane import ControlPlane
from tests.cluster.kueue import Kueue
from tests.cluster.node_agent import NodeAgent
from tests.operator.harness import TJClient, install_crd, toy_training_job, wait_for
from tests.packaging.chart import CHART_DIR
from tests.packaging.release import (
    ChartOperator,
    release_objects,
    run_helm,
    start_chart_operator,
)
from tests.packaging.tools import require_tool

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.kueue]

RELEASE = "upgrade"
ADDED_FIELD = "upgradeProbe"

# The phases each job may show, in order (a watcher may miss some, never reorder them).
STORIES = {
    "steady": ["Pending", "Running", "Succeeded"],
    "queued": ["Pending", "Queued", "Pending", "Running", "Succeeded"],
    "ckpt": [
        "Pending",
        "Running",
        "Checkpointing",
        "Requeueing",
        "Pending",
        "Running",
        "Succeeded",
    ],
}


class PhaseWatcher:
    """Polls the TrainingJobs' phases in a thread of its own; ``seen[name]`` is the sequence of
    distinct consecutive phases."""

    def __init__(self, cp: ControlPlane, namespace: str, names: list[str]) -> None:
        self.cp, self.namespace, self.names = cp, namespace, names
        self.seen: dict[str, list[str]] = {n: [] for n in names}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _poll(self, tj: TJClient) -> None:
        for name in self.names:
            with contextlib.suppress(ApiException):
                phase = tj.status(name).get("phase")
                if phase and (not self.seen[name] or self.seen[name][-1] != phase):
                    self.seen[name].append(phase)

    def _run(self) -> None:
        with self.cp.api_client() as client:
            tj = TJClient(client, self.namespace)
            while not self._stop.is_set():
                self._poll(tj)
                self._stop.wait(0.3)

    def __enter__(self) -> PhaseWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        # One last look: a phase reached since the thread's last poll (the caller may have just
        # seen it) would otherwise be missing from the story.
        with self.cp.api_client() as client:
            self._poll(TJClient(client, self.namespace))


def _is_subsequence(seen: list[str], story: list[str]) -> bool:
    it = iter(story)
    return all(phase in it for phase in seen)


def _new_crd() -> dict[str, Any]:
    """The generated CRD plus one optional spec field (what a new chart version might add)."""
    body = copy.deepcopy(crd.build_crd())
    schema = body["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    schema["properties"]["spec"]["properties"][ADDED_FIELD] = {
        "type": "string",
        "description": "A field added by the upgrade test's new CRD version.",
    }
    return body


def _new_chart(tmp_path: Path) -> Path:
    """The chart as a new version: bumped version and appVersion, the new CRD in crds/."""
    chart = tmp_path / "chart-next"
    shutil.copytree(CHART_DIR, chart)
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    meta["version"] = meta["appVersion"] = "0.1.1-next"
    (chart / "Chart.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))
    (chart / "crds" / "trainingjobs.yaml").write_text(yaml.safe_dump(_new_crd(), sort_keys=False))
    return chart


@contextlib.contextmanager
def _crd_restored(cp: ControlPlane) -> Iterator[None]:
    """Other tests share the control plane: put the generated CRD back afterwards."""
    try:
        yield
    finally:
        with cp.api_client() as client:
            install_crd(client)


class Release:
    """The chart release under test and the operator it would run (one at a time)."""

    def __init__(self, cp: ControlPlane, helm: str, namespace: str, tmp_path: Path) -> None:
        self.cp, self.helm, self.namespace, self.tmp_path = cp, helm, namespace, tmp_path
        self.values = tmp_path / "values.yaml"
        self.log = tmp_path / "operator.log"
        self.operator: ChartOperator | None = None

    def run(self, *args: str) -> None:
        proc = run_helm(self.cp, self.helm, self.namespace, *args)
        assert proc.returncode == 0, f"helm {' '.join(args)}:\n{proc.stdout}{proc.stderr}"

    def objects(self) -> list[dict[str, Any]]:
        return release_objects(self.cp, self.helm, self.namespace, RELEASE)

    def start_operator(self) -> ChartOperator:
        self.operator = start_chart_operator(self.cp, self.objects(), self.namespace, self.log)
        wait_for("the operator's liveness probe", self.operator.healthy, on_timeout=self.tail)
        return self.operator

    def stop_operator(self) -> None:
        if self.operator is not None:
            self.operator.stop()
            self.operator = None

    def tail(self) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-80:])
        except OSError:
            return "(no operator log)"


def _gone(tj: TJClient, name: str) -> bool:
    try:
        tj.get(name)
    except ApiException as exc:
        return exc.status == 404
    return False


def test_upgrade_and_uninstall_leave_training_jobs_alone(
    control_plane: ControlPlane,
    node_agent: NodeAgent,
    kueue: Kueue,
    namespace: str,
    tmp_path: Path,
) -> None:
    with control_plane.api_client() as client:
        install_crd(client)
    kueue.create_local_queue(namespace)
    root = tmp_path / "ckpt"
    root.mkdir()
    release = Release(control_plane, require_tool("helm"), namespace, tmp_path)
    release.values.write_text(
        yaml.safe_dump(
            {
                "watchNamespaces": [namespace],
                "replicaCount": 0,
                "operator": {"logFormat": "text", "extraArgs": ["--poll-interval=1"]},
                "checkpointStorage": {"pathMap": {str(root): str(root)}},
            }
        )
    )
    release.run("install", RELEASE, str(CHART_DIR), "--values", str(release.values))
    try:
        with _crd_restored(control_plane), control_plane.api_client() as client:
            _scenario(release, TJClient(client, namespace), root, kueue)
    finally:
        # The TrainingJobs go while an operator holds their finalizers, then the release.
        with contextlib.suppress(Exception), control_plane.api_client() as client:
            if release.operator is None and release.objects():
                release.start_operator()
            custom = kubernetes.client.CustomObjectsApi(client)
            args = (models.GROUP, models.VERSION, namespace, models.PLURAL)
            for item in custom.list_namespaced_custom_object(*args)["items"]:
                custom.delete_namespaced_custom_object(*args, item["metadata"]["name"])
            tj = TJClient(client, namespace)
            wait_for("TrainingJobs deleted", lambda: not tj.custom.list_namespaced_custom_object(
                *args)["items"], timeout=60)  # fmt: skip
        release.stop_operator()
        run_helm(control_plane, release.helm, namespace, "uninstall", RELEASE, "--wait")


def _scenario(release: Release, tj: TJClient, root: Path, kueue: Kueue) -> None:
    cp = release.cp
    names = ["steady", "queued", "ckpt", "holder", "parked"]

    def describe() -> str:
        text = "\n".join(f"--- {n}\n{tj.describe(n)}" for n in names)
        return f"{text}\n--- phases {watcher.seen}\n--- operator\n{release.tail()}"

    quota = kueue.quota["cpu"]
    release.start_operator()
    with PhaseWatcher(cp, tj.ns, names[:3]) as watcher:
        # -------------------------------------------------------------- before the upgrade
        # steady runs long enough to span both the upgrade and the uninstall (70 s and more).
        tj.create(toy_training_job("steady", root, max_steps=280, step_sleep=0.25))
        tj.create(toy_training_job("holder", root, max_steps=10_000, step_sleep=0.5, cpu=quota,
                                   queueName=kueue.local_queue))  # fmt: skip
        tj.create(toy_training_job("ckpt", root, max_steps=100, step_sleep=0.3,
                                   extra_args=("--save-sleep", "0.5")))  # fmt: skip
        # parked never runs: an unfinished TrainingJob, so the operator keeps its finalizer on it
        # (a finished one's finalizer goes once its reconcile daemon has returned).
        tj.create(toy_training_job("parked", root, suspend=True))
        wait_for("parked Suspended", lambda: tj.phase_is("parked", "Suspended"),
                 on_timeout=describe)  # fmt: skip
        wait_for("holder running", lambda: tj.running_pod("holder", 1), on_timeout=describe)
        tj.create(toy_training_job("queued", root, max_steps=6, step_sleep=0.2, cpu=quota,
                                   queueName=kueue.local_queue))  # fmt: skip
        wait_for("queued is Queued", lambda: tj.phase_is("queued", "Queued"), on_timeout=describe)
        for name in ("steady", "ckpt"):
            wait_for(
                f"{name} at step 3",
                lambda n=name: (tj.status(n).get("progress") or {}).get("step", 0) >= 3,
                on_timeout=describe,
            )
        pod = tj.running_pod("ckpt", 1)
        assert pod is not None, describe()
        tj.evict(pod.metadata.name)
        wait_for("ckpt Checkpointing", lambda: tj.phase_is("ckpt", "Checkpointing"),
                 on_timeout=describe)  # fmt: skip
        before = {n: tj.get(n) for n in names}

        # ------------------------------------------------------------------------ upgrade
        # The documented order: stop nothing by hand in a real cluster (helm upgrade rolls the
        # Deployment); here the operator is a local process, so it stops first.
        release.stop_operator()
        new_crd = _new_crd()
        proc = cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                          input=yaml.safe_dump(new_crd), check=False)  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        new_chart = _new_chart(release.tmp_path)
        release.run("upgrade", RELEASE, str(new_chart), "--values", str(release.values))
        served = cp.kubectl("get", "crd", new_crd["metadata"]["name"], "-o", "yaml").stdout
        assert ADDED_FIELD in served
        # Replacing the CRD touched no TrainingJob: same generation and spec.
        for name, old in before.items():
            now = tj.get(name)
            assert now["metadata"]["generation"] == old["metadata"]["generation"], name
            assert now["spec"] == old["spec"], name
        assert tj.status("queued")["phase"] == "Queued"
        assert tj.status("steady")["attempt"] == 1 and tj.status("ckpt")["attempt"] == 1
        labels = release.objects()[0]["metadata"]["labels"]
        assert labels["helm.sh/chart"] == "preemptible-0.1.1-next", labels
        operator = release.start_operator()

        # ckpt: its JIT checkpoint made it, attempt 1 is recorded as a preemption, attempt 2
        # resumes from it. steady: still attempt 1. queued: admitted once holder is gone.
        status = wait_for(
            "ckpt attempt 2 running",
            lambda: (
                (s := tj.status("ckpt")).get("attempt") == 2 and tj.running_pod("ckpt", 2) and s
            ),
            on_timeout=describe,
        )
        first = status["attempts"][0]
        assert (first["outcome"], first["reason"], first["lostSteps"]) == (
            "Preempted", "PodEvicted", 0,
        ), describe()  # fmt: skip
        assert first["checkpoint"].endswith(f"checkpoint-{first['endStep']}"), describe()
        tj.custom.delete_namespaced_custom_object(
            models.GROUP, models.VERSION, tj.ns, models.PLURAL, "holder"
        )
        queued = wait_for("queued Succeeded", lambda: tj.phase_is("queued", "Succeeded", "Failed"),
                          on_timeout=describe)  # fmt: skip
        assert queued["phase"] == "Succeeded" and queued["attempt"] == 1, describe()
        wait_for("holder gone", lambda: _gone(tj, "holder"), on_timeout=describe)

        # The series the dashboard needs, from the upgraded operator.
        metrics = operator.metrics()
        key = f'{{name="ckpt",namespace="{tj.ns}"}}'
        assert metrics[f"preemptible_operator_attempt{key}"] == 2, metrics
        assert metrics[f"preemptible_operator_attempt_grace_seconds{key}"] == first["graceSeconds"]
        sigterm = metrics[f"preemptible_operator_sigterm_to_exit_seconds{key}"]
        assert sigterm == pytest.approx(first["sigtermToExitSeconds"]), metrics
        assert 0 < sigterm < first["graceSeconds"], metrics
        # queued's admission and ckpt's attempt 2 were both seen starting by this operator
        assert metrics["preemptible_operator_queue_wait_seconds_count"] >= 2, metrics

        # ---------------------------------------------------------------------- uninstall
        steady_step = (tj.status("steady").get("progress") or {}).get("step", 0)
        assert tj.status("steady")["phase"] == "Running", f"steady ended too early\n{describe()}"
        release.stop_operator()
        release.run("uninstall", RELEASE, "--wait", "--timeout", "120s")
        # helm leaves what crds/ installed, and the TrainingJobs with their Jobs and pods.
        cp.kubectl("get", "crd", f"{models.PLURAL}.{models.GROUP}")
        for name in ("steady", "ckpt", "queued"):
            assert tj.get(name)["metadata"].get("deletionTimestamp") is None
        pod = tj.running_pod("steady", 1)
        assert pod is not None, describe()
        # An unfinished TrainingJob deleted with no operator waits on the operator's finalizer.
        tj.custom.delete_namespaced_custom_object(
            models.GROUP, models.VERSION, tj.ns, models.PLURAL, "parked"
        )
        time.sleep(3)
        pending = tj.get("parked")["metadata"]
        assert pending.get("deletionTimestamp") and pending.get("finalizers"), pending
        still = tj.running_pod("steady", 1)
        assert still is not None and still.metadata.uid == pod.metadata.uid, describe()

        # ----------------------------------------------------------------------- reinstall
        # The version that was uninstalled. --skip-crds: the CRD stayed and is current, and
        # helm 4 would otherwise server-side apply crds/ and conflict with kubectl's apply.
        release.run("install", RELEASE, str(new_chart), "--values", str(release.values),
                    "--skip-crds")  # fmt: skip
        assert (
            ADDED_FIELD
            in cp.kubectl("get", "crd", new_crd["metadata"]["name"], "-o", "yaml").stdout
        )
        release.start_operator()
        wait_for("parked deleted", lambda: _gone(tj, "parked"), on_timeout=describe)
        results = {
            name: wait_for(
                f"{name} Succeeded",
                lambda n=name: tj.phase_is(n, "Succeeded", "Failed"),
                timeout=300,
                on_timeout=describe,
            )
            for name in ("steady", "ckpt")
        }
    detail = describe()
    steady, ckpt = results["steady"], results["ckpt"]
    assert steady["phase"] == "Succeeded" and steady["attempt"] == 1, detail
    assert len(steady["attempts"]) == 1 and steady["progress"]["step"] == 280, detail
    assert steady["progress"]["step"] > steady_step, detail
    assert ckpt["phase"] == "Succeeded" and [a["attempt"] for a in ckpt["attempts"]] == [1, 2]
    assert ckpt["attempts"][1]["startStep"] == ckpt["attempts"][0]["endStep"] > 0, detail
    assert ckpt["progress"]["step"] == 100, detail
    for status in (steady, ckpt):
        assert status.get("lostSteps", 0) == 0 and status.get("failures", 0) == 0, detail
    assert steady.get("preemptions", 0) == 0 and ckpt["preemptions"] == 1, detail
    for name, story in STORIES.items():
        assert _is_subsequence(watcher.seen[name], story), f"{name}: {watcher.seen[name]}"
    assert watcher.seen["steady"][-1] == watcher.seen["ckpt"][-1] == "Succeeded", watcher.seen
    assert "Running" in watcher.seen["queued"] and "Checkpointing" in watcher.seen["ckpt"]
