"""One level-triggered reconcile pass of a TrainingJob.

Reads the TrainingJob and its children (attempt Jobs, their pods, the Kueue Workload, nodes),
calls the pure decision functions, performs at most one action, writes the status once and then
releases what the status now records (pod finalizers, the finished Job). Every step is idempotent,
so an operator restarted at any moment converges to the same state without duplicate Jobs.
Only the official Kubernetes client is used.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import kubernetes
from kubernetes.client.rest import ApiException
from pydantic import ValidationError

from preemptible_operator import conditions as cond
from preemptible_operator import metrics, models, render
from preemptible_operator.checkpoint_store import CheckpointView, PathMap
from preemptible_operator.classify import (
    ContainerEnd,
    Interruption,
    classify_interruption,
    container_end,
    pod_finished,
)
from preemptible_operator.conditions import Reason
from preemptible_operator.grace import grace_sufficiency, next_grace
from preemptible_operator.interval import auto_save_interval, interval_status
from preemptible_operator.phases import PhaseInputs, backoff_seconds, next_phase
from preemptible_operator.resume import resume_checkpoint
from preemptible_operator.scrape import RuntimeMetrics, scrape

__all__ = ["OperatorConfig", "PassResult", "Reconciler", "now_rfc3339"]

log = logging.getLogger("preemptible_operator")

KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSIONS = ("v1beta2", "v1beta1")
KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


@dataclass
class OperatorConfig:
    """Operator-wide settings (CLI flags)."""

    path_map: PathMap = field(default_factory=PathMap)
    scrape_metrics: bool = True
    scrape_timeout: float = 2.0
    poll_interval: float = 5.0
    """Seconds between passes while an attempt runs (metrics scraping, safety net)."""
    component: str = "preemptible-operator"


@dataclass
class PassResult:
    """What a pass did; ``requeue_after`` None means nothing to do until something changes."""

    phase: str | None = None
    action: str = "none"
    requeue_after: float | None = None
    events: list[tuple[str, str, str]] = field(default_factory=list)


@dataclass
class _Observed:
    obj: dict[str, Any]
    status: models.TrainingJobStatus
    spec: models.TrainingJobSpec | None
    invalid: str | None
    jobs: dict[int, dict[str, Any]]
    pods_by_attempt: dict[int, list[dict[str, Any]]]
    attempt: int
    job: dict[str, Any] | None
    pods: list[dict[str, Any]]
    workload: dict[str, Any] | None
    workload_version: str | None
    node_ready: dict[str, bool]


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

    # ------------------------------------------------------------------------------ reading
    @staticmethod
    def _json(resp: Any) -> dict[str, Any]:
        return json.loads(resp.data)

    def _get_tj(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._json(
                self.custom.get_namespaced_custom_object(
                    models.GROUP,
                    models.VERSION,
                    namespace,
                    models.PLURAL,
                    name,
                    _preload_content=False,
                )
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _list_jobs(self, namespace: str, name: str) -> dict[int, dict[str, Any]]:
        data = self._json(
            self.batch.list_namespaced_job(
                namespace,
                label_selector=f"{render.LABEL_TRAINING_JOB}={name}",
                _preload_content=False,
            )
        )
        jobs: dict[int, dict[str, Any]] = {}
        for job in data.get("items", []):
            raw = (job["metadata"].get("labels") or {}).get(render.LABEL_ATTEMPT, "")
            if raw.isdigit():
                jobs[int(raw)] = job
        return jobs

    def _list_pods(self, namespace: str, name: str) -> dict[int, list[dict[str, Any]]]:
        data = self._json(
            self.core.list_namespaced_pod(
                namespace,
                label_selector=f"{render.LABEL_TRAINING_JOB}={name}",
                _preload_content=False,
            )
        )
        pods: dict[int, list[dict[str, Any]]] = {}
        for pod in data.get("items", []):
            raw = (pod["metadata"].get("labels") or {}).get(render.LABEL_ATTEMPT, "")
            if raw.isdigit():
                pods.setdefault(int(raw), []).append(pod)
        return pods

    def _get_workload(
        self, namespace: str, job: dict[str, Any] | None
    ) -> tuple[dict[str, Any] | None, str | None]:
        if job is None:
            return None, None
        uid = job["metadata"]["uid"]
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

    def _node_ready(self, pods: list[dict[str, Any]]) -> dict[str, bool]:
        ready: dict[str, bool] = {}
        for node_name in {(p.get("spec") or {}).get("nodeName") for p in pods} - {None}:
            try:
                node = self._json(self.core.read_node(node_name, _preload_content=False))
            except ApiException as exc:
                if exc.status == 404:
                    ready[node_name] = False
                    continue
                if exc.status == 403:  # no permission: do not guess node loss
                    ready[node_name] = True
                    continue
                raise
            conds = (node.get("status") or {}).get("conditions") or []
            ready[node_name] = any(
                c.get("type") == "Ready" and c.get("status") == "True" for c in conds
            )
        return ready

    def _observe(self, namespace: str, name: str) -> _Observed | None:
        obj = self._get_tj(namespace, name)
        if obj is None:
            return None
        status = models.TrainingJobStatus.model_validate(obj.get("status") or {})
        spec: models.TrainingJobSpec | None = None
        invalid = render.validate_name(name)
        try:
            spec = models.parse_spec(obj.get("spec"))
        except ValidationError as exc:
            invalid = models.format_validation_error(exc)
        jobs = self._list_jobs(namespace, name)
        pods = self._list_pods(namespace, name)
        attempt = max([status.attempt or 0, *jobs.keys()])
        job = jobs.get(attempt)
        workload, version = (None, None)
        if spec is not None and spec.queue_name:
            workload, version = self._get_workload(namespace, job)
        current_pods = pods.get(attempt, [])
        return _Observed(
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
            node_ready=self._node_ready(current_pods),
        )

    # ------------------------------------------------------------------------------ the pass
    def reconcile(self, namespace: str, name: str) -> PassResult:
        t0 = time.monotonic()
        try:
            return self._reconcile(namespace, name)
        except Exception:
            metrics.RECONCILE_ERRORS.inc()
            raise
        finally:
            metrics.RECONCILE_SECONDS.observe(time.monotonic() - t0)

    def _reconcile(self, namespace: str, name: str) -> PassResult:
        obs = self._observe(namespace, name)
        if obs is None:
            return PassResult()
        now = now_rfc3339()
        old_status = obs.status.to_k8s()
        status = obs.status.model_copy(deep=True)
        result = PassResult()
        after_status: list[Callable[[], None]] = []
        spec = obs.spec
        generation = obs.obj["metadata"].get("generation")

        record = _find_record(status, obs.attempt)
        if obs.attempt and record is None and obs.job is not None:
            # The Job exists but the pass that created it crashed before writing status.
            record = _record_from_job(obs.job, obs.attempt)
            status.attempts = [*(status.attempts or []), record]
            status.next_attempt_after = None
            gp = status.grace_period or models.GraceStatus()
            gp.current = record.grace_seconds
            status.grace_period = gp
        status.attempt = obs.attempt or status.attempt

        storage_view = CheckpointView(spec.checkpoint.uri, self.config.path_map) if spec else None
        snapshot = storage_view.snapshot() if storage_view is not None else None
        if storage_view is not None:
            status.checkpoint_storage_readable = storage_view.readable
        if snapshot is not None:
            _apply_snapshot(status, snapshot)

        recorded = record is not None and record.end_time is not None
        interruption = Interruption("Active", Reason.STARTED)
        running = [p for p in obs.pods if (p.get("status") or {}).get("phase") == "Running"]
        if spec is not None and obs.attempt and not recorded:
            if running and record is not None and record.running_time is None:
                record.running_time = now
            if running and self.config.scrape_metrics:
                _apply_metrics(status, self._scrape_rank0(obs.pods, spec), spec)
            interruption = classify_interruption(
                obs.job,
                obs.pods,
                obs.workload,
                node_ready=obs.node_ready,
                was_admitted=record is not None and record.running_time is not None,
                user_suspended=spec.suspend,
            )
            if obs.job is None and obs.pods and not interruption.over:
                interruption = Interruption(
                    "Preempted",
                    Reason.KUEUE_EVICTED if spec.queue_name else Reason.JOB_FAILED,
                    "the attempt's Job was deleted",
                )

        backoff_remaining = 0.0
        next_after = _parse_time(status.next_attempt_after)
        if next_after is not None:
            backoff_remaining = max(0.0, next_after - self.clock())
        decision = next_phase(
            PhaseInputs(
                invalid=obs.invalid is not None,
                current_phase=status.phase,
                suspend=bool(spec and spec.suspend),
                attempt=obs.attempt,
                recorded_outcome=record.outcome if recorded and record else None,
                job_exists=obs.job is not None,
                job_suspended=bool(obs.job and (obs.job.get("spec") or {}).get("suspend")),
                interruption=interruption,
                pods_finished=all(pod_finished(p, obs.node_ready) for p in obs.pods),
                pods=len(obs.pods),
                running_pods=len(running),
                failures=status.failures or 0,
                max_restarts=spec.max_restarts if spec else 0,
                backoff_remaining=backoff_remaining,
                kueue=bool(spec and spec.queue_name),
            )
        )
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

        # ------------------------------------------------------------------ act
        if decision.action == "fail_invalid":
            status.message = obs.invalid
            status.conditions = cond.set_condition(
                status.conditions,
                cond.FAILED,
                "True",
                Reason.INVALID_SPEC,
                obs.invalid or "",
                now,
                generation,
            )
            status.completion_time = status.completion_time or now
            result.events.append(("Warning", Reason.INVALID_SPEC, obs.invalid or ""))
            if obs.job is not None and not recorded:
                self._stop_pods(obs.pods)
        elif decision.action == "create_attempt" and spec is not None:
            self._create_attempt(obs, spec, status, record, recorded, decision.reason, now, result)
        elif decision.action == "stop_attempt":
            self._stop_pods(obs.pods)
        elif decision.action == "deactivate_workload":
            self._deactivate_workload(namespace, obs.workload, obs.workload_version)
        elif decision.action == "record_attempt" and spec is not None and record is not None:
            if interruption.reason in (Reason.KUEUE_PREEMPTED, Reason.KUEUE_EVICTED):
                self._deactivate_workload(namespace, obs.workload, obs.workload_version)
            self._record_attempt(obs, spec, status, record, interruption, storage_view, now, result)
            pods, job = list(obs.pods), obs.job
            after_status.append(lambda: self._release_pods(pods))
            if interruption.outcome != "Succeeded" and job is not None:
                after_status.append(lambda: self._delete_job(job))
            result.requeue_after = 0.2
        elif decision.action in ("finish", "cleanup"):
            leftovers = [p for pods in obs.pods_by_attempt.values() for p in pods]
            held = [
                p
                for p in leftovers
                if render.ATTEMPT_FINALIZER in (p["metadata"].get("finalizers") or [])
            ]
            if held:
                after_status.append(lambda: self._release_pods(held))
                result.requeue_after = 1.0  # confirm they were released
            if decision.action == "finish" and status.phase not in ("Succeeded", "Failed"):
                status.completion_time = status.completion_time or now
                if decision.reason == Reason.RESTARTS_EXHAUSTED:
                    status.conditions = cond.set_condition(
                        status.conditions,
                        cond.FAILED,
                        "True",
                        Reason.RESTARTS_EXHAUSTED,
                        decision.message,
                        now,
                        generation,
                    )
                    result.events.append(("Warning", Reason.RESTARTS_EXHAUSTED, decision.message))
        elif decision.action == "wait_backoff":
            result.requeue_after = max(0.5, backoff_remaining)

        # ------------------------------------------------------------------ status
        new_phase = decision.phase
        if decision.action == "create_attempt" and status.phase != new_phase:
            new_phase = "Queued" if spec and spec.queue_name else "Pending"
        _set_phase_conditions(status, new_phase, decision, record, now, generation)
        if spec is not None:
            self._update_grace(status, spec, obs, now, generation, result)
            status.checkpoint_interval, interval_event = interval_status(status, spec, self.clock())
            if interval_event:
                result.events.append(("Normal", Reason.CHECKPOINT_INTERVAL, interval_event))
        if status.phase != new_phase and decision.action != "create_attempt":
            etype = "Warning" if new_phase == "Failed" else "Normal"
            msg = decision.message or f"phase {status.phase or '-'} -> {new_phase}"
            if not any(e[1] == decision.reason for e in result.events):
                result.events.append((etype, decision.reason, msg))
        status.phase = new_phase
        if decision.message and new_phase not in ("Succeeded",):
            status.message = decision.message if decision.action != "fail_invalid" else obs.invalid
        elif new_phase == "Succeeded":
            status.message = "training finished"
        elif new_phase == "Running":
            status.message = None
        status.observed_generation = generation
        new_status = status.to_k8s()
        if new_status != old_status and not self._write_status(obs.obj, new_status):
            result.requeue_after = 0.5
            return result  # conflict: the next pass re-reads and redoes this one
        for event in result.events:
            self._event(obs.obj, *event)
        for fn in after_status:
            fn()

        if result.requeue_after is None and new_phase not in ("Succeeded", "Failed", "Suspended"):
            result.requeue_after = self.config.poll_interval
        return result

    def release_all(self, namespace: str, name: str) -> None:
        """The TrainingJob is being deleted: let garbage collection remove its pods."""
        for pods in self._list_pods(namespace, name).values():
            self._release_pods(pods)

    def release_orphan_pod(self, pod: dict[str, Any]) -> None:
        """Release a deleted pod whose TrainingJob no longer exists."""
        meta = pod.get("metadata") or {}
        tj = (meta.get("labels") or {}).get(render.LABEL_TRAINING_JOB)
        if tj and self._get_tj(meta["namespace"], tj) is None:
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
        result: PassResult,
    ) -> None:
        meta = obs.obj["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        attempt = obs.attempt + 1 if (recorded or obs.attempt == 0) else obs.attempt
        # The previous attempt must be gone for good before the next one may write checkpoints.
        for n, job in obs.jobs.items():
            if n < attempt and job["metadata"].get("deletionTimestamp") is None:
                prev_record = _find_record(status, n)
                if prev_record is None or prev_record.outcome != "Succeeded":
                    self._delete_job(job)
        self._release_pods([p for n, ps in obs.pods_by_attempt.items() if n < attempt for p in ps])

        last = (status.attempts or [])[-1] if status.attempts else None
        killed_grace = last.grace_seconds if last is not None and last.killed else None
        decision = next_grace(spec.grace_period, status.timings, killed_grace)
        view = CheckpointView(spec.checkpoint.uri, self.config.path_map)
        choice = resume_checkpoint(
            attempt,
            view.readable,
            status.last_complete_checkpoint if view.readable else None,
            status.last_complete_checkpoint,
        )
        params = render.AttemptParams(
            attempt=attempt,
            grace_seconds=decision.seconds,
            resume_from=choice.resume_from,
            suspended=bool(spec.queue_name),
            start_step=choice.step,
            save_interval_seconds=auto_save_interval(spec, status),
        )
        self._ensure_service(meta, spec)
        job_body = render.render_job(meta, spec, params)
        try:
            self.batch.create_namespaced_job(namespace, job_body)
            created = True
        except ApiException as exc:
            if exc.status != 409:
                raise
            created = False
            existing = self._json(
                self.batch.read_namespaced_job(
                    job_body["metadata"]["name"], namespace, _preload_content=False
                )
            )
            ann = existing["metadata"].get("annotations") or {}
            params = render.AttemptParams(
                attempt=attempt,
                grace_seconds=int(ann.get(render.ANNOTATION_GRACE, decision.seconds)),
                resume_from=ann.get(render.ANNOTATION_RESUME_FROM, choice.resume_from),
                suspended=params.suspended,
                start_step=_int_or_none(ann.get(render.ANNOTATION_START_STEP)),
            )
        if _find_record(status, attempt) is None:
            status.attempts = [
                *(status.attempts or []),
                models.AttemptRecord(
                    attempt=attempt,
                    job_name=render.job_name(name, attempt),
                    start_time=now,
                    start_step=params.start_step,
                    resume_from=params.resume_from,
                    grace_seconds=params.grace_seconds,
                ),
            ]
        status.attempt = attempt
        status.start_time = status.start_time or now
        status.next_attempt_after = None
        gp = status.grace_period or models.GraceStatus()
        gp.current = params.grace_seconds
        status.grace_period = gp
        metrics.GRACE_SECONDS.labels(namespace, name).set(params.grace_seconds)
        if created:
            # Posted now: the Job exists whatever happens to this pass's status write.
            if last is not None and last.end_time:
                ended = _parse_time(last.end_time)
                if ended is not None:
                    metrics.REQUEUE_SECONDS.observe(max(0.0, self.clock() - ended))
            self._event(
                obs.obj,
                "Normal",
                reason,
                f"attempt {attempt}: Job {render.job_name(name, attempt)}, grace "
                f"{params.grace_seconds} s ({decision.reason}), resume from "
                f"{params.resume_from or 'scratch'!r}",
            )

    def _record_attempt(
        self,
        obs: _Observed,
        spec: models.TrainingJobSpec,
        status: models.TrainingJobStatus,
        record: models.AttemptRecord,
        interruption: Interruption,
        view: CheckpointView | None,
        now: str,
        result: PassResult,
    ) -> None:
        meta = obs.obj["metadata"]
        ends: list[ContainerEnd] = [e for e in (container_end(p) for p in obs.pods) if e]
        ends.sort(key=lambda e: (e.index is None, e.index or 0))
        messages = [e.message for e in ends if e.message is not None]
        rank0 = next((e for e in ends if e.index == 0 and e.message is not None), None)
        timings = status.timings or models.Timings()
        for msg in messages:
            timings.step_seconds_max = _max(timings.step_seconds_max, msg.step_seconds.max)
            timings.step_seconds_p99 = msg.step_seconds.p99 or timings.step_seconds_p99
            timings.step_seconds_ema = msg.step_seconds.ema or timings.step_seconds_ema
            timings.save_seconds_max = _max(timings.save_seconds_max, msg.save_seconds.max)
            timings.save_seconds_last = msg.save_seconds.last or timings.save_seconds_last
            timings.sigterm_to_exit_seconds_max = _max(
                timings.sigterm_to_exit_seconds_max, msg.sigterm_to_exit_seconds
            )
            if msg.micro_batch_seconds is not None:
                timings.micro_batch_seconds_max = _max(
                    timings.micro_batch_seconds_max, msg.micro_batch_seconds.max
                )
        killed = any(e.killed for e in ends)
        if killed and interruption.outcome != "Succeeded" and record.grace_seconds:
            # It needed more than its grace: a lower bound of the true SIGTERM-to-exit time.
            timings.sigterm_to_exit_seconds_max = _max(
                timings.sigterm_to_exit_seconds_max, float(record.grace_seconds)
            )
        status.timings = timings

        end_steps = [m.step for m in messages]
        progress_step = status.progress.step if status.progress else None
        end_step = max(
            [*end_steps, *([progress_step] if progress_step is not None else [])], default=None
        )
        if not (view and view.readable):
            # Without storage access, trust the runtime's report of a complete checkpoint.
            for msg in sorted(messages, key=lambda m: m.step):
                if msg.checkpoint and msg.complete:
                    current = status.last_complete_checkpoint
                    if current is None or msg.step >= current.step:
                        status.last_complete_checkpoint = models.CheckpointRef(
                            step=msg.step,
                            path=_pod_checkpoint_path(spec, msg.checkpoint),
                            completed_at=now,
                            save_seconds=msg.save_seconds.last,
                        )
        ckpt = status.last_complete_checkpoint
        lost = 0
        if interruption.outcome != "Succeeded" and end_step is not None:
            lost = max(0, end_step - (ckpt.step if ckpt else 0))
        outcome = interruption.outcome if interruption.outcome != "Active" else "Failed"
        record.end_time = now
        record.reason = interruption.reason
        record.message = interruption.message or None
        record.outcome = outcome  # type: ignore[assignment]
        record.end_step = end_step
        record.checkpoint = ckpt.path if ckpt else None
        record.exit_codes = [e.exit_code for e in ends if e.exit_code is not None] or None
        record.killed = killed
        record.lost_steps = lost
        sigterm = rank0.message.sigterm_to_exit_seconds if rank0 and rank0.message else None
        if sigterm is None:
            sigterm = _max(None, *(m.sigterm_to_exit_seconds for m in messages))
        record.sigterm_to_exit_seconds = sigterm
        if end_step is not None:
            progress = status.progress or models.Progress()
            progress.step = max(progress.step or 0, end_step)
            status.progress = progress
        status.lost_steps = (status.lost_steps or 0) + lost
        if lost:
            metrics.LOST_STEPS.labels(meta["namespace"], meta["name"]).inc(lost)
            result.events.append(
                (
                    "Warning",
                    Reason.LOST_STEPS,
                    f"attempt {record.attempt} reached step {end_step} but the newest complete "
                    f"checkpoint is step {ckpt.step if ckpt else 0}: {lost} steps lost"
                    + (
                        f" (SIGKILLed at the {record.grace_seconds} s grace deadline)"
                        if killed
                        else ""
                    ),
                )
            )
        generation = obs.obj["metadata"].get("generation")
        if outcome == "Preempted":
            status.preemptions = (status.preemptions or 0) + 1
            metrics.PREEMPTIONS.labels(interruption.reason).inc()
            status.conditions = cond.set_condition(
                status.conditions,
                cond.PREEMPTED,
                "True",
                interruption.reason,
                f"attempt {record.attempt}: {interruption.message}",
                now,
                generation,
            )
        elif outcome == "Failed":
            status.failures = (status.failures or 0) + 1
            delay = backoff_seconds(spec.restart_backoff_seconds, status.failures)
            status.next_attempt_after = _rfc3339(self.clock() + delay)
            if status.failures <= spec.max_restarts:
                result.events.append(
                    (
                        "Normal",
                        Reason.BACKOFF,
                        f"restart {status.failures} of {spec.max_restarts} in {delay} s",
                    )
                )
        shown_sigterm = "-" if sigterm is None else f"{sigterm:.2f}"
        result.events.append(
            (
                "Warning" if outcome == "Failed" else "Normal",
                interruption.reason,
                f"attempt {record.attempt} ended ({outcome}): {interruption.message}; step "
                f"{end_step}, checkpoint {record.checkpoint}, SIGTERM->exit {shown_sigterm} s, "
                f"grace {record.grace_seconds} s",
            )
        )

    def _ensure_service(self, meta: dict[str, Any], spec: models.TrainingJobSpec) -> None:
        body = render.render_service(meta, spec)
        try:
            self.core.create_namespaced_service(meta["namespace"], body)
        except ApiException as exc:
            if exc.status != 409:
                raise

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
            for _ in range(3):
                finalizers = meta.get("finalizers") or []
                if render.ATTEMPT_FINALIZER not in finalizers:
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
                    break
                except ApiException as exc:
                    if exc.status == 404:
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

    def _delete_job(self, job: dict[str, Any]) -> None:
        try:
            self.batch.delete_namespaced_job(
                job["metadata"]["name"],
                job["metadata"]["namespace"],
                propagation_policy="Background",
            )
        except ApiException as exc:
            if exc.status != 404:
                raise

    def _deactivate_workload(
        self, namespace: str, workload: dict[str, Any] | None, version: str | None
    ) -> None:
        if workload is None or version is None:
            return
        if (workload.get("spec") or {}).get("active") is False:
            return
        try:
            self.custom.patch_namespaced_custom_object(
                KUEUE_GROUP,
                version,
                namespace,
                "workloads",
                workload["metadata"]["name"],
                {"spec": {"active": False}},
            )
        except ApiException as exc:
            if exc.status != 404:
                raise

    def _scrape_rank0(
        self, pods: list[dict[str, Any]], spec: models.TrainingJobSpec
    ) -> RuntimeMetrics | None:
        for pod in pods:
            ann = pod["metadata"].get("annotations") or {}
            if ann.get(render.JOB_COMPLETION_INDEX_ANNOTATION, "0") != "0":
                continue
            ip = (pod.get("status") or {}).get("podIP")
            if ip and (pod.get("status") or {}).get("phase") == "Running":
                return scrape(ip, spec.metrics_port, timeout=self.config.scrape_timeout)
        return None

    def _update_grace(
        self,
        status: models.TrainingJobStatus,
        spec: models.TrainingJobSpec,
        obs: _Observed,
        now: str,
        generation: int | None,
        result: PassResult,
    ) -> None:
        last = (status.attempts or [])[-1] if status.attempts else None
        killed_grace = last.grace_seconds if last and last.killed and last.end_time else None
        decision = next_grace(spec.grace_period, status.timings, killed_grace)
        gp = status.grace_period or models.GraceStatus()
        gp.recommended = decision.seconds
        gp.reason = decision.reason
        gp.inputs = decision.inputs or None
        status.grace_period = gp
        meta = obs.obj["metadata"]
        metrics.GRACE_SECONDS.labels(meta["namespace"], meta["name"]).set(decision.seconds)
        current = gp.current
        if last is not None and last.end_time is None:
            ok, message = grace_sufficiency(current, decision)
            reason = Reason.GRACE_SUFFICIENT if ok else Reason.GRACE_TOO_SHORT
        elif last is not None and last.reason == Reason.DEADLINE_TOO_SHORT:
            ok, reason = False, Reason.DEADLINE_TOO_SHORT
            message = (
                f"attempt {last.attempt} did not start its JIT save: it could not finish before "
                f"the deadline ({last.message}); the grace is not raised past what the node "
                "gives: save more often (status.checkpointInterval, spec.checkpoint.interval: auto)"
            )
        elif last is not None and last.killed:
            ok, reason = False, Reason.GRACE_KILLED
            message = (
                f"attempt {last.attempt} was SIGKILLed at its {last.grace_seconds} s grace "
                f"deadline; the next attempt gets {decision.seconds} s"
            )
        else:
            ok, message = grace_sufficiency(current, decision)
            reason = Reason.GRACE_SUFFICIENT if ok else Reason.GRACE_TOO_SHORT
        if decision.required is None and ok:
            reason = Reason.NOT_MEASURED
        before = cond.find_condition(status.conditions, cond.GRACE_PERIOD_SUFFICIENT)
        status.conditions = cond.set_condition(
            status.conditions,
            cond.GRACE_PERIOD_SUFFICIENT,
            "True" if ok else "False",
            reason,
            message,
            now,
            generation,
        )
        if not ok and (before is None or before.status != "False" or before.reason != reason):
            result.events.append(("Warning", reason, message))

    # ------------------------------------------------------------------------------ writing
    def _write_status(self, obj: dict[str, Any], status: dict[str, Any]) -> bool:
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
        try:
            self.custom.replace_namespaced_custom_object_status(
                models.GROUP, models.VERSION, meta["namespace"], models.PLURAL, meta["name"], body
            )
        except ApiException as exc:
            if exc.status in (404, 409):
                return False
            raise
        return True

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
        try:
            self.core.create_namespaced_event(meta["namespace"], body)
        except ApiException as exc:  # events are best effort
            log.warning("event not posted: %s", exc.reason)
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


# ---------------------------------------------------------------------------------- helpers
def _rfc3339(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _max(*values: float | None) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _find_record(status: models.TrainingJobStatus, attempt: int) -> models.AttemptRecord | None:
    for rec in status.attempts or []:
        if rec.attempt == attempt:
            return rec
    return None


def _record_from_job(job: dict[str, Any], attempt: int) -> models.AttemptRecord:
    ann = job["metadata"].get("annotations") or {}
    return models.AttemptRecord(
        attempt=attempt,
        job_name=job["metadata"]["name"],
        start_time=job["metadata"].get("creationTimestamp"),
        resume_from=ann.get(render.ANNOTATION_RESUME_FROM),
        start_step=_int_or_none(ann.get(render.ANNOTATION_START_STEP)),
        grace_seconds=_int_or_none(ann.get(render.ANNOTATION_GRACE)),
    )


def _int_or_none(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


def _pod_checkpoint_path(spec: models.TrainingJobSpec, reported: str) -> str:
    """The runtime reports the path it wrote; keep it when it is under the URI, else join."""
    uri = spec.checkpoint.uri.rstrip("/")
    if reported.startswith(uri) or "/" in reported:
        return reported
    return f"{uri}/{reported}"


def _apply_snapshot(status: models.TrainingJobStatus, snapshot: Any) -> None:
    latest = snapshot.latest_complete
    if latest is not None:
        status.last_complete_checkpoint = models.CheckpointRef(
            step=latest.step,
            path=snapshot.latest_complete_path,
            completed_at=latest.created_at,
            save_seconds=latest.save_seconds,
        )
        timings = status.timings or models.Timings()
        if latest.save_seconds is not None:
            timings.save_seconds_max = _max(timings.save_seconds_max, latest.save_seconds)
            status.timings = timings
    status.incomplete_checkpoints = [
        models.IncompleteCheckpoint(step=info.step, path=path, reason=info.reason)
        for info, path in snapshot.incomplete
    ] or None


def _apply_metrics(
    status: models.TrainingJobStatus, m: RuntimeMetrics | None, spec: models.TrainingJobSpec
) -> None:
    if m is None:
        return
    progress = status.progress or models.Progress()
    if m.int("step") is not None:
        progress.step = m.int("step")
    if m.int("max_steps"):
        progress.max_steps = m.int("max_steps")
    if m.get("epoch") is not None:
        progress.epoch = round(m.get("epoch") or 0.0, 4)
    status.progress = progress
    t = status.timings or models.Timings()

    def measured(key: str) -> float | None:
        value = m.get(key)  # the runtime exports 0 before its first step / save
        return value if value is not None and value > 0 else None

    t.step_seconds_max = _max(t.step_seconds_max, measured("step_seconds_max"))
    t.step_seconds_p99 = measured("step_seconds_p99") or t.step_seconds_p99
    t.step_seconds_ema = measured("step_seconds_ema") or t.step_seconds_ema
    t.save_seconds_max = _max(t.save_seconds_max, measured("save_seconds_max"))
    t.save_seconds_last = measured("save_seconds_last") or t.save_seconds_last
    t.micro_batch_seconds_max = _max(t.micro_batch_seconds_max, measured("micro_batch_seconds_max"))
    status.timings = t
    ckpt_step = m.int("last_complete_checkpoint_step")
    if status.checkpoint_storage_readable is not True and ckpt_step is not None and ckpt_step > 0:
        current = status.last_complete_checkpoint
        if current is None or ckpt_step > current.step:
            status.last_complete_checkpoint = models.CheckpointRef(
                step=ckpt_step,
                path=f"{spec.checkpoint.uri.rstrip('/')}/checkpoint-{ckpt_step}",
            )


def _set_phase_conditions(
    status: models.TrainingJobStatus,
    phase: str,
    decision: Any,
    record: models.AttemptRecord | None,
    now: str,
    generation: int | None,
) -> None:
    c = status.conditions
    msg = decision.message or ""
    admitted = phase in ("Running", "Checkpointing", "Succeeded")
    if phase == "Queued":
        c = cond.set_condition(c, cond.ADMITTED, "False", Reason.QUEUED, msg, now, generation)
    elif admitted:
        c = cond.set_condition(c, cond.ADMITTED, "True", Reason.ADMITTED, "", now, generation)
    c = cond.set_condition(
        c,
        cond.RUNNING,
        "True" if phase == "Running" else "False",
        Reason.STARTED if phase == "Running" else decision.reason,
        msg,
        now,
        generation,
    )
    c = cond.set_condition(
        c,
        cond.CHECKPOINTING,
        "True" if phase == "Checkpointing" else "False",
        decision.reason,
        msg,
        now,
        generation,
    )
    if phase == "Running":
        pre = cond.find_condition(c, cond.PREEMPTED)
        if pre is not None and pre.status == "True":
            c = cond.set_condition(
                c,
                cond.PREEMPTED,
                "False",
                Reason.RESUMED,
                "resumed after the preemption",
                now,
                generation,
            )
    if phase == "Succeeded":
        c = cond.set_condition(
            c, cond.SUCCEEDED, "True", Reason.COMPLETED, "training finished", now, generation
        )
    if phase == "Failed":
        existing = cond.find_condition(c, cond.FAILED)
        if existing is None or existing.status != "True":
            c = cond.set_condition(c, cond.FAILED, "True", decision.reason, msg, now, generation)
    status.conditions = c
