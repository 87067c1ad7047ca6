"""The priority values of the cluster's classes, for the priority boost's band
(:func:`preemptible_operator.victims.band_top`).

Kueue orders and compares a Workload by its ``spec.priority``, taken from its
WorkloadPriorityClass or, without one, from the pods' PriorityClass; a boost must keep every
Workload below the next higher value of either kind. Both lists are read at most once per
``refresh_seconds`` (classes change rarely; one list call per minute for the whole operator,
not one per job), shared by every reconcile worker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import kubernetes
from kubernetes.client.rest import ApiException

__all__ = ["PriorityClassValues"]

log = logging.getLogger(__name__)

KUEUE_GROUP = "kueue.x-k8s.io"


class PriorityClassValues:
    """Cached values of WorkloadPriorityClasses and PriorityClasses."""

    def __init__(
        self,
        api_client: kubernetes.client.ApiClient,
        refresh_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._custom = kubernetes.client.CustomObjectsApi(api_client)
        self._scheduling = kubernetes.client.SchedulingV1Api(api_client)
        self._refresh = refresh_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._values: tuple[int, ...] | None = None
        self._read_at: float | None = None
        self._warned = False

    def values(self, kueue_version: str) -> tuple[int, ...] | None:
        """Every class value (sorted, distinct); None while they could not be read yet (the
        caller then keeps its configured band: the boost works as before, with a warning)."""
        now = self._clock()
        with self._lock:
            if self._read_at is not None and now - self._read_at < self._refresh:
                return self._values
            self._read_at = now  # one reader per interval, even when the read fails
        try:
            workload_classes = self._custom.list_cluster_custom_object(
                KUEUE_GROUP, kueue_version, "workloadpriorityclasses"
            )
            pod_classes = self._scheduling.list_priority_class()
        except Exception as exc:  # RBAC, a network error: the boost must not fail the pass
            if not self._warned:
                why = f"{exc.status} {exc.reason}" if isinstance(exc, ApiException) else repr(exc)
                log.warning(
                    "cannot list WorkloadPriorityClasses and PriorityClasses (%s): the priority "
                    "boost keeps --priority-boost-max as its band and may lift a job level with "
                    "a higher class; grant list on both (the chart does)",
                    why,
                )
                self._warned = True
            with self._lock:
                return self._values
        values = tuple(sorted({*_values(workload_classes), *_pod_class_values(pod_classes)}))
        with self._lock:
            self._values = values
        return values


def _values(listing: dict[str, Any]) -> list[int]:
    return [int(item["value"]) for item in listing.get("items") or [] if "value" in item]


def _pod_class_values(listing: Any) -> list[int]:
    return [int(item.value) for item in listing.items or [] if item.value is not None]
