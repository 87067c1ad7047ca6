"""A directory-backed volume provisioner for the cluster test tier (in the spirit of kind's
local-path provisioner): a default StorageClass whose claims get a PersistentVolume backed by a
fresh directory on this machine.

Dynamic provisioning as the external-provisioner protocol has it: the PV controller of
kube-controller-manager marks a claim of our class with
``volume.kubernetes.io/storage-provisioner``; we create a PersistentVolume pre-bound to the claim
(``claimRef`` with its UID) and the PV controller completes the binding. Released volumes of
reclaim policy Delete are removed with their directory. All access modes are granted (every pod
of the tier runs on this one machine, so ReadWriteMany is real sharing); capacity is not enforced.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
from pathlib import Path
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

__all__ = ["PROVISIONER_NAME", "STORAGE_CLASS", "LocalDirProvisioner"]

STORAGE_CLASS = "standard"
PROVISIONER_NAME = "preemptible.dev/local-dir"
_PROVISIONED_BY = "pv.kubernetes.io/provisioned-by"


class LocalDirProvisioner:
    """``start()`` creates the default StorageClass and polls claims; always ``stop()``."""

    def __init__(
        self,
        client: kubernetes.client.ApiClient,
        root: Path,
        log: logging.Logger | None = None,
        interval: float = 0.5,
    ) -> None:
        self.client = client
        self.root = root
        self.log = log or logging.getLogger(__name__)
        self.interval = interval
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        storage = kubernetes.client.StorageV1Api(self.client)
        body = {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {
                "name": STORAGE_CLASS,
                "annotations": {"storageclass.kubernetes.io/is-default-class": "true"},
            },
            "provisioner": PROVISIONER_NAME,
            "reclaimPolicy": "Delete",
            "volumeBindingMode": "Immediate",
        }
        try:
            storage.create_storage_class(body)
        except ApiException as exc:
            if exc.status != 409:
                raise
        self._thread = threading.Thread(target=self._loop, name="provisioner", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(5)

    def _loop(self) -> None:
        while not self._stopping.wait(self.interval):
            try:
                self.reconcile()
            except Exception as exc:  # the API may be restarting; try again next round
                self.log.warning("provisioner: %r", exc)

    def reconcile(self) -> None:
        """One level-triggered pass: provision pending claims, delete released volumes."""
        core = kubernetes.client.CoreV1Api(self.client)
        volumes = core.list_persistent_volume().items
        claimed = {pv.spec.claim_ref.uid for pv in volumes if pv.spec.claim_ref is not None}
        for pvc in core.list_persistent_volume_claim_for_all_namespaces().items:
            annotations = pvc.metadata.annotations or {}
            wanted = annotations.get("volume.kubernetes.io/storage-provisioner") or annotations.get(
                "volume.beta.kubernetes.io/storage-provisioner"
            )
            if (
                pvc.status.phase == "Pending"
                and not pvc.spec.volume_name
                and pvc.metadata.uid not in claimed
                and (wanted == PROVISIONER_NAME or pvc.spec.storage_class_name == STORAGE_CLASS)
                and pvc.metadata.deletion_timestamp is None
            ):
                self._provision(core, pvc)
        for pv in volumes:
            annotations = pv.metadata.annotations or {}
            if (
                annotations.get(_PROVISIONED_BY) == PROVISIONER_NAME
                and pv.status.phase in ("Released", "Failed")
                and pv.spec.persistent_volume_reclaim_policy == "Delete"
            ):
                path = (pv.spec.host_path.path if pv.spec.host_path else "") or ""
                if path.startswith(str(self.root)):
                    shutil.rmtree(path, ignore_errors=True)
                with contextlib.suppress(ApiException):
                    core.delete_persistent_volume(pv.metadata.name)
                self.log.info("provisioner: deleted %s", pv.metadata.name)

    def _provision(self, core: kubernetes.client.CoreV1Api, pvc: Any) -> None:
        meta = pvc.metadata
        name = f"pvc-{meta.uid}"
        directory = self.root / f"{meta.namespace}_{meta.name}_{meta.uid[:8]}"
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o777)  # like local-path: any pod user may write
        requests = (pvc.spec.resources.requests if pvc.spec.resources else None) or {}
        body = {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": name, "annotations": {_PROVISIONED_BY: PROVISIONER_NAME}},
            "spec": {
                "capacity": {"storage": requests.get("storage", "1Gi")},
                "accessModes": pvc.spec.access_modes or ["ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Delete",
                "storageClassName": pvc.spec.storage_class_name or STORAGE_CLASS,
                "volumeMode": pvc.spec.volume_mode or "Filesystem",
                "hostPath": {"path": str(directory), "type": "Directory"},
                "claimRef": {
                    "apiVersion": "v1",
                    "kind": "PersistentVolumeClaim",
                    "namespace": meta.namespace,
                    "name": meta.name,
                    "uid": meta.uid,
                },
            },
        }
        try:
            core.create_persistent_volume(body)
        except ApiException as exc:
            if exc.status != 409:
                raise
            return
        self.log.info("provisioner: %s/%s -> %s (%s)", meta.namespace, meta.name, name, directory)
