"""One level-triggered reconcile pass of a TrainingJob.

Reads the TrainingJob and its children (attempt Jobs, their pods, the Kueue Workload, nodes),
calls the pure decision functions, performs at most one action, writes the status once and then
releases what the status now records (pod finalizers, the finished Job). Every step is idempotent,
so an operator restarted at any moment converges to the same state without duplicate Jobs.
Only the official Kubernetes client is used.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import datetime as dt
import functools
import json
import logging
import random
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import kubernetes
from kubernetes.client.rest import ApiException

from preemptible_operator import metrics, models, render
from preemptible_operator import workload as wl
from preemptible_operator.boost import boost_patch, plan_boost
from preemptible_operator.budget import periodic_delay, spread_interval
from preemptible_operator.checkpoint_store import (
    CheckpointView,
    PathMap,
    StorageReads,
    StorageSnapshot,
)
from preemptible_operator.children import (
    Refusal,
    api_message,
    create_refusal,
    held_pods,
    jobs_to_delete,
    pods_to_end,
)
from preemptible_operator.classify import (
    Interruption,
    pod_finished,
)
from preemptible_operator.conditions import Event, Reason
from preemptible_operator.deactivation import DEACTIVATE_ON_RECORD, deactivation_patch
from preemptible_operator.elastic_attempt import (
    ElasticGate,
    admitted_flavors,
    elastic_sizes,
    gated_decision,
    grow_plan,
    reservation_held,
    size_event,
    slice_of,
    slices,
    start_gate,
    workload_finished,
)
from preemptible_operator.grace import cap_grace
from preemptible_operator.node_notice import NodeNotice, node_notice, pod_notice_patch
from preemptible_operator.observation import (
    Snapshot,
    earlier_attempts_active,
    interruption_of,
    phase_inputs,
    running_pods,
)
from preemptible_operator.ownership import (
    by_attempt,
    left_by_earlier_incarnation,
    owned_by,
    owned_children,
    tj_uid_of,
)
from preemptible_operator.pass_spec import parse_spec_tolerant, pass_spec, spec_of_job
from preemptible_operator.phases import (
    Decision,
    deadline_remaining,
    next_attempt_number,
    next_phase,
)
from preemptible_operator.priority_classes import PriorityClassValues
from preemptible_operator.recording import AttemptEnd
from preemptible_operator.refusals import (
    awaits_pods,
    no_pods_wait,
    pods_refusal,
)
from preemptible_operator.scrape import RuntimeMetrics, scrape
from preemptible_operator.start import (
    adopted_params,
    attempt_created_message,
    find_record,
    plan_attempt,
)
from preemptible_operator.status_build import (
    ActionResult,
    Built,
    ObservedStatus,
    Started,
    build_status,
    observed_status,
    with_snapshot,
)
from preemptible_operator.timestamps import now_rfc3339, parse_rfc3339
from preemptible_operator.wake import deadline_wake, wake_after

__all__ = [
    "Cached",
    "OperatorConfig",
    "PassResult",
    "Reconciler",
    "cap_grace",
    "jittered",
    "now_rfc3339",
    "parse_spec_tolerant",
    "spec_of_job",
]

log = logging.getLogger("preemptible_operator")

KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSIONS = ("v1beta2", "v1beta1")
KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"


@dataclass
class OperatorConfig:
    """Operator-wide settings (CLI flags)."""

    path_map: PathMap = field(default_factory=PathMap)
    scrape_metrics: bool = True
    scrape_timeout: float = 2.0
    poll_interval: float = 5.0
    """Seconds between passes while an attempt runs (metrics scraping, safety net); each wait
    is jittered by +-20% so that many jobs started together do not scrape in lockstep."""
    idle_resync: float = 300.0
    """Seconds between safety-net passes while nothing runs (queued, pending, backing off
    without a deadline): watch events wake the pass; this only catches a missed event."""
    status_progress_interval: float = 15.0
    """A running attempt's progress (step, timings) alone is written to the status at most this
    often; every other change is written at once."""
    max_scrapes_per_second: float = 20.0
    """Budget of periodic passes (each scrapes rank 0), all running jobs together: with more
    than ``poll_interval x`` this many running jobs, each job's poll interval grows to keep the
    total at the budget (500 jobs: every 25 s). 0: no budget."""
    max_progress_writes_per_second: float = 10.0
    """Budget of progress-only status writes, all running jobs together, the same way for
    ``status_progress_interval`` (500 jobs: every 50 s). 0: no budget."""
    request_timeout: tuple[float, float] = (5.0, 30.0)
    """(connect, read) timeout of every API request, so a stuck call never holds a worker."""
    kueue: bool = True
    """Watch Kueue Workloads (off: Kueue not installed or no RBAC for Workloads)."""
    priority_boost: bool = False
    """Keep kueue.x-k8s.io/priority-boost on running attempts' Workloads (victims.py)."""
    priority_boost_max: int = 100
    """Top of the boost band (protection); must stay below the gap between priority classes."""
    max_grace_seconds: int | None = None
    """Cluster admin's cap on any TrainingJob's grace period (pinned or computed): a
    low-priority job cannot keep its GPUs for hours after Kueue preempts it."""
    workers: int = 32
    """Threads running reconcile passes (each blocks on API requests)."""
    heap_trim_interval: float = 60.0
    """Seconds between trims of the operator's heap (glibc ``malloc_trim``: memory freed after
    a burst goes back to the OS instead of holding RSS at the burst's high-water mark). 0: off."""
    node_cache_seconds: float = 10.0
    """How long one read of a node's readiness is reused (by every job on that node)."""
    component: str = "preemptible-operator"


@dataclass
class PassResult:
    """What a pass did; ``requeue_after`` None means nothing to do until something changes."""

    phase: str | None = None
    action: str = "none"
    requeue_after: float | None = None
    events: list[tuple[str, str, str]] = field(default_factory=list)
    done: bool = False
    """Terminal and nothing left to release: no further pass is needed for this object."""
    on_written: list[Callable[[], None]] = field(default_factory=list)
    """Metric updates counting what this pass records (a preemption, lost steps, a queue wait):
    run once the status write succeeded, never by a pass that is redone."""


@dataclass
class Cached:
    """A TrainingJob and its children from the operator's watch caches (kopf indexes), so a
    pass makes no list calls. ``obj`` None: read the TrainingJob from the API."""

    obj: dict[str, Any] | None
    jobs: list[dict[str, Any]]
    pods: list[dict[str, Any]]
    workloads: dict[str, dict[str, Any]]
    """Kueue Workloads by the uid of the Job they stand for."""


_Observed = Snapshot
"""The snapshot's former name (tests and callers that build one by hand)."""


class Reconciler:
    """Reconciles TrainingJobs through a kubernetes ApiClient."""

    def __init__(
        self,
        api_client: kubernetes.client.ApiClient,
        config: OperatorConfig | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.api = api_client
        self.config = config or OperatorConfig()
        self.custom = kubernetes.client.CustomObjectsApi(api_client)
        self.batch = kubernetes.client.BatchV1Api(api_client)
        self.core = kubernetes.client.CoreV1Api(api_client)
        self.clock = clock
        _default_request_timeout(api_client, self.config.request_timeout)
        self._lock = threading.Lock()
        # (namespace, name) -> (resourceVersions our status write replaced, the object the
        # write returned): the watch cache may not have delivered our own write yet.
        self._written: dict[tuple[str, str], tuple[tuple[str, ...], dict[str, Any]]] = {}
        # (namespace, name) -> monotonic time of the last status write of progress only.
        self._progress_written: dict[tuple[str, str], float] = {}
        # TrainingJobs on the poll timer (an attempt's pods exist): the periodic budgets are
        # shared among them.
        self._polled: set[tuple[str, str]] = set()
        # node name -> (monotonic time read, Ready, its notice: node_notice.node_notice)
        self._nodes: dict[str, tuple[float, bool, NodeNotice | None]] = {}
        # node name -> when its Ready condition last turned non-True (unreachable.py's bound).
        self._node_since: dict[str, float] = {}
        self._services: set[tuple[str, str, str]] = set()
        # uids of pods released and Jobs deleted: the watch cache may still show them as they
        # were, and the next pass (at once after an attempt ends) must not repeat the requests.
        self._released = _Recent()
        self._deleted = _Recent()
        # Events are best effort: posted off the pass, so they never delay the next action.
        self._event_pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="events")
        # An ended attempt's pods are released and its Job deleted off the pass, so the next
        # attempt's Job is not created behind them; (namespace, name) -> that work in flight.
        self._cleanup_pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="cleanup")
        self._cleanups: dict[tuple[str, str], concurrent.futures.Future[None]] = {}
        # Looks at checkpoint roots, under a deadline; recording attempt N and creating N+1
        # share one (key (uid, N)).
        self._storage = StorageReads()
        # (namespace, name) -> (Workload uid, monotonic time) of the last priority-boost write.
        self._boosted: dict[tuple[str, str], tuple[str, float]] = {}
        self._class_values = PriorityClassValues(api_client)
        # (priority, configured, band top) already warned about: one line per class, not per pass.
        self._narrowed: set[tuple[int, int, int]] = set()

    # ------------------------------------------------------------------------------ reading
    @staticmethod
    def _json(resp: Any) -> dict[str, Any]:
        return json.loads(resp.data)

    def _get_custom(
        self, group: str, version: str, namespace: str, plural: str, name: str
    ) -> dict[str, Any] | None:
        """One custom object, or None when it does not exist."""
        try:
            return self._json(
                self.custom.get_namespaced_custom_object(
                    group, version, namespace, plural, name, _preload_content=False
                )
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _get_tj(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._get_custom(models.GROUP, models.VERSION, namespace, models.PLURAL, name)

    def _api_jobs(self, namespace: str, name: str) -> list[dict[str, Any]]:
        data = self._json(
            self.batch.list_namespaced_job(
                namespace,
                label_selector=f"{render.LABEL_TRAINING_JOB}={name}",
                _preload_content=False,
            )
        )
        return list(data.get("items", []))

    def _api_pods(self, namespace: str, name: str) -> list[dict[str, Any]]:
        data = self._json(
            self.core.list_namespaced_pod(
                namespace,
                label_selector=f"{render.LABEL_TRAINING_JOB}={name}",
                _preload_content=False,
            )
        )
        return list(data.get("items", []))

    def _list_pods(self, namespace: str, name: str) -> dict[int, list[dict[str, Any]]]:
        return by_attempt(self._api_pods(namespace, name))

    def _get_workload(
        self, namespace: str, job: dict[str, Any] | None, cached: Cached | None = None
    ) -> tuple[dict[str, Any] | None, str | None]:
        if job is None:
            return None, None
        uid = job["metadata"]["uid"]
        if cached is not None:
            workload = cached.workloads.get(uid)
            if workload is None:
                return None, None
            return workload, str(workload.get("apiVersion", "")).rpartition("/")[2] or None
        for version in KUEUE_VERSIONS:
            try:
                data = self._json(
                    self.custom.list_namespaced_custom_object(
                        KUEUE_GROUP,
                        version,
                        namespace,
                        "workloads",
                        label_selector=f"{KUEUE_JOB_UID_LABEL}={uid}",
                        _preload_content=False,
                    )
                )
            except ApiException as exc:
                if exc.status == 404:  # this version (or Kueue) is not installed
                    continue
                raise
            items = data.get("items", [])
            return (items[0] if items else None), version
        return None, None

    def _list_elastic_workloads(self, namespace: str, name: str) -> list[dict[str, Any]]:
        data = self._json(
            self.custom.list_namespaced_custom_object(
                wl.KUEUE_GROUP,
                wl.KUEUE_VERSION,
                namespace,
                wl.WORKLOAD_PLURAL,
                label_selector=f"{render.LABEL_TRAINING_JOB}={name}",
                _preload_content=False,
            )
        )
        return [
            w
            for w in data.get("items", [])
            if wl.ANNOTATION_SLICE in (w["metadata"].get("annotations") or {})
        ]

    def _get_elastic_workload(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._get_custom(
            wl.KUEUE_GROUP, wl.KUEUE_VERSION, namespace, wl.WORKLOAD_PLURAL, name
        )

    def _node_ready(self, pods: list[dict[str, Any]]) -> dict[str, bool]:
        ready: dict[str, bool] = {}
        now = time.monotonic()
        for node_name in {(p.get("spec") or {}).get("nodeName") for p in pods} - {None}:
            with self._lock:
                hit = self._nodes.get(node_name)
            if hit is not None and now - hit[0] < self.config.node_cache_seconds:
                ready[node_name] = hit[1]
                continue
            try:
                node = self._json(self.core.read_node(node_name, _preload_content=False))
            except ApiException as exc:
                if exc.status == 404:  # gone: absent from the map (pod_finished, _node_lost)
                    continue
                if exc.status == 403:  # no permission: do not guess node loss
                    ready[node_name] = True
                    continue
                raise
            conds = (node.get("status") or {}).get("conditions") or []
            ready[node_name] = any(
                c.get("type") == "Ready" and c.get("status") == "True" for c in conds
            )
            since = next(
                (
                    parse_rfc3339(c.get("lastTransitionTime"))
                    for c in conds
                    if c.get("type") == "Ready" and c.get("status") != "True"
                ),
                None,
            )
            with self._lock:
                self._nodes[node_name] = (now, ready[node_name], node_notice(node))
                if since is not None:
                    self._node_since[node_name] = since
                else:
                    self._node_since.pop(node_name, None)
        return ready

    def _annotate_node_notice(self, pods: list[dict[str, Any]]) -> None:
        """Write each bound pod's node notice onto it (node_notice.py): the runtime reads it at
        SIGTERM through a downward-API file. Uses the node reads _node_ready just cached."""
        for pod in pods:
            node_name = (pod.get("spec") or {}).get("nodeName")
            with self._lock:
                hit = self._nodes.get(node_name) if node_name else None
            if hit is None:
                continue
            patch = pod_notice_patch(pod, hit[2])
            if patch is None:
                continue
            meta = pod["metadata"]
            try:
                self.core.patch_namespaced_pod(meta["name"], meta["namespace"], patch)
            except ApiException as exc:
                if exc.status not in (403, 404, 409, 422):
                    raise
                log.warning("pod %s/%s: node notice not written: %s", meta["namespace"],
                            meta["name"], exc.reason)  # fmt: skip
                continue
            log.info("pod %s/%s: node %s gives %s s of notice (%s)", meta["namespace"],
                     meta["name"], node_name, hit[2].seconds if hit[2] else None,
                     hit[2].source if hit[2] else "none")  # fmt: skip

    def cache_saw(self, namespace: str, name: str, resource_version: str | None) -> None:
        """The watch delivered ``resource_version`` of the TrainingJob: once it is not a version
        our last status write replaced, the copy of that write is not needed any more. Called
        on every watch event, so a job with no further pass (finished, queued) holds no copy."""
        if resource_version is None:
            return
        with self._lock:
            written = self._written.get((namespace, name))
            if written is not None and resource_version not in written[0]:
                del self._written[(namespace, name)]

    def _current_tj(
        self, namespace: str, name: str, cached: Cached | None
    ) -> dict[str, Any] | None:
        obj = cached.obj if cached is not None and cached.obj is not None else None
        if obj is None:
            return self._get_tj(namespace, name)
        # The cache has our write (or newer): the copy is not needed any more.
        self.cache_saw(namespace, name, obj["metadata"].get("resourceVersion"))
        with self._lock:
            written = self._written.get((namespace, name))
        if written is not None:
            return written[1]  # the cache still holds the version our last write replaced
        return obj

    def _observe(
        self,
        namespace: str,
        name: str,
        cached: Cached | None = None,
        *,
        scrape_metrics: bool = False,
    ) -> Snapshot | None:
        """Read everything a pass decides on into one snapshot (None: the TrainingJob is gone).
        ``scrape_metrics``: read rank 0's /metrics too (periodic passes only: one woken by a
        watch event keeps the last scraped values, in the status, so a slow pod never delays
        the handling of an event)."""
        obj = self._current_tj(namespace, name, cached)
        if obj is None:
            return None
        uid = obj["metadata"].get("uid")
        status = models.TrainingJobStatus.model_validate(obj.get("status") or {})
        invalid = render.validate_name(name)
        raw_jobs = cached.jobs if cached is not None else self._api_jobs(namespace, name)
        raw_pods = cached.pods if cached is not None else self._api_pods(namespace, name)
        children = owned_children(uid, raw_jobs, raw_pods)
        jobs, pods = children.jobs, children.pods_by_attempt
        now_s = self.clock()
        previous = [
            p for p in children.foreign_pods if not pod_finished(p, self._node_ready([p]), now_s)
        ]
        attempt = max([status.attempt or 0, *jobs.keys()])
        job = jobs.get(attempt)
        chosen = pass_spec(obj.get("spec"), invalid, attempt, job)
        spec, invalid, rejected = chosen.spec, chosen.invalid, chosen.rejected
        if chosen.note:
            log.warning("%s/%s: %s", namespace, name, chosen.note)
        workload, version = (None, None)
        pending_slices: tuple[dict[str, Any], ...] = ()
        if spec is not None and spec.elastic is not None and self.config.kueue:
            # The TrainingJob's own Workloads (one for all its attempts, one more per grow).
            current = find_record(status, attempt)
            running_slice = None
            if job is not None and (current is None or current.end_time is None):
                running_slice = slice_of(job)
            seen = slices(self._list_elastic_workloads(namespace, name), running_slice)
            workload, version = seen.current, wl.KUEUE_VERSION
            pending_slices = seen.pending
        elif spec is not None and spec.queue_name:
            workload, version = self._get_workload(namespace, job, cached)
        current_pods = pods.get(attempt, [])
        node_ready = self._node_ready(current_pods)
        with self._lock:
            not_ready_since = {
                n: self._node_since[n]
                for n, ok in node_ready.items()
                if not ok and n in self._node_since
            }
        runtime_metrics: RuntimeMetrics | None = None
        record = find_record(status, attempt)
        recorded = record is not None and record.end_time is not None
        if (
            scrape_metrics
            and self.config.scrape_metrics
            and spec is not None
            and attempt
            and not recorded
            and running_pods(current_pods)
        ):
            runtime_metrics = self._scrape_rank0(current_pods, spec)
        return Snapshot(
            obj=obj,
            status=status,
            spec=spec,
            invalid=invalid,
            jobs=jobs,
            pods_by_attempt=pods,
            attempt=attempt,
            job=job,
            pods=current_pods,
            workload=workload,
            workload_version=version,
            node_ready=node_ready,
            node_not_ready_since=not_ready_since,
            previous_pods=previous,
            rejected=rejected,
            runtime_metrics=runtime_metrics,
            pending_slices=pending_slices,
        )

    # ------------------------------------------------------------------------------ the pass
    def reconcile(
        self,
        namespace: str,
        name: str,
        cached: Cached | None = None,
        *,
        scrape_metrics: bool = True,
    ) -> PassResult:
        """One pass. ``scrape_metrics`` False (a pass woken by a watch event): rank 0's /metrics
        is not read; the periodic passes read it."""
        t0 = time.monotonic()
        try:
            return self._reconcile(namespace, name, cached, scrape_metrics)
        except Exception:
            metrics.RECONCILE_ERRORS.inc()
            raise
        finally:
            metrics.RECONCILE_SECONDS.observe(time.monotonic() - t0)

    def _reconcile(
        self, namespace: str, name: str, cached: Cached | None, scrape_metrics: bool = True
    ) -> PassResult:
        """Observe (``_observe``: one immutable Snapshot, status_build.observed_status: the
        status decided on), decide (the pure functions of observation.py, start.py, show.py,
        wake.py, phases.next_phase), act (``_act``: the API calls of the one decided action,
        reported as an ActionResult), build the new status once (status_build.build_status),
        write it (``_write_and_post``) and say when the next pass is due (``_schedule``)."""
        obs = self._observe(namespace, name, cached, scrape_metrics=scrape_metrics)
        if obs is None:
            return PassResult(done=True)
        now = now_rfc3339()
        old_status = obs.status.to_k8s()
        result = PassResult()
        spec = obs.spec

        # Storage is listed only when an attempt ends or starts (_end_look,
        # _create_attempt): while one runs, the runtime's /metrics report its checkpoints.
        storage_view = CheckpointView(spec.checkpoint.uri, self.config.path_map) if spec else None
        readable = storage_view.readable if storage_view is not None else None
        seen_status = observed_status(obs, readable, now, self.clock())
        status, record, recorded = seen_status.status, seen_status.record, seen_status.recorded
        if status.attempt:
            metrics.ATTEMPT.labels(namespace, name).set(status.attempt)
        wait = seen_status.queue_wait
        if wait is not None:
            result.on_written.append(lambda: metrics.QUEUE_WAIT_SECONDS.observe(wait))
        left = deadline_remaining(
            status.start_time, spec.active_deadline_seconds if spec else None, self.clock()
        )
        seen = interruption_of(obs, spec, record, recorded, left is not None and left <= 0)
        interruption = seen.interruption
        if seen.deactivated_by_other:
            # The next pass reads the new spec and records the attempt.
            self._annotate_node_notice(obs.pods)
            self._suspend_for_deactivation(obs.obj, interruption.message)
            return PassResult(phase=status.phase, requeue_after=0.0)
        inputs = phase_inputs(obs, status, record, recorded, interruption, self.clock())
        decision = next_phase(inputs)
        elastic: tuple[ElasticGate, wl.Admission | None] | None = None
        if decision.action == "create_attempt" and self._elastic(spec):
            assert spec is not None  # _elastic
            # The TrainingJob's own Workload decides whether and at what size the attempt
            # starts (a read of its admitted flavors; the gate's writes are actions, _act).
            elastic = self._elastic_gate(obs, spec)
            decision = gated_decision(decision, elastic[0])
        result.action = decision.action
        result.phase = decision.phase
        log.info(
            "reconcile %s/%s: phase %s, action %s (%s)",
            namespace,
            name,
            decision.phase,
            decision.action,
            decision.reason,
            extra={
                "tj": f"{namespace}/{name}",
                "phase": decision.phase,
                "action": decision.action,
                "reason": decision.reason,
            },
        )

        # ------------------------------------------------------------------ act, then build
        self._annotate_node_notice(obs.pods)  # an action of every pass (node_notice.py)
        done = self._act(
            obs, decision, seen_status, interruption, storage_view, inputs.backoff_remaining, now,
            elastic,
        )  # fmt: skip
        built = build_status(
            obs, seen_status, decision, inputs, interruption, done, now=now,
            now_s=self.clock(), max_grace_seconds=self.config.max_grace_seconds,
        )  # fmt: skip
        result.phase = built.shown.phase
        result.events.extend(built.events)
        if built.requeue_after is not None:
            result.requeue_after = built.requeue_after
        if built.end is not None and built.record is not None:
            self._count_end(obs, built.record, built.end, result)
        if spec is not None and built.grace_recommended is not None:
            metrics.GRACE_SECONDS.labels(namespace, name).set(built.grace_recommended)
        after_status: list[Callable[[], None]] = [
            functools.partial(fn, built) for fn in done.deferred
        ]
        if (
            self.config.priority_boost
            and spec is not None
            and spec.elastic is None  # the boost is for Kueue's Workloads of attempt Jobs
            and built.phase == "Running"
        ):
            after_status.append(
                lambda: self._update_priority_boost(obs, spec, built.status, built.record)
            )
        if not self._write_and_post(obs, built.status, old_status, result, after_status):
            return result  # conflict: the next pass re-reads and redoes this one
        return self._schedule(obs, built.status, built.phase, inputs.deadline_remaining, result)

    def _write_and_post(
        self,
        obs: Snapshot,
        status: models.TrainingJobStatus,
        old_status: dict[str, Any],
        result: PassResult,
        after_status: list[Callable[[], None]],
    ) -> bool:
        """Write the status once (progress alone at most every status_progress_interval), then
        count, post the Events and run what waited for the write. False: a conflict, nothing
        done (``result`` asks for the pass to be redone)."""
        meta = obs.obj["metadata"]
        key = (meta["namespace"], meta["name"])
        new_status = status.to_k8s()
        write = new_status != old_status
        if write and _progress_only(old_status, new_status) and not result.events:
            # The runtime's step and timings alone: at most every status_progress_interval.
            with self._lock:
                last = self._progress_written.get(key)
            write = last is None or time.monotonic() - last >= self.periodic_intervals()[1]
        if write:
            if not self._write_status(obs.obj, new_status, old_status):
                result.requeue_after = 0.5
                return False
            with self._lock:
                self._progress_written[key] = time.monotonic()
        # Counters of what this pass recorded: only now that the status holding it is written
        # (or needed no write), so a pass redone after a conflict counts it once.
        for count in result.on_written:
            count()
        for event in result.events:
            self._event(obs.obj, *event)
        for fn in after_status:
            fn()
        return True

    def _schedule(
        self,
        obs: Snapshot,
        status: models.TrainingJobStatus,
        new_phase: str,
        deadline_left: float | None,
        result: PassResult,
    ) -> PassResult:
        """When the next pass is due (wake.wake_after, the periodic timer, the deadline), or
        the TrainingJob deleted once its TTL after finishing passed."""
        meta = obs.obj["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        key = (namespace, name)
        spec = obs.spec
        ttl = spec.ttl_seconds_after_finished if spec else None
        wake = wake_after(
            new_phase, status.completion_time, ttl, result.requeue_after, bool(obs.pods),
            self.clock(),
        )  # fmt: skip
        if wake.delete:
            self._delete_finished(obs.obj, ttl or 0)
            result.done = True
            self.forget(namespace, name, series=False)
            return result
        result.requeue_after = wake.requeue_after
        if wake.done:
            result.done = True
            self.forget(namespace, name, series=False)
        elif wake.periodic:
            with self._lock:
                if wake.busy:
                    self._polled.add(key)
                else:
                    self._polled.discard(key)
            poll = self.periodic_intervals()[0]
            delay = periodic_delay(new_phase, wake.busy, poll, self.config.idle_resync)
            result.requeue_after = None if delay is None else jittered(delay)
        else:
            with self._lock:
                self._polled.discard(key)
        result.requeue_after = deadline_wake(result.requeue_after, new_phase, deadline_left)
        return result

    def _act(
        self,
        obs: Snapshot,
        decision: Decision,
        observed: ObservedStatus,
        interruption: Interruption,
        storage_view: CheckpointView | None,
        backoff_left: float,
        now: str,
        elastic: tuple[ElasticGate, wl.Admission | None] | None = None,
    ) -> ActionResult:
        """The decided action's API calls (after the node notices and, for an elastic create,
        its gate), reported for the status built from them (nothing here changes a status or
        the decision). What must wait for the status write (releasing
        pods, deleting an ended attempt's Jobs) goes to the result's ``deferred``."""
        meta = obs.obj["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        spec = obs.spec
        record, recorded = observed.record, observed.recorded
        # The attempt is over by its trainer containers, but a regular sidecar keeps a pod
        # running: end those pods (their trainer's state stays readable, the finalizer holds
        # them), or the attempt never ends.
        ending = pods_to_end(obs.pods, interruption.over and not recorded)
        if ending:
            self._stop_pods([dict(p) for p in ending])
        action = decision.action
        if elastic is not None and elastic[0].action != "start" and spec is not None:
            return self._open_gate(obs, spec, elastic[0], now)
        if action == "fail_invalid":
            if obs.job is not None and not recorded:
                self._stop_pods(obs.pods)
        elif action == "fail":
            # The attempt's pods stop gracefully (JIT checkpoint) and its Job goes, so Kueue
            # admits no queued one later.
            if obs.job is not None and not recorded:
                self._stop_pods(obs.pods)
                self._delete_job(obs.job)
            if obs.pods:
                return ActionResult(requeue_after=1.0)  # the next pass releases the finalizers
        elif action == "create_attempt" and spec is not None:
            created = self._create_attempt(
                obs, spec, observed.status, record, recorded, decision.reason, now, elastic
            )
            return created or ActionResult()
        elif action == "stop_attempt":
            self._stop_pods(obs.pods)
        elif action == "stop_previous":
            # Their pods get SIGTERM (JIT checkpoint); the next pass creates the attempt once
            # they ended (their watch events wake it; the timer is a safety net).
            pods, jobs = earlier_attempts_active(obs, next_attempt_number(obs.attempt, recorded))
            self._stop_pods(pods)
            for job in jobs:
                self._delete_job(job)
            return ActionResult(requeue_after=1.0)
        elif action == "deactivate_workload":
            if self._elastic(spec):
                # The TrainingJob's own Workload was evicted: the operator stops the attempt
                # (JIT checkpoint), as Kueue's suspension of a Job it manages would; the
                # reservation is released once the pods are gone (_elastic_gate).
                self._stop_pods(obs.pods)
                # A grow asked for meanwhile is dropped: the same Workload requeues instead.
                for pending in obs.pending_slices:
                    self._delete_workload(pending)
            else:
                self._deactivate_workload(namespace, obs.workload, obs.workload_version)
        elif action == "record_attempt" and spec is not None and record is not None:
            if interruption.reason in DEACTIVATE_ON_RECORD:
                self._deactivate_workload(namespace, obs.workload, obs.workload_version)
            pods = list(obs.pods)

            def clean_up(built: Built) -> None:
                # The newest failed attempt's Job stays (its pods' logs) until the TrainingJob
                # is deleted; preempted attempts' Jobs and older failed ones go.
                jobs = jobs_to_delete(obs.jobs, built.outcomes, obs.attempt, obs.pods_by_attempt)
                self._clean_up_later(namespace, name, pods, [dict(j) for j in jobs])

            return ActionResult(
                storage=self._end_look(obs, record, storage_view),
                ends_attempt=True,
                requeue_after=0.0,  # the next attempt at once
                deferred=(clean_up,),
            )
        elif action in ("finish", "cleanup"):
            if self._elastic(spec):
                self._end_elastic_workload(obs, decision, now)
            held = held_pods(obs.pods_by_attempt)
            if held:
                return ActionResult(
                    requeue_after=1.0,  # confirm they were released
                    deferred=(lambda _built: self._release_pods(held),),
                )
        elif action == "wait_backoff":
            return ActionResult(requeue_after=max(0.5, backoff_left))
        elif action == "none" and spec is not None and not recorded:
            if self._elastic(spec) and decision.phase == "Running":
                grown = self._maybe_grow(obs, spec, observed.status, record)
                return ActionResult(events=(grown,) if grown is not None else ())
            if awaits_pods(decision, spec, obs.job, recorded) and not obs.pods:
                assert obs.job is not None  # awaits_pods
                # The Job exists and runs but has no pods: the Job controller may be refused
                # them (a ResourceQuota, Pod Security Admission). It retries by itself; the
                # status shows why, and the pass looks again later (no watch event comes).
                refused = pods_refusal(obs.job, self._job_events(obs.job))
                if refused is not None:
                    return ActionResult(refusal=refused)
                return ActionResult(requeue_after=no_pods_wait(obs.job, self.clock()))
        return ActionResult()

    def periodic_intervals(self) -> tuple[float, float]:
        """(poll, progress-only status write) period of one running job now: the configured
        ones, or longer where the running jobs together would exceed the budgets."""
        with self._lock:
            jobs = len(self._polled)
        cfg = self.config
        poll = spread_interval(cfg.poll_interval, jobs, cfg.max_scrapes_per_second)
        metrics.POLL_INTERVAL_SECONDS.set(poll)
        return (
            poll,
            spread_interval(cfg.status_progress_interval, jobs, cfg.max_progress_writes_per_second),
        )

    def forget(self, namespace: str, name: str, *, series: bool = True) -> None:
        """Drop what the operator keeps for a finished or deleted TrainingJob; ``series``: its
        per-job metric series too (once it is deleted: a series must not outlive its job)."""
        with self._lock:
            self._written.pop((namespace, name), None)
            self._progress_written.pop((namespace, name), None)
            self._boosted.pop((namespace, name), None)
            self._polled.discard((namespace, name))
            self._services = {k for k in self._services if k[:2] != (namespace, name)}
        if series:
            metrics.forget_job(namespace, name)

    def release_all(self, namespace: str, name: str) -> None:
        """The TrainingJob is being deleted: let garbage collection remove its pods."""
        for pods in self._list_pods(namespace, name).values():
            self._release_pods(pods)

    def release_orphan_pod(self, pod: dict[str, Any]) -> None:
        """Release a deleted pod whose TrainingJob no longer exists (or was re-created: a
        TrainingJob of the same name with another uid)."""
        meta = pod.get("metadata") or {}
        tj = (meta.get("labels") or {}).get(render.LABEL_TRAINING_JOB)
        if not tj:
            return
        current = self._get_tj(meta["namespace"], tj)
        recorded = tj_uid_of(pod)
        if current is None or (recorded is not None and recorded != current["metadata"]["uid"]):
            self._release_pods([pod])

    # ------------------------------------------------------------------------------ actions
    def _create_attempt(
        self,
        obs: _Observed,
        spec: models.TrainingJobSpec,
        status: models.TrainingJobStatus,
        record: models.AttemptRecord | None,
        recorded: bool,
        reason: str,
        now: str,
        elastic: tuple[ElasticGate, wl.Admission | None] | None = None,
    ) -> ActionResult:
        """Create the attempt's Service and Job (planned from ``status``, the one decided on):
        the attempt started, or a permanent refusal of either; a temporary error raised.
        ``elastic``: the admitted size of an elastic job's attempt (_elastic_gate)."""
        meta = obs.obj["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        attempt = next_attempt_number(obs.attempt, recorded)
        view = CheckpointView(spec.checkpoint.uri, self.config.path_map)
        # The look the pass recording the previous attempt took, when it was just now.
        storage = self._storage.snapshot(view, (meta["uid"], attempt - 1))
        reported = status.last_complete_checkpoint
        plan = plan_attempt(
            obs, spec, with_snapshot(status, storage), recorded, reported, storage,
            self.config.max_grace_seconds,
        )  # fmt: skip
        params = plan.params
        if elastic is not None:
            gate, admission = elastic
            assert gate.nodes is not None and admission is not None  # a "start" gate
            params = dataclasses.replace(
                params,
                suspended=False,  # admitted already, and not Kueue's to unsuspend
                nodes=gate.nodes,
                elastic=True,
                node_selector=admission.node_selector or None,
                tolerations=admission.tolerations or None,
            )
        nodes = render.attempt_nodes(spec, params)
        if nodes > 1:
            # Rendezvous (MASTER_ADDR) only: one pod needs no DNS name.
            refused = self._ensure_service(meta, spec)
            if refused is not None:
                return ActionResult(refusal=refused, storage=storage)
        job_body = render.render_job(meta, spec, params)
        if elastic is not None and obs.workload is not None:
            # Which of the TrainingJob's Workloads this attempt runs under (slices()).
            job_body["metadata"]["annotations"][wl.ANNOTATION_SLICE] = str(slice_of(obs.workload))
        try:
            self.batch.create_namespaced_job(namespace, job_body)
            created = True
        except ApiException as exc:
            if exc.status != 409:
                refused = _refusal("Job", job_body["metadata"]["name"], exc)
                if refused is None:
                    raise
                return ActionResult(refusal=refused, storage=storage)
            created = False
            existing = self._json(
                self.batch.read_namespaced_job(
                    job_body["metadata"]["name"], namespace, _preload_content=False
                )
            )
            if not owned_by(existing, meta["uid"]):
                foreign = self._replace_foreign(existing, "Job", meta)
                return ActionResult(refusal=foreign, storage=storage)
            params = adopted_params(existing, params)
            nodes = render.attempt_nodes(spec, params)
        self._clean_up_later(namespace, name, plan.old_pods, plan.old_jobs)
        metrics.GRACE_SECONDS.labels(namespace, name).set(params.grace_seconds)
        if created:
            # Posted now: the Job exists whatever happens to this pass's status write.
            last = plan.previous
            if last is not None and last.end_time:
                ended = parse_rfc3339(last.end_time)
                if ended is not None:
                    metrics.REQUEUE_SECONDS.observe(max(0.0, self.clock() - ended))
            self._event(
                obs.obj, "Normal", reason, attempt_created_message(name, params, plan.grace.reason)
            )
            if elastic is not None:
                self._elastic_events(obs, spec, plan.previous, nodes, *elastic)
        return ActionResult(storage=storage, started=Started(params, nodes))

    # ------------------------------------------------------------------ elastic (issue 40)
    def _elastic(self, spec: models.TrainingJobSpec | None) -> bool:
        """Whether the pass plays Kueue's part for the TrainingJob's own Workload."""
        return spec is not None and spec.elastic is not None and self.config.kueue

    def _elastic_gate(
        self, obs: Snapshot, spec: models.TrainingJobSpec
    ) -> tuple[ElasticGate, wl.Admission | None]:
        """The create path of an elastic job (elastic_attempt.start_gate) from its Workload and
        the size Kueue admitted (a read of the admitted ResourceFlavors); writes nothing."""
        meta = obs.obj["metadata"]
        workload = obs.workload
        name = workload["metadata"]["name"] if workload else wl.workload_name(meta["name"])
        admission = None
        if workload is not None and not workload_finished(workload):
            admission = wl.admitted_size(workload, self._flavors(admitted_flavors(workload)))
        return start_gate(workload, admission, elastic_sizes(spec), name), admission

    def _open_gate(
        self, obs: Snapshot, spec: models.TrainingJobSpec, gate: ElasticGate, now: str
    ) -> ActionResult:
        """The action of a Queued elastic job: its Workload created, or the reservation of an
        evicted one released (the previous attempt is gone: the same Workload requeues)."""
        if gate.action == "create_workload":
            self._create_workload(obs, spec, elastic_sizes(spec))
        elif gate.action == "clear_reservation":
            assert obs.workload is not None  # start_gate
            self._clear_reservation(obs.workload, now)
        # Its Workload's events wake the pass; this is the safety net.
        return ActionResult(requeue_after=30.0 if gate.action == "wait" else 0.5)

    def _flavors(self, names: tuple[str, ...]) -> dict[str, dict[str, Any]]:
        flavors: dict[str, dict[str, Any]] = {}
        for flavor in names:
            flavors[flavor] = self._json(
                self.custom.get_cluster_custom_object(
                    wl.KUEUE_GROUP,
                    wl.KUEUE_VERSION,
                    "resourceflavors",
                    flavor,
                    _preload_content=False,
                )
            )
        return flavors

    def _create_workload(
        self, obs: Snapshot, spec: models.TrainingJobSpec, sizes: tuple[int, ...]
    ) -> None:
        """Create the TrainingJob's Workload (count: the largest size, minCount: the smallest
        that keeps the global batch); AlreadyExists is done (a deterministic name)."""
        meta = obs.obj["metadata"]
        priority = None
        if spec.priority_class:
            # Kueue's webhook does not resolve the class on a Workload its owner creates.
            priority = int(
                self._json(
                    self.custom.get_cluster_custom_object(
                        wl.KUEUE_GROUP,
                        wl.KUEUE_VERSION,
                        "workloadpriorityclasses",
                        spec.priority_class,
                        _preload_content=False,
                    )
                ).get("value", 0)
            )
        params = render.AttemptParams(
            attempt=max(1, obs.attempt),
            grace_seconds=spec.grace_period.seconds or spec.grace_period.initial_seconds,
            resume_from="",
            suspended=False,
            nodes=sizes[-1],
            elastic=True,
        )
        body = wl.render_workload(
            meta, spec, params, min_nodes=sizes[0], max_nodes=sizes[-1], priority=priority
        )
        try:
            self.custom.create_namespaced_custom_object(
                wl.KUEUE_GROUP, wl.KUEUE_VERSION, meta["namespace"], wl.WORKLOAD_PLURAL, body
            )
        except ApiException as exc:
            if exc.status != 409:
                raise

    def _patch_workload_status(
        self, workload: dict[str, Any], build: Callable[[dict[str, Any]], dict[str, Any] | None]
    ) -> None:
        """A merge patch of the Workload's status, conditional on its resourceVersion: on a
        409 (Kueue wrote meanwhile) re-read and build it again; 404: gone, nothing to do."""
        meta = workload["metadata"]
        for _ in range(5):
            patch = build(workload)
            if patch is None:
                return
            try:
                self.custom.patch_namespaced_custom_object_status(
                    wl.KUEUE_GROUP,
                    wl.KUEUE_VERSION,
                    meta["namespace"],
                    wl.WORKLOAD_PLURAL,
                    meta["name"],
                    patch,
                    _content_type=wl.MERGE_PATCH,
                )
                return
            except ApiException as exc:
                if exc.status == 404:
                    return
                if exc.status != 409:
                    raise
            fresh = self._get_elastic_workload(meta["namespace"], meta["name"])
            if fresh is None or fresh["metadata"].get("uid") != meta.get("uid"):
                return
            workload = fresh
        raise RuntimeError(f"Workload {meta['name']}: status write conflicted 5 times")

    def _clear_reservation(self, workload: dict[str, Any], now: str) -> None:
        """The owner's requeue write (workload.clear_reservation_patch): the same Workload
        queues again in its old place."""

        def build(current: dict[str, Any]) -> dict[str, Any] | None:
            if wl.eviction(current) is None or not reservation_held(current):
                return None  # Kueue admitted it again, or released it itself
            return wl.clear_reservation_patch(current, now)

        self._patch_workload_status(workload, build)

    def _end_elastic_workload(self, obs: Snapshot, decision: Decision, now: str) -> None:
        """The training ended: Finished on its Workload (Kueue releases the quota). Suspended
        by the user: the Workload goes (it would hold its quota) and a new one is created when
        the job resumes."""
        workload = obs.workload
        if workload is None:
            return
        for pending in obs.pending_slices:  # a grow nobody needs any more
            self._delete_workload(pending)
        if decision.phase == "Suspended":
            self._delete_workload(workload)
            return
        if decision.phase not in ("Succeeded", "Failed"):
            return
        succeeded = decision.phase == "Succeeded"

        def build(current: dict[str, Any]) -> dict[str, Any] | None:
            if workload_finished(current):
                return None
            return wl.finished_patch(
                current, now, succeeded=succeeded, message=f"TrainingJob {decision.phase}"
            )

        self._patch_workload_status(workload, build)

    def _delete_workload(self, workload: dict[str, Any]) -> None:
        meta = workload["metadata"]
        try:
            self.custom.delete_namespaced_custom_object(
                wl.KUEUE_GROUP,
                wl.KUEUE_VERSION,
                meta["namespace"],
                wl.WORKLOAD_PLURAL,
                meta["name"],
                body=kubernetes.client.V1DeleteOptions(
                    preconditions=kubernetes.client.V1Preconditions(uid=meta.get("uid"))
                ),
            )
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise

    def _maybe_grow(
        self,
        obs: Snapshot,
        spec: models.TrainingJobSpec,
        status: models.TrainingJobStatus,
        record: models.AttemptRecord | None,
    ) -> Event | None:
        """While an elastic attempt runs below its largest size: ask Kueue for a bigger
        replacement slice when the restart pays (elastic_attempt.grow_plan); the Event that
        says so. Nothing changes until Kueue admits it; then the attempt stops at a checkpoint
        (Resizing)."""
        workload = obs.workload
        if workload is None or obs.pending_slices or record is None:
            return None
        if wl.eviction(workload) is not None or workload_finished(workload):
            return None
        grow = grow_plan(spec, status, record, self.clock())
        if grow is None:
            return None
        sizes = elastic_sizes(spec)
        assert record.nodes is not None  # grow_plan
        body = wl.render_replacement(
            workload, current_nodes=record.nodes, max_nodes=sizes[-1], sizes=sizes
        )
        try:
            self.custom.create_namespaced_custom_object(
                wl.KUEUE_GROUP,
                wl.KUEUE_VERSION,
                workload["metadata"]["namespace"],
                wl.WORKLOAD_PLURAL,
                body,
            )
        except ApiException as exc:
            if exc.status != 409:
                raise
            return None
        return (
            "Normal",
            Reason.GROW_REQUESTED,
            f"Workload {body['metadata']['name']}: {grow.message}",
        )

    def _elastic_events(
        self,
        obs: Snapshot,
        spec: models.TrainingJobSpec,
        previous: models.AttemptRecord | None,
        nodes: int,
        gate: ElasticGate,
        admission: wl.Admission | None,
    ) -> None:
        admitted = admission.count if admission is not None else nodes
        sizes = elastic_sizes(spec)
        event = size_event(previous.nodes if previous else None, nodes, spec, admitted, sizes)
        if event is not None:
            self._event(obs.obj, *event)
        if gate.unused:
            self._event(
                obs.obj,
                "Normal",
                Reason.QUOTA_UNUSED,
                f"Kueue admitted {admitted} pod(s) but the attempt runs on {nodes} (the sizes "
                f"that keep the global batch: {', '.join(map(str, sizes))}): {gate.unused} "
                "admitted pod(s) stay reserved and unused until the next attempt",
            )

    def _end_look(
        self, obs: Snapshot, record: models.AttemptRecord, view: CheckpointView | None
    ) -> StorageSnapshot | None:
        """The record_attempt action's look at storage (the look the next attempt's create
        reuses)."""
        key = (obs.obj["metadata"]["uid"], record.attempt)
        return self._storage.snapshot(view, key) if view is not None else None

    def _count_end(
        self, obs: Snapshot, record: models.AttemptRecord, end: AttemptEnd, result: PassResult
    ) -> None:
        """The metrics of a recorded attempt end; the counters once the status that records it
        is written (a pass redone after a conflict records the same attempt again)."""
        meta = obs.obj["metadata"]
        labels = (meta["namespace"], meta["name"])
        if end.sigterm_to_exit is not None:
            metrics.SIGTERM_TO_EXIT_SECONDS.labels(*labels).set(end.sigterm_to_exit)
        if record.grace_seconds is not None:
            metrics.ATTEMPT_GRACE_SECONDS.labels(*labels).set(record.grace_seconds)
        lost = end.lost_steps
        if lost:
            result.on_written.append(lambda: metrics.LOST_STEPS.labels(*labels).inc(lost))
        preempted = end.preempted
        if preempted is not None:
            result.on_written.append(lambda: metrics.PREEMPTIONS.labels(preempted).inc())

    def _ensure_service(self, meta: dict[str, Any], spec: models.TrainingJobSpec) -> Refusal | None:
        """Create the rendezvous Service. AlreadyExists is success only when it is ours; one of
        an earlier incarnation (same name, being garbage collected) is waited for (the pass is
        retried); anyone else's, or a create the apiserver refuses (invalid, forbidden), is
        returned as a refusal the status shows."""
        key = (meta["namespace"], meta["name"], meta["uid"])
        if key in self._services:
            return None
        body = render.render_service(meta, spec)
        try:
            self.core.create_namespaced_service(meta["namespace"], body)
        except ApiException as exc:
            if exc.status != 409:
                refused = _refusal("Service", body["metadata"]["name"], exc)
                if refused is None:
                    raise
                return refused
            existing = self._json(
                self.core.read_namespaced_service(
                    body["metadata"]["name"], meta["namespace"], _preload_content=False
                )
            )
            if not owned_by(existing, meta["uid"]):
                return self._replace_foreign(existing, "Service", meta)
        with self._lock:
            self._services.add(key)
        return None

    def _replace_foreign(
        self, existing: dict[str, Any], kind: str, meta: dict[str, Any]
    ) -> Refusal | None:
        """``existing`` holds the name a child of ``meta`` needs but is not ours: a refusal when
        someone else's (the user must delete or rename it); ChildConflict (a temporary error,
        retried) when a deleted TrainingJob of the same name left it."""
        name = existing["metadata"]["name"]
        if left_by_earlier_incarnation(existing, meta["name"]):
            # Left by a deleted TrainingJob of the same name: garbage collection removes it (a
            # Job we delete at once; a Service needs no delete permission, it is only waited
            # for); ours is created on a later pass.
            if kind == "Job":
                with contextlib.suppress(ApiException):
                    self.batch.delete_namespaced_job(
                        name, meta["namespace"], propagation_policy="Background"
                    )
            raise ChildConflict(f"{kind} {name} belongs to an earlier {meta['name']}; replacing it")
        return create_refusal(
            kind,
            f"{meta['namespace']}/{name}",
            409,
            f"the name is taken by an object not owned by TrainingJob {meta['name']}: delete "
            "or rename it",
            foreign=True,
        )

    def _job_events(self, job: dict[str, Any]) -> list[dict[str, Any]]:
        """The Job controller's Events on ``job`` (FailedCreate: its pods refused); none when
        they cannot be read (no permission: the status then just says pods are pending)."""
        meta = job["metadata"]
        try:
            data = self._json(
                self.core.list_namespaced_event(
                    meta["namespace"],
                    field_selector=f"involvedObject.uid={meta.get('uid', '')}",
                    _preload_content=False,
                )
            )
        except ApiException as exc:
            if exc.status in (403, 404):
                return []
            raise
        return list(data.get("items", []))

    def _stop_pods(self, pods: list[dict[str, Any]]) -> None:
        """Graceful delete: SIGTERM, the pod's grace period, then SIGKILL (JIT checkpoint)."""
        for pod in pods:
            if pod["metadata"].get("deletionTimestamp") or pod_finished(pod):
                continue
            try:
                self.core.delete_namespaced_pod(
                    pod["metadata"]["name"], pod["metadata"]["namespace"]
                )
            except ApiException as exc:
                if exc.status != 404:
                    raise

    def _release_pods(self, pods: list[dict[str, Any]]) -> int:
        """Remove the attempt-record finalizer with an atomic JSON patch (test + remove by
        index, so a finalizer another controller removes meanwhile is never re-added). On a
        conflict the pod is re-read and the patch retried. Returns how many still hold it."""
        left = 0
        for pod in pods:
            meta = pod["metadata"]
            uid = meta.get("uid", "")
            if uid in self._released:
                continue
            for _ in range(3):
                finalizers = meta.get("finalizers") or []
                if render.ATTEMPT_FINALIZER not in finalizers:
                    self._released.add(uid)
                    break
                i = finalizers.index(render.ATTEMPT_FINALIZER)
                patch = [
                    {
                        "op": "test",
                        "path": f"/metadata/finalizers/{i}",
                        "value": render.ATTEMPT_FINALIZER,
                    },
                    {"op": "remove", "path": f"/metadata/finalizers/{i}"},
                ]
                try:
                    self.core.patch_namespaced_pod(meta["name"], meta["namespace"], patch)
                    self._released.add(uid)
                    break
                except ApiException as exc:
                    if exc.status == 404:
                        self._released.add(uid)
                        break
                    if exc.status not in (409, 422):
                        raise
                try:
                    meta = self._json(
                        self.core.read_namespaced_pod(
                            meta["name"], meta["namespace"], _preload_content=False
                        )
                    )["metadata"]
                except ApiException as exc:
                    if exc.status == 404:
                        break
                    raise
            else:
                left += 1
        return left

    def _clean_up_later(
        self,
        namespace: str,
        name: str,
        pods: list[dict[str, Any]],
        jobs: list[dict[str, Any]],
    ) -> None:
        """Release ended attempts' pods and delete their ``jobs`` in the background, retried a
        few times; a later pass (the next attempt's creation, the job's finish) catches what
        still fails. Nothing is started while this TrainingJob's previous cleanup runs (it holds
        the same pods and Jobs), or when all of them were released and deleted already."""
        key = (namespace, name)
        with self._lock:
            pending = self._cleanups.get(key)
        if pending is not None and not pending.done():
            return
        pods = [p for p in pods if p["metadata"].get("uid", "") not in self._released]
        jobs = [j for j in jobs if j["metadata"].get("uid", "") not in self._deleted]
        if not pods and not jobs:
            return

        def run() -> None:
            for wait in (1.0, 2.0, 4.0, 0.0):
                try:
                    left = self._release_pods(pods)
                    for job in jobs:
                        self._delete_job(job)
                    if left == 0:
                        return
                    problem = f"{left} pod(s) still hold {render.ATTEMPT_FINALIZER}"
                except Exception as exc:
                    problem = str(getattr(exc, "reason", None) or exc)
                time.sleep(wait)
            log.warning("cleanup of %s/%s's ended attempt: %s", namespace, name, problem)

        future = self._cleanup_pool.submit(run)
        with self._lock:
            self._cleanups[key] = future

        def done(_: concurrent.futures.Future[None]) -> None:
            with self._lock:
                if self._cleanups.get(key) is future:
                    del self._cleanups[key]

        future.add_done_callback(done)

    def _delete_finished(self, obj: dict[str, Any], ttl: int) -> None:
        """spec.ttlSecondsAfterFinished passed: delete the TrainingJob (its Jobs, pods and
        Service follow by owner references). The uid precondition spares a new TrainingJob of
        the same name."""
        meta = obj["metadata"]
        message = f"finished more than ttlSecondsAfterFinished ({ttl} s) ago: deleting it"
        log.info("%s/%s: %s", meta["namespace"], meta["name"], message)
        self._event(obj, "Normal", Reason.TTL_EXPIRED, message)
        try:
            self.custom.delete_namespaced_custom_object(
                models.GROUP,
                models.VERSION,
                meta["namespace"],
                models.PLURAL,
                meta["name"],
                body=kubernetes.client.V1DeleteOptions(
                    propagation_policy="Background",
                    preconditions=kubernetes.client.V1Preconditions(uid=meta.get("uid")),
                ),
            )
        except ApiException as exc:
            if exc.status not in (404, 409):  # gone already, or another incarnation
                raise

    def _delete_job(self, job: dict[str, Any]) -> None:
        uid = job["metadata"].get("uid", "")
        if uid in self._deleted:
            return
        try:
            self.batch.delete_namespaced_job(
                job["metadata"]["name"],
                job["metadata"]["namespace"],
                propagation_policy="Background",
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
        self._deleted.add(uid)

    def _suspend_for_deactivation(self, obj: dict[str, Any], message: str) -> None:
        """Set the TrainingJob's spec.suspend: its Workload was deactivated by someone else,
        and only the user's spec.suspend: false may start a new one."""
        meta = obj["metadata"]
        try:
            self.custom.patch_namespaced_custom_object(
                models.GROUP,
                models.VERSION,
                meta["namespace"],
                models.PLURAL,
                meta["name"],
                {"spec": {"suspend": True}},
            )
        except ApiException as exc:
            if exc.status == 404:  # deleted meanwhile: nothing left to suspend
                return
            raise
        self._event(obj, "Warning", Reason.WORKLOAD_DEACTIVATED, message)

    def _deactivate_workload(
        self, namespace: str, workload: dict[str, Any] | None, version: str | None
    ) -> None:
        if workload is None or version is None:
            return
        if wl.ANNOTATION_SLICE in (workload["metadata"].get("annotations") or {}):
            return  # an elastic TrainingJob's own Workload requeues, never deactivated
        patch = deactivation_patch(workload)
        if patch is None:
            return
        try:
            self.custom.patch_namespaced_custom_object(
                KUEUE_GROUP,
                version,
                namespace,
                "workloads",
                workload["metadata"]["name"],
                patch,
            )
        except ApiException as exc:
            if exc.status != 404:
                raise

    def _update_priority_boost(
        self,
        obs: _Observed,
        spec: models.TrainingJobSpec,
        status: models.TrainingJobStatus,
        record: models.AttemptRecord | None,
    ) -> None:
        """Keep the running attempt's Workload's priority boost at what a preemption would cost
        now (victims.py): written only when it changes, at most at the progress-write budget."""
        workload, version = obs.workload, obs.workload_version
        if workload is None or version is None:
            return
        meta = workload["metadata"]
        key = (meta["namespace"], obs.obj["metadata"]["name"])
        with self._lock:
            last = self._boosted.get(key)
        now = time.monotonic()
        configured = self.config.priority_boost_max
        plan = plan_boost(
            workload,
            status,
            spec,
            record,
            self.clock(),
            class_values=lambda: self._class_values.values(version),
            configured=configured,
            last_write=last[1] if last is not None and last[0] == meta.get("uid") else None,
            monotonic_now=now,
            min_interval=self.periodic_intervals()[1],
        )
        if plan is None:
            return
        priority = (workload.get("spec") or {}).get("priority") or 0
        if plan.narrowed and (priority, configured, plan.band) not in self._narrowed:
            self._narrowed.add((priority, configured, plan.band))
            log.warning(
                "priority boost band for priority %s narrowed from %d to %d: the next higher "
                "priority class is %d above (a larger boost would lift the job level with it)",
                priority, configured, plan.band, plan.band + 1,
            )  # fmt: skip
        if not plan.write:
            return
        boost, cost, current = plan.boost, plan.cost, plan.current
        written = True
        try:
            self.custom.patch_namespaced_custom_object(
                KUEUE_GROUP,
                version,
                meta["namespace"],
                "workloads",
                meta["name"],
                boost_patch(boost),
            )
        except ApiException as exc:
            # Best effort: a boost not written (the Workload gone with its Job, a webhook or
            # RBAC refusal) leaves Kueue's own order, never the pass's work.
            if exc.status != 404:
                log.warning("%s/%s: priority boost not written: %s", *key, exc.reason)
            written = False
        with self._lock:  # written or tried: the next write waits for the budget interval
            self._boosted[key] = (meta.get("uid", ""), now)
        if not written:
            return
        log.info(
            "%s: priority boost %s -> %d (%.0f s; %s)",
            key[0] + "/" + key[1],
            current,
            boost,
            cost.seconds,
            cost.reason,
            extra={"tj": f"{key[0]}/{key[1]}", "priorityBoost": boost},
        )

    def _scrape_rank0(
        self, pods: list[dict[str, Any]], spec: models.TrainingJobSpec
    ) -> RuntimeMetrics | None:
        """Rank 0's /metrics (None: no running rank 0 with an address); an unanswered scrape
        says when it was asked (the upper bound of a lost node's training, accounting.py)."""
        for pod in pods:
            ann = pod["metadata"].get("annotations") or {}
            if ann.get(render.JOB_COMPLETION_INDEX_ANNOTATION, "0") != "0":
                continue
            ip = (pod.get("status") or {}).get("podIP")
            if ip and (pod.get("status") or {}).get("phase") == "Running":
                asked_at = time.time()
                got = scrape(ip, spec.metrics_port, timeout=self.config.scrape_timeout)
                return got if got is not None else RuntimeMetrics.unanswered(asked_at)
        return None

    # ------------------------------------------------------------------------------ writing
    def _write_status(
        self, obj: dict[str, Any], status: dict[str, Any], based_on: dict[str, Any]
    ) -> bool:
        """PUT the status with the resourceVersion the pass read. On a conflict the object is
        read again: when only its metadata moved (kopf's finalizer, labels, annotations) and
        its spec generation and status are still what the pass decided on, the write is
        retried once with the new version; otherwise (or on 404) False: the pass is redone."""
        meta = obj["metadata"]
        try:
            written = self._put_status(obj, status)
        except ApiException as exc:
            if exc.status != 409:
                if exc.status == 404:
                    return False
                raise
            fresh = self._get_tj(meta["namespace"], meta["name"])
            if (
                fresh is None
                or fresh["metadata"].get("uid") != meta.get("uid")
                or fresh["metadata"].get("generation") != meta.get("generation")
                or models.TrainingJobStatus.model_validate(fresh.get("status") or {}).to_k8s()
                != based_on
            ):
                return False
            try:
                written = self._put_status(fresh, status)
            except ApiException as exc2:
                if exc2.status in (404, 409):
                    return False
                raise
            superseded = (meta["resourceVersion"], fresh["metadata"]["resourceVersion"])
        else:
            superseded = (meta["resourceVersion"],)
        (written.get("metadata") or {}).pop("managedFields", None)  # held until the cache has it
        with self._lock:
            self._written[(meta["namespace"], meta["name"])] = (superseded, written)
        return True

    def _put_status(self, obj: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        body = {
            "apiVersion": models.API_VERSION,
            "kind": models.KIND,
            "metadata": {
                "name": meta["name"],
                "namespace": meta["namespace"],
                "resourceVersion": meta["resourceVersion"],
            },
            "spec": obj.get("spec"),
            "status": status,
        }
        return self._json(
            self.custom.replace_namespaced_custom_object_status(
                models.GROUP,
                models.VERSION,
                meta["namespace"],
                models.PLURAL,
                meta["name"],
                body,
                _preload_content=False,
            )
        )

    def _event(self, obj: dict[str, Any], etype: str, reason: str, message: str) -> None:
        meta = obj["metadata"]
        ts = dt.datetime.now(dt.UTC)
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": f"{meta['name']}.{uuid.uuid4().hex[:16]}",
                "namespace": meta["namespace"],
            },
            "involvedObject": {
                "apiVersion": models.API_VERSION,
                "kind": models.KIND,
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta["uid"],
            },
            "type": etype,
            "reason": reason,
            "message": message[:1024],
            "firstTimestamp": ts.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "lastTimestamp": ts.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "count": 1,
            "source": {"component": self.config.component},
            "reportingComponent": self.config.component,
        }
        self._event_pool.submit(self._post_event, meta["namespace"], body)
        log.info(
            "event %s %s: %s",
            etype,
            reason,
            message,
            extra={
                "tj": f"{meta['namespace']}/{meta['name']}",
                "type": etype,
                "reason": reason,
                "detail": message,
            },
        )

    def _post_event(self, namespace: str, body: dict[str, Any]) -> None:
        try:
            self.core.create_namespaced_event(namespace, body)
        except Exception as exc:  # events are best effort
            log.warning("event not posted: %s", getattr(exc, "reason", exc))


# ---------------------------------------------------------------------------------- helpers
class _Recent:
    """A bounded set of uids (the oldest are forgotten first): what was done recently."""

    def __init__(self, size: int = 20_000) -> None:
        self._items: OrderedDict[str, None] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def add(self, uid: str) -> None:
        if not uid:
            return
        with self._lock:
            self._items[uid] = None
            self._items.move_to_end(uid)
            while len(self._items) > self._size:
                self._items.popitem(last=False)

    def __contains__(self, uid: object) -> bool:
        with self._lock:
            return uid in self._items


class ChildConflict(RuntimeError):
    """A child's name is taken by an object this TrainingJob does not own (retried later)."""


_HTTP_VERBS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})


def _default_request_timeout(api_client: Any, timeout: tuple[float, float]) -> None:
    """Give every request of ``api_client`` a (connect, read) timeout unless one is passed:
    the generated API classes pass ``_request_timeout=None`` (wait forever) by default."""
    call_api = api_client.call_api
    if getattr(call_api, "_preemptible_timeout", None) is not None:
        return

    def with_timeout(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("_request_timeout") is None:
            kwargs["_request_timeout"] = timeout
        verb = next((a for a in args[:2] if a in _HTTP_VERBS), kwargs.get("method", "other"))
        metrics.API_REQUESTS.labels(verb if verb in _HTTP_VERBS else "other").inc()
        return call_api(*args, **kwargs)

    with_timeout._preemptible_timeout = timeout  # type: ignore[attr-defined]
    api_client.call_api = with_timeout


_PROGRESS_KEYS = ("progress", "timings", "lastCompleteCheckpoint", "gracePeriod")


def _progress_only(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether two statuses differ only in what the runtime's /metrics refresh every pass."""
    strip = lambda d: {k: v for k, v in d.items() if k not in _PROGRESS_KEYS}  # noqa: E731
    return strip(old) == strip(new)


def jittered(seconds: float, spread: float = 0.2) -> float:
    """``seconds`` +- ``spread`` (fraction), so periodic passes of many jobs spread out."""
    return seconds * (1.0 + random.uniform(-spread, spread))


def _refusal(kind: str, name: str, exc: ApiException) -> Refusal | None:
    """The apiserver's refusal to create a child, when it is one that a retry cannot fix soon."""
    return create_refusal(kind, name, exc.status, api_message(exc.body, str(exc.reason or exc)))
