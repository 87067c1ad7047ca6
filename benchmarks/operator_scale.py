"""Operator cost at scale on the test control plane (``python -P benchmarks/operator_scale.py``).

Starts the real control plane of the cluster test tier (etcd, kube-apiserver,
controller-manager, scheduler, Kueue, the stand-in node agent), installs the CRD and runs one
operator process (``preemptible-operator run``, default settings, admin credentials), then:

(a) queued: N TrainingJobs in a Kueue LocalQueue whose ClusterQueue has no quota, created from
    12 threads. Prints the seconds the creates took and from the first create until every one
    has its attempt Job and a status phase (followed by watches), the operator's CPU and RSS,
    and the apiserver's requests per TrainingJob by verb and resource. ``--backlog``: the
    TrainingJobs are created first and the operator started after them (a restart with a
    backlog: the seconds count from its start).
(b) running: M TrainingJobs whose pods run ``benchmarks/stub_runtime.py`` (no torch: it serves the
    runtime's /metrics and advances its step every second; ``--stub c``: its C twin
    ``stub_runtime.c``, about 1.8 MB a pod, for thousands of running jobs). At steady state,
    over a window: API requests per second per running job (the apiserver's
    ``apiserver_request_total`` with the operator running, minus the same window with the
    operator stopped by SIGSTOP; the operator's own request counter as a cross-check), operator
    CPU (cores) and RSS.
(c) requeue: stubs exit 75 one by one (a trigger file, spaced out) while the others keep
    running; the time from each exit to the next attempt's Job appearing in a watch (p50, p90,
    max), and the segments in between: the exit in the pod's status (the node agent), the
    attempt recorded in the TrainingJob's status (the operator), the next Job; and, off that
    path, the old Job's deletion.
(f) finished: F TrainingJobs whose one pod exits 0 at once (``--finished``), created after (a)
    and waited for until Succeeded: their Jobs and pods stay, as users' finished jobs do.
(i) idle: after (a) and (f), with nothing changing, the operator's CPU (cores, and per 1,000
    TrainingJobs) and RSS over ``--idle-window`` seconds (0: skip).

The operator's RSS at the end (every TrainingJob of every scenario still there) is printed
last. Scale (issue 30): ``--queued 2700 --finished 300 --running 2000 --stub c`` is the 5,000 mix.

The node agent runs in a process of its own, so its pods' threads do not share an interpreter
with the benchmark's watches, whose clocks are the measurement.

    python -P benchmarks/operator_scale.py [--queued 1000 [--backlog]] [--finished 0]
        [--idle-window 60] [--running 500] [--requeues 50]

The figures depend on the machine; docs/operator.md ("Operator at scale") records a run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Self

import kubernetes
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from preemptible_operator import models, render  # noqa: E402
from tests.cluster.binaries import find_binaries  # noqa: E402
from tests.cluster.controlplane import ControlPlane  # noqa: E402
from tests.cluster.helpers import eventually  # noqa: E402
from tests.cluster.kueue import Kueue  # noqa: E402
from tests.cluster.processes import ManagedProcess, wait_until  # noqa: E402
from tests.operator.harness import free_port, install_crd, read_metrics  # noqa: E402
from trainer_runtime.protocol import METRIC_NAMES  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from stub_runtime import build_c_stub, metrics_template  # noqa: E402

TJ_ARGS = (models.GROUP, models.VERSION)
CLK = os.sysconf("SC_CLK_TCK")
# Requests only the operator sends here (the node agent writes pods/status, controllers write
# Jobs' status and events of their own).
OPERATOR_REQUESTS = frozenset(
    {
        "GET trainingjobs",
        "PATCH trainingjobs",
        "PUT trainingjobs/status",
        "GET nodes",
        "POST jobs",
        "GET jobs",
        "DELETE jobs",
        "GET pods",
        "PATCH pods",
        "DELETE pods",
        "POST services",
        "GET services",
        "PATCH workloads",
    }
)
CREATE_THREADS = 12


def _say(msg: str) -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------------------- the operator
class Operator:
    def __init__(self, kubeconfig: Path, log: Path, extra: list[str] | None = None) -> None:
        self.metrics_port = free_port()
        argv = [
            sys.executable,
            "-P",
            "-m",
            "preemptible_operator.cli",
            "run",
            "--kubeconfig",
            str(kubeconfig),
            "--all-namespaces",
            "--metrics-port",
            str(self.metrics_port),
            "--liveness",
            "",
            "--log-format",
            "text",
            *(extra or []),
        ]
        self.log = log.open("ab")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK

    def rss_mb(self) -> tuple[float, float]:
        """(current, peak) resident set size in MB."""
        values = {}
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) / 1024
        return values["VmRSS"], values["VmHWM"]

    def api_requests(self) -> float:
        metrics = read_metrics(self.metrics_port)
        return sum(
            value
            for key, value in metrics.items()
            if key.split("{", 1)[0] == "preemptible_operator_api_requests_total"
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


class AgentProcess(ManagedProcess):
    """The test tier's node agent in a process of its own: its hundreds of pod threads must not
    share a GIL with the benchmark's watches, whose clocks are the measurement."""

    def __init__(
        self,
        cp: ControlPlane,
        workdir: Path,
        *,
        nodes: list[str],
        capacity: dict[str, str],
        k8s_version: str,
    ) -> None:
        boot = f"import sys; sys.path.append({str(REPO)!r}); "
        boot += "from tests.cluster.node_agent import main; sys.exit(main())"
        argv = [sys.executable, "-P", "-c", boot, "--kubeconfig", str(cp.kubeconfig)]
        argv += ["--workdir", str(workdir), "--apiserver-port", str(cp.apiserver_port)]
        argv += ["--k8s-version", k8s_version, "--start-timeout", "300"]
        argv += [f"--node={n}" for n in nodes]
        argv += [f"--capacity={k}={v}" for k, v in capacity.items()]
        super().__init__("node agent", argv, workdir / "agent.out")
        wait_until(
            "the node agent",
            lambda: b"node agent running" in self.log.read_bytes(),
            timeout=330,
            check=self.check_alive,
        )

    def stop(self, timeout: float = 120.0) -> None:  # it stops its pods first
        super().stop(timeout)


def apiserver_requests(client: kubernetes.client.ApiClient) -> dict[str, float]:
    """The apiserver's apiserver_request_total (every request it served) by verb and resource."""
    resp = client.call_api("GET", client.configuration.host + "/metrics")
    resp.read()
    text = resp.data.decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "apiserver_request_total":
                lb = s.labels
                key = f"{lb.get('verb')} {lb.get('resource')}" + (
                    f"/{lb['subresource']}" if lb.get("subresource") else ""
                )
                out[key] = out.get(key, 0.0) + s.value
    return out


def _rate(a: dict[str, float], b: dict[str, float], seconds: float) -> dict[str, float]:
    return {k: (b.get(k, 0.0) - a.get(k, 0.0)) / seconds for k in set(a) | set(b)}


# ------------------------------------------------------------------------------- builders
def training_job(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": models.API_VERSION,
        "kind": models.KIND,
        "metadata": {"name": name},
        "spec": spec,
    }


def queued_spec(root: Path, queue: str) -> dict[str, Any]:
    return {
        "image": "preemptible:bench",
        "command": ["python", "-c", "pass"],
        "checkpoint": {"uri": str(root)},
        "queueName": queue,
        "resourcesPerNode": {"requests": {"cpu": "1", "memory": "64Mi"}},
    }


def stub_command(kind: str) -> list[str]:
    """The running jobs' command: the Python stub, or the C one (``--stub c``: about 1 MB a
    process instead of about 15, so thousands fit one machine), built here on first use."""
    if kind == "c":
        cache = Path(os.environ.get("PREEMPTIBLE_CACHE", Path.home() / ".cache" / "preemptible"))
        return [str(build_c_stub(cache / "bench"))]
    return ["python", "-P", str(REPO / "benchmarks" / "stub_runtime.py")]


def stub_spec(root: Path, control: Path, command: list[str] | None = None) -> dict[str, Any]:
    return {
        "image": "preemptible:bench",
        "command": command or stub_command("python"),
        "checkpoint": {"uri": str(root)},
        "resourcesPerNode": {"requests": {"cpu": "10m", "memory": "16Mi"}},
        "env": [
            {"name": "STUB_METRICS_TEMPLATE", "value": metrics_template(METRIC_NAMES)},
            {"name": "STUB_CONTROL_DIR", "value": str(control)},
            {"name": "STUB_STEP_SECONDS", "value": "1"},
        ],
        "gracePeriod": {"seconds": 5},
    }


def finished_spec(root: Path) -> dict[str, Any]:
    return {
        "image": "preemptible:bench",
        "command": ["true"],
        "checkpoint": {"uri": str(root)},
        "resourcesPerNode": {"requests": {"cpu": "10m", "memory": "16Mi"}},
    }


def create_all(
    client: kubernetes.client.ApiClient, namespace: str, bodies: list[dict[str, Any]]
) -> None:
    """Create ``bodies`` from CREATE_THREADS threads (the client's pool holds 16 connections), so
    the benchmark's own client is not what limits the create rate."""
    custom = kubernetes.client.CustomObjectsApi(client)

    def create(body: dict[str, Any]) -> None:
        custom.create_namespaced_custom_object(*TJ_ARGS, namespace, models.PLURAL, body)

    with ThreadPoolExecutor(CREATE_THREADS) as pool:
        list(pool.map(create, bodies))


def count_ready(
    client: kubernetes.client.ApiClient, namespace: str, phases: set[str]
) -> tuple[int, int]:
    """(TrainingJobs with a phase in ``phases``, attempt Jobs) in ``namespace``."""
    custom = kubernetes.client.CustomObjectsApi(client)
    batch = kubernetes.client.BatchV1Api(client)
    items = custom.list_namespaced_custom_object(*TJ_ARGS, namespace, models.PLURAL)["items"]
    phased = sum(1 for i in items if (i.get("status") or {}).get("phase") in phases)
    # Raw JSON: building 500 V1Job models every poll would take the cores being measured.
    resp = batch.list_namespaced_job(
        namespace, label_selector=render.LABEL_TRAINING_JOB, _preload_content=False
    )
    return phased, len(json.loads(resp.data)["items"])


def watch_raw(
    client: kubernetes.client.ApiClient,
    kind: str,
    namespace: str,
    on_event: Callable[[str, dict[str, Any]], None],
    stop: threading.Event,
) -> None:
    """Call ``on_event(type, object)`` for every ``kind`` ("tj", "job" or "pod") in
    ``namespace``: one list (as ADDED), then a watch continued by resourceVersion, raw JSON. The
    benchmark's own watches must not relist or build client models for hundreds of objects
    every few seconds on the cores being measured."""
    custom = kubernetes.client.CustomObjectsApi(client)
    fn, args = {
        "pod": (kubernetes.client.CoreV1Api(client).list_namespaced_pod, (namespace,)),
        "job": (kubernetes.client.BatchV1Api(client).list_namespaced_job, (namespace,)),
        "tj": (custom.list_namespaced_custom_object, (*TJ_ARGS, namespace, models.PLURAL)),
    }[kind]
    rv: str | None = None
    while not stop.is_set():
        try:
            if rv is None:
                listing = json.loads(fn(*args, _preload_content=False).data)
                rv = listing["metadata"]["resourceVersion"]
                for item in listing["items"]:
                    on_event("ADDED", item)
            w = kubernetes.watch.Watch()
            for ev in w.stream(
                fn, *args, resource_version=rv, timeout_seconds=5, deserialize=False
            ):
                obj = ev["object"]
                rv = obj["metadata"].get("resourceVersion", rv)
                if ev["type"] != "BOOKMARK":
                    on_event(ev["type"], obj)
                if stop.is_set():
                    break
        except kubernetes.client.ApiException as exc:
            if exc.status == 410:  # too old: list again
                rv = None
            time.sleep(0.2)
        except Exception:  # a dropped connection: continue from rv
            time.sleep(0.2)


class Watches:
    """Threads running :func:`watch_raw` for ``kinds`` in ``namespace`` while the context is
    open; each event goes to :meth:`_event` (on the kind's own thread)."""

    def __init__(self, cp: ControlPlane, namespace: str, kinds: tuple[str, ...]) -> None:
        self.cp, self.namespace = cp, namespace
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(kind,), daemon=True) for kind in kinds
        ]

    def __enter__(self) -> Self:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(10)

    def _run(self, kind: str) -> None:
        with self.cp.api_client() as client:
            watch_raw(
                client,
                kind,
                self.namespace,
                lambda etype, obj: self._event(kind, etype, obj),
                self._stop,
            )

    def _event(self, kind: str, etype: str, obj: dict[str, Any]) -> None:
        raise NotImplementedError


class ReadyWatch(Watches):
    """Watches TrainingJobs and Jobs in a namespace and records the time (monotonic) at which
    each TrainingJob first has both a phase in ``phases`` and its attempt Job. Watches rather
    than polled lists: listing 1,000 objects a second would take apiserver CPU from what is
    measured."""

    def __init__(self, cp: ControlPlane, namespace: str, phases: set[str]) -> None:
        super().__init__(cp, namespace, ("tj", "job"))
        self.phases = phases
        self.phased: set[str] = set()
        self.jobs: set[str] = set()
        self.ready: dict[str, float] = {}
        self._lock = threading.Lock()

    def _event(self, kind: str, etype: str, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        with self._lock:
            if kind == "tj":
                if (obj.get("status") or {}).get("phase") in self.phases:
                    self.phased.add(name)
            else:
                name = (obj["metadata"].get("labels") or {}).get(render.LABEL_TRAINING_JOB, "")
                self.jobs.add(name)
            if name in self.phased and name in self.jobs and name not in self.ready:
                self.ready[name] = time.monotonic()

    def count(self) -> int:
        with self._lock:
            return len(self.ready)


def bench_queued(
    cp: ControlPlane,
    kueue: Kueue,
    op: Operator | None,
    n: int,
    root: Path,
    kubeconfig: Path,
    operator_args: list[str],
) -> tuple[dict[str, float], Operator]:
    """(a). ``op`` None: the TrainingJobs are created first and the operator started after (a
    restart with a backlog: the operator's own throughput, without the create stream)."""
    ns = "bench-queued"
    with cp.api_client() as client:
        kubernetes.client.CoreV1Api(client).create_namespace({"metadata": {"name": ns}})
        queue = kueue.create_local_queue(ns)
        bodies = [training_job(f"q{i}", queued_spec(root / f"q{i}", queue)) for i in range(n)]
        with ReadyWatch(cp, ns, {"Queued", "Pending"}) as ready:
            time.sleep(1)
            before = apiserver_requests(client)
            t0 = time.monotonic()
            create_all(client, ns, bodies)
            created = time.monotonic() - t0
            started = None
            if op is None:
                _say(f"  {n} created in {created:.1f} s with no operator; starting it")
                op = Operator(kubeconfig, root.parent / "operator.log", operator_args)
                started = time.monotonic()
            cpu0 = 0.0 if started is not None else op.cpu_seconds()
            eventually(
                f"{n} queued TrainingJobs with a Job and a phase",
                lambda: ready.count() >= n,
                timeout=1800,
                interval=0.2,
            )
            last = max(ready.ready.values())
            after = apiserver_requests(client)
    rss, peak = op.rss_mb()
    per_job = {
        k: round((after.get(k, 0.0) - before.get(k, 0.0)) / n, 2)
        for k in set(after) | set(before)
        if after.get(k, 0.0) - before.get(k, 0.0) >= n / 20
    }
    _say(f"  apiserver requests per TrainingJob (>= 0.05): {dict(sorted(per_job.items()))}")
    out = {
        "n": n,
        "create_seconds": created,
        "cpu_seconds": op.cpu_seconds() - cpu0,
        "rss_mb": rss,
        "peak_rss_mb": peak,
        "operator_requests_per_job": round(
            sum(v for k, v in per_job.items() if k in OPERATOR_REQUESTS), 2
        ),
    }
    if started is None:
        out["seconds"] = last - t0
        out["after_last_create_seconds"] = last - (t0 + created)
    else:
        out["after_operator_start_seconds"] = last - started
    return out, op


def bench_finished(cp: ControlPlane, op: Operator, n: int, root: Path) -> dict[str, float]:
    """(f): ``n`` TrainingJobs whose pod exits 0 at once, until every one is Succeeded."""
    ns = "bench-finished"
    with cp.api_client() as client:
        kubernetes.client.CoreV1Api(client).create_namespace({"metadata": {"name": ns}})
        bodies = [training_job(f"f{i}", finished_spec(root / f"f{i}")) for i in range(n)]
        t0, cpu0 = time.monotonic(), op.cpu_seconds()
        create_all(client, ns, bodies)
        eventually(
            f"{n} TrainingJobs Succeeded",
            lambda: count_ready(client, ns, {"Succeeded"})[0] >= n,
            timeout=1800,
            interval=2.0,
        )
        seconds = time.monotonic() - t0
    rss, peak = op.rss_mb()
    return {
        "n": n,
        "seconds": seconds,
        "cpu_seconds": op.cpu_seconds() - cpu0,
        "rss_mb": rss,
        "peak_rss_mb": peak,
    }


def bench_idle(op: Operator, jobs: int, window: float) -> dict[str, float]:
    """(i): the operator's CPU over ``window`` seconds while nothing changes (``jobs``
    TrainingJobs queued or finished): what its timers and wake-ups cost."""
    time.sleep(20)  # the last passes and events settle
    c0, t0 = op.cpu_seconds(), time.monotonic()
    time.sleep(window)
    cores = (op.cpu_seconds() - c0) / (time.monotonic() - t0)
    rss, peak = op.rss_mb()
    return {
        "jobs": jobs,
        "window_seconds": window,
        "cpu_cores": round(cores, 4),
        "cpu_cores_per_1000_jobs": round(cores * 1000 / max(1, jobs), 4),
        "rss_mb": rss,
        "peak_rss_mb": peak,
    }


def bench_running(
    cp: ControlPlane,
    op: Operator,
    n: int,
    root: Path,
    control: Path,
    window: float,
    stub: str = "python",
) -> dict[str, float]:
    ns = "bench-running"
    command = stub_command(stub)
    with cp.api_client() as client:
        kubernetes.client.CoreV1Api(client).create_namespace({"metadata": {"name": ns}})
        bodies = [
            training_job(f"r{i}", stub_spec(root / f"r{i}", control, command)) for i in range(n)
        ]
        t0 = time.monotonic()
        create_all(client, ns, bodies)
        eventually(
            f"{n} stub jobs Running",
            lambda: count_ready(client, ns, {"Running"})[0] >= n,
            timeout=1800,
            interval=2.0,
        )
        started = time.monotonic() - t0
        _say(f"  {n} stub jobs Running after {started:.1f} s; settling 20 s")
        time.sleep(20)
        a0, o0, c0, t1 = (
            apiserver_requests(client),
            op.api_requests(),
            op.cpu_seconds(),
            time.monotonic(),
        )
        time.sleep(window)
        a1, o1, c1, t2 = (
            apiserver_requests(client),
            op.api_requests(),
            op.cpu_seconds(),
            time.monotonic(),
        )
        rss, peak = op.rss_mb()
        # The same window with the operator stopped: what everything else costs.
        op.proc.send_signal(signal.SIGSTOP)
        try:
            b0, s0 = apiserver_requests(client), time.monotonic()
            time.sleep(window / 2)
            b1, s1 = apiserver_requests(client), time.monotonic()
        finally:
            op.proc.send_signal(signal.SIGCONT)
    rate_with = _rate(a0, a1, t2 - t1)
    rate_without = _rate(b0, b1, s1 - s0)
    with_op, without = sum(rate_with.values()), sum(rate_without.values())
    extra = {k: rate_with.get(k, 0.0) - rate_without.get(k, 0.0) for k in rate_with}
    top = sorted(extra.items(), key=lambda kv: -kv[1])[:8]
    _say("  requests/s with minus without the operator, by verb and resource: ")
    _say("    " + ", ".join(f"{k} {v:.2f}" for k, v in top))
    # What the operator itself sends. Excluded: the endpoint-slice controller's retries and the
    # Warning events it patches (the node agent's loopback pod IPs are invalid endpoints: a test
    # cluster artefact on its own backoff clock, not the operator's traffic).
    own = sum(v for k, v in extra.items() if k in OPERATOR_REQUESTS)
    return {
        "n": n,
        "start_seconds": started,
        "window_seconds": t2 - t1,
        "apiserver_rps_with_operator": with_op,
        "apiserver_rps_without_operator": without,
        "apiserver_extra_rps_per_job": (with_op - without) / n,
        "operator_rps_per_job": own / n,
        "operator_counted_rps_per_job": (o1 - o0) / (t2 - t1) / n,
        "cpu_cores": (c1 - c0) / (t2 - t1),
        "rss_mb": rss,
        "peak_rss_mb": peak,
    }


class Timeline(Watches):
    """Watches pods, Jobs and TrainingJobs in a namespace and records the wall time each step of
    a requeue is first seen: the old pod's container terminated (the node agent's report), the
    attempt recorded in the TrainingJob's status (the operator), the old Job deleted, the next
    Job."""

    def __init__(self, cp: ControlPlane, namespace: str) -> None:
        super().__init__(cp, namespace, ("pod", "job", "tj"))
        self.terminated: dict[str, float] = {}  # Job name -> first pod status with an exit
        self.recorded: dict[str, float] = {}  # TrainingJob -> first status with an ended attempt
        self.deleted: dict[str, float] = {}  # Job name -> deletionTimestamp or DELETED seen
        self.added: dict[str, float] = {}  # Job name -> first seen

    def _event(self, kind: str, event: str, obj: dict[str, Any]) -> None:
        now = time.time()
        meta = obj["metadata"]
        if kind == "pod":
            job = (meta.get("labels") or {}).get("job-name", "")
            for cs in (obj.get("status") or {}).get("containerStatuses") or []:
                if "terminated" in (cs.get("state") or {}):
                    self.terminated.setdefault(job, now)
        elif kind == "job":
            self.added.setdefault(meta["name"], now)
            if event == "DELETED" or meta.get("deletionTimestamp"):
                self.deleted.setdefault(meta["name"], now)
        elif any(a.get("outcome") for a in (obj.get("status") or {}).get("attempts") or []):
            self.recorded.setdefault(meta["name"], now)


def _percentiles(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    if not values:
        return {}
    return {
        "p50": statistics.median(values),
        "p90": values[int(0.9 * (len(values) - 1))],
        "max": values[-1],
    }


def bench_requeue(
    cp: ControlPlane, n_running: int, count: int, control: Path, spacing: float
) -> dict[str, Any]:
    """(c). Besides exit -> next Job, the segments in between (p50/p90/max of each): the pod's
    exit reported by the node agent, the attempt recorded by the operator, the next Job
    created; and, off that path, from the attempt recorded to the old Job's deletion."""
    ns = "bench-running"
    with Timeline(cp, ns) as tl:
        time.sleep(2)
        picks = [f"r{i}" for i in range(min(count, n_running))]
        for name in picks:
            (control / f"{name}-a1-0.exit").touch()
            time.sleep(spacing)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if all(f"{name}-a2" in tl.added for name in picks):
                break
            time.sleep(0.5)
    totals: list[float] = []
    segments: dict[str, list[float]] = {
        "exit_to_pod_reported": [],
        "pod_reported_to_attempt_recorded": [],
        "attempt_recorded_to_next_job": [],
    }
    cleanup: list[float] = []
    for name in picks:
        exited = control / f"{name}-a1-0.exited"
        old, new = f"{name}-a1", f"{name}-a2"
        if not (exited.exists() and new in tl.added):
            continue
        marks = [
            float(exited.read_text()),
            tl.terminated.get(old),
            tl.recorded.get(name),
            tl.added[new],
        ]
        if marks[2] is not None and old in tl.deleted:
            cleanup.append(tl.deleted[old] - marks[2])
        totals.append(marks[-1] - marks[0])
        for key, a, b in zip(segments, marks[:-1], marks[1:], strict=True):
            if a is not None and b is not None:
                segments[key].append(b - a)
    if not totals:
        return {"count": 0}
    return {
        "count": len(totals),
        "missing": len(picks) - len(totals),
        **_percentiles(totals),
        **{key: _percentiles(values) for key, values in segments.items()},
        "attempt_recorded_to_old_job_deleted": _percentiles(cleanup),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--queued", type=int, default=1000, help="(a) queued TrainingJobs (0: skip)"
    )
    parser.add_argument(
        "--backlog",
        action="store_true",
        help="(a): create the TrainingJobs first, then start the operator",
    )
    parser.add_argument(
        "--finished", type=int, default=0, help="(f) TrainingJobs that succeed at once (0: skip)"
    )
    parser.add_argument(
        "--idle-window",
        type=float,
        default=60.0,
        help="(i) seconds of operator CPU with the queued and finished jobs idle (0: skip)",
    )
    parser.add_argument("--running", type=int, default=500, help="(b) running stub jobs (0: skip)")
    parser.add_argument(
        "--stub",
        choices=("python", "c"),
        default="python",
        help="(b) the running jobs' stand-in: benchmarks/stub_runtime.py, or its C twin "
        "stub_runtime.c (about 1 MB a pod instead of 15: for thousands of running jobs)",
    )
    parser.add_argument("--requeues", type=int, default=50, help="(c) stubs that exit 75")
    parser.add_argument("--requeue-spacing", type=float, default=0.5, help="seconds between exits")
    parser.add_argument("--window", type=float, default=60.0, help="steady-state window, seconds")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument(
        "--operator-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="pass ARG to the operator (repeatable), e.g. --operator-arg=--poll-interval=10",
    )
    args = parser.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="preemptible-bench-"))
    root, control = workdir / "ckpt", workdir / "control"
    root.mkdir()
    control.mkdir()
    binaries = find_binaries()
    cp = ControlPlane(binaries, workdir / "cluster")
    kueue: Kueue | None = None
    agent: AgentProcess | None = None
    op: Operator | None = None
    results: dict[str, Any] = {}
    try:
        cp.start()
        _say(f"control plane up in {cp.started_seconds:.1f} s")
        if args.queued:
            kueue = Kueue(cp, quota_cpu="0", quota_memory="0")
            kueue.start()
        pods = str(max(110, (args.running + args.finished) // args.nodes + 10))
        agent = AgentProcess(
            cp,
            workdir / "node-agent",
            nodes=[f"bench-{i}" for i in range(args.nodes)],
            capacity={
                "cpu": "1000",
                "memory": "1000Gi",
                "pods": pods,
                "ephemeral-storage": "100Gi",
            },
            k8s_version=binaries.k8s_version,
        )
        with cp.api_client() as client:
            install_crd(client)
        if not (args.queued and args.backlog):
            op = Operator(cp.kubeconfig, workdir / "operator.log", args.operator_arg)
            time.sleep(5)
        if args.queued:
            how = "created before the operator starts" if args.backlog else "created while it runs"
            _say(f"(a) {args.queued} queued TrainingJobs, {how} ...")
            results["queued"], op = bench_queued(
                cp, kueue, op, args.queued, root, cp.kubeconfig, args.operator_arg
            )
            _say(f"    {json.dumps(results['queued'])}")
        if op is None:
            op = Operator(cp.kubeconfig, workdir / "operator.log", args.operator_arg)
            time.sleep(5)
        if args.finished:
            _say(f"(f) {args.finished} TrainingJobs that succeed at once ...")
            results["finished"] = bench_finished(cp, op, args.finished, root)
            _say(f"    {json.dumps(results['finished'])}")
        if args.idle_window and (args.queued or args.finished):
            idle = args.queued + args.finished
            _say(
                f"(i) operator CPU with {idle} idle TrainingJobs over {args.idle_window:.0f} s ..."
            )
            results["idle"] = bench_idle(op, idle, args.idle_window)
            _say(f"    {json.dumps(results['idle'])}")
        if args.running:
            _say(f"(b) {args.running} running stub jobs ...")
            results["running"] = bench_running(
                cp, op, args.running, root, control, args.window, args.stub
            )
            _say(f"    {json.dumps(results['running'])}")
            if args.requeues:
                _say(f"(c) {args.requeues} requeues (exit 75 -> next Job) ...")
                results["requeue"] = bench_requeue(
                    cp, args.running, args.requeues, control, args.requeue_spacing
                )
                _say(f"    {json.dumps(results['requeue'])}")
        rss, peak = op.rss_mb()
        results["operator"] = {
            "training_jobs": args.queued + args.finished + args.running,
            "rss_mb": rss,
            "peak_rss_mb": peak,
            "cpu_seconds": op.cpu_seconds(),
        }
    finally:
        if op is not None:
            op.stop()
        if agent is not None:
            agent.stop()
        if kueue is not None:
            kueue.stop()
        cp.stop()
        if args.keep:
            _say(f"work directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
