"""Kueue running outside the cluster against the test control plane: CRDs, its webhooks served on
loopback and registered by URL, a ResourceFlavor, a ClusterQueue with a small quota, two
WorkloadPriorityClasses and LocalQueues on demand; feature gate PriorityBoost on."""

from __future__ import annotations

import base64
import contextlib
import copy
import time
from pathlib import Path
from typing import Any, ClassVar

import kubernetes
import yaml
from kubernetes.client.exceptions import ApiException

from .controlplane import START_TIMEOUT, ControlPlane, client_environment
from .processes import ManagedProcess, free_port, http_ok, wait_until

__all__ = ["KUEUE_API", "Kueue"]

KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSION = "v1beta2"
KUEUE_API = f"{KUEUE_GROUP}/{KUEUE_VERSION}"
# Kueue reads its metrics serving certificate from here even with metrics off (hard-coded path).
METRICS_CERT_DIR = Path("/etc/kueue/metrics/certs")
# CRDs that Kueue converts between v1beta1 and v1beta2 (its crd/patches/webhook_in_*.yaml).
CONVERTED_CRDS = (
    "localqueues",
    "clusterqueues",
    "cohorts",
    "workloads",
    "multikueueclusters",
)


def _served_webhook(webhook: dict[str, Any]) -> bool:
    """Only Kueue's own resources and batch/v1 Jobs: the other integrations are disabled and their
    webhooks (failurePolicy Fail) would reject every Pod, Deployment, ... they match."""
    path = webhook["clientConfig"]["service"]["path"]
    return "kueue-x-k8s-io" in path or path.endswith("-batch-v1-job")


class Kueue:
    """``start()`` after the control plane; ``stop()`` before it. Names are attributes."""

    resource_flavor = "default-flavor"
    cluster_queue = "preemptible-cq"
    local_queue = "preemptible-lq"
    low_priority = "low"
    high_priority = "high"
    priorities: ClassVar[dict[str, int]] = {"low": 100, "high": 1000}
    queue_label = "kueue.x-k8s.io/queue-name"
    priority_label = "kueue.x-k8s.io/priority-class"

    def __init__(
        self, control_plane: ControlPlane, *, quota_cpu: str = "2", quota_memory: str = "4Gi"
    ) -> None:
        self.cp = control_plane
        self.quota = {"cpu": quota_cpu, "memory": quota_memory}
        self.workdir = control_plane.workdir / "kueue"
        self.binary, self.config_dir = control_plane.binaries.require_kueue()
        self.process: ManagedProcess | None = None
        self.webhook_port = 0
        self.health_port = 0
        self.started_seconds: float | None = None
        self._webhook_configs: list[tuple[str, str]] = []

    # ------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        t0 = time.monotonic()
        assert self.cp.ca is not None, "start the control plane first"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._metrics_cert()
        with self.cp.api_client() as client:
            self._apply_crds(client)
            self._ensure_namespace(client, "kueue-system")
        certs = self.workdir / "certs"
        self.cp.ca.issue("tls", "kueue-webhook", server=True, ips=("127.0.0.1",), directory=certs)
        self.webhook_port, self.health_port = free_port(), free_port()
        config = {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2",
            "kind": "Configuration",
            "namespace": "kueue-system",
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.health_port}"},
            "metrics": {"bindAddress": "0"},
            "webhook": {"host": "127.0.0.1", "port": self.webhook_port, "certDir": str(certs)},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "manageJobsWithoutQueueName": False,
            "integrations": {"frameworks": ["batch/job"]},
            # The visibility API server wants an APIService route; not needed here.
            # PriorityBoost (alpha, off by default): Kueue reads the priority-boost annotation
            # the operator writes with --priority-boost (issue 32). Harmless for every other
            # test: without the annotation the boost is 0 and nothing changes.
            "featureGates": {"VisibilityOnDemand": False, "PriorityBoost": True},
        }
        config_path = self.workdir / "config.yaml"
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        env = {"KUBECONFIG": str(self.cp.kubeconfig)}
        self.process = ManagedProcess(
            "kueue",
            [str(self.binary), f"--config={config_path}", "--zap-log-level=2"],
            self.cp.logs_dir / "kueue.log",
            env={**client_environment(), **env},
            cwd=self.workdir,
        )
        self.cp.add_process(self.process)
        wait_until(
            "kueue /readyz",
            lambda: http_ok(f"http://127.0.0.1:{self.health_port}/readyz"),
            timeout=START_TIMEOUT,
            check=self.process.check_alive,
        )
        with self.cp.api_client() as client:
            self._register_webhooks(client)
            self._create_queues(client)
        self.started_seconds = time.monotonic() - t0

    def stop(self) -> None:
        """Unregister the webhooks (so the apiserver stops calling them), then stop Kueue."""
        with contextlib.suppress(Exception), self.cp.api_client() as client:
            admission = kubernetes.client.AdmissionregistrationV1Api(client)
            for kind, name in self._webhook_configs:
                with contextlib.suppress(ApiException):
                    if kind == "MutatingWebhookConfiguration":
                        admission.delete_mutating_webhook_configuration(name)
                    else:
                        admission.delete_validating_webhook_configuration(name)
        if self.process is not None:
            self.process.stop()

    # ------------------------------------------------------------------------------- helpers
    def job_labels(self, priority: str | None = None, queue: str | None = None) -> dict[str, str]:
        """Labels that put a Job into the LocalQueue (and give it a priority class)."""
        labels = {self.queue_label: queue or self.local_queue}
        if priority:
            labels[self.priority_label] = priority
        return labels

    def create_local_queue(self, namespace: str, name: str | None = None) -> str:
        name = name or self.local_queue
        with self.cp.api_client() as client:
            self._create(
                client,
                "localqueues",
                {
                    "apiVersion": KUEUE_API,
                    "kind": "LocalQueue",
                    "metadata": {"name": name, "namespace": namespace},
                    "spec": {"clusterQueue": self.cluster_queue},
                },
                namespace=namespace,
            )
        return name

    def workloads(self, namespace: str) -> list[dict[str, Any]]:
        with self.cp.api_client() as client:
            result = kubernetes.client.CustomObjectsApi(client).list_namespaced_custom_object(
                KUEUE_GROUP, KUEUE_VERSION, namespace, "workloads"
            )
        return result["items"]

    def workload_for_job(self, namespace: str, job_uid: str) -> dict[str, Any] | None:
        with self.cp.api_client() as client:
            result = kubernetes.client.CustomObjectsApi(client).list_namespaced_custom_object(
                KUEUE_GROUP,
                KUEUE_VERSION,
                namespace,
                "workloads",
                label_selector=f"kueue.x-k8s.io/job-uid={job_uid}",
            )
        items = result["items"]
        return items[0] if items else None

    # -------------------------------------------------------------------------------- setup
    def _metrics_cert(self) -> None:
        if (METRICS_CERT_DIR / "tls.crt").exists() and (METRICS_CERT_DIR / "tls.key").exists():
            return
        assert self.cp.ca is not None
        try:
            self.cp.ca.issue("tls", "kueue-metrics", server=True, ips=("127.0.0.1",),
                             directory=METRICS_CERT_DIR)  # fmt: skip
        except PermissionError as exc:
            raise RuntimeError(
                f"Kueue needs {METRICS_CERT_DIR}/tls.crt and tls.key (a path hard-coded in Kueue "
                f"{self.cp.binaries.kueue_version}) and this user cannot create them: {exc}; "
                "run the tests as root or create that directory with a certificate and key"
            ) from exc

    @staticmethod
    def _ensure_namespace(client: kubernetes.client.ApiClient, name: str) -> None:
        with contextlib.suppress(ApiException):
            kubernetes.client.CoreV1Api(client).create_namespace({"metadata": {"name": name}})

    def _apply_crds(self, client: kubernetes.client.ApiClient) -> None:
        ext = kubernetes.client.ApiextensionsV1Api(client)
        names = []
        for path in sorted((self.config_dir / "crd").glob("*.yaml")):
            for doc in yaml.safe_load_all(path.read_text()):
                if not doc:
                    continue
                names.append(doc["metadata"]["name"])
                try:
                    ext.create_custom_resource_definition(doc)
                except ApiException as exc:
                    if exc.status != 409:
                        raise RuntimeError(
                            f"creating CRD from {path}: {exc.status} {exc.body}"
                        ) from exc

        def established() -> bool:
            for name in names:
                crd = client.sanitize_for_serialization(ext.read_custom_resource_definition(name))
                conditions = crd.get("status", {}).get("conditions") or []
                if not any(
                    c["type"] == "Established" and c["status"] == "True" for c in conditions
                ):
                    return False
            return True

        wait_until("Kueue CRDs established", established, timeout=START_TIMEOUT)

    def _register_webhooks(self, client: kubernetes.client.ApiClient) -> None:
        assert self.cp.ca is not None
        ca_bundle = base64.b64encode(self.cp.ca.cert_pem).decode()
        base = f"https://127.0.0.1:{self.webhook_port}"
        admission = kubernetes.client.AdmissionregistrationV1Api(client)
        manifests = (self.config_dir / "webhook" / "manifests.yaml").read_text()
        for doc in yaml.safe_load_all(manifests):
            if not doc:
                continue
            doc = copy.deepcopy(doc)
            doc["metadata"]["name"] = "kueue-" + doc["metadata"]["name"]
            hooks = [w for w in doc["webhooks"] if _served_webhook(w)]
            for hook in hooks:
                path = hook["clientConfig"]["service"]["path"]
                hook["clientConfig"] = {"url": base + path, "caBundle": ca_bundle}
                # Never let the test namespace of Kueue itself be gated by its own webhooks.
                hook["namespaceSelector"] = {
                    "matchExpressions": [
                        {"key": "kubernetes.io/metadata.name", "operator": "NotIn",
                         "values": ["kube-system", "kueue-system"]}
                    ]
                }  # fmt: skip
            doc["webhooks"] = hooks
            name = doc["metadata"]["name"]
            if doc["kind"] == "MutatingWebhookConfiguration":
                admission.create_mutating_webhook_configuration(doc)
            else:
                admission.create_validating_webhook_configuration(doc)
            self._webhook_configs.append((doc["kind"], name))
        # Conversion between v1beta1 and v1beta2 (Kueue serves /convert on the same port).
        ext = kubernetes.client.ApiextensionsV1Api(client)
        conversion = {
            "strategy": "Webhook",
            "webhook": {
                "clientConfig": {"url": f"{base}/convert", "caBundle": ca_bundle},
                "conversionReviewVersions": ["v1"],
            },
        }
        for plural in CONVERTED_CRDS:
            ext.patch_custom_resource_definition(
                f"{plural}.{KUEUE_GROUP}",
                {"spec": {"conversion": conversion}},
                _content_type="application/merge-patch+json",
            )

    def _create(
        self,
        client: kubernetes.client.ApiClient,
        plural: str,
        body: dict[str, Any],
        *,
        namespace: str | None = None,
    ) -> None:
        """Create, retrying while Kueue's webhooks warm up; an existing object is fine."""
        api = kubernetes.client.CustomObjectsApi(client)
        last: ApiException | None = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if namespace:
                    api.create_namespaced_custom_object(
                        KUEUE_GROUP, KUEUE_VERSION, namespace, plural, body
                    )
                else:
                    api.create_cluster_custom_object(KUEUE_GROUP, KUEUE_VERSION, plural, body)
                return
            except ApiException as exc:
                if exc.status == 409:
                    return
                if exc.status not in (500, 503):  # 500: webhook not reachable yet
                    raise RuntimeError(
                        f"creating {body['kind']} {body['metadata']['name']}: "
                        f"{exc.status} {exc.body}"
                    ) from exc
                last = exc
                time.sleep(0.5)
        raise RuntimeError(f"creating {body['kind']} failed for 60 s: {last}")

    def _create_queues(self, client: kubernetes.client.ApiClient) -> None:
        self._create(
            client,
            "resourceflavors",
            {"apiVersion": KUEUE_API, "kind": "ResourceFlavor",
             "metadata": {"name": self.resource_flavor}, "spec": {}},
        )  # fmt: skip
        self._create(
            client,
            "clusterqueues",
            {
                "apiVersion": KUEUE_API,
                "kind": "ClusterQueue",
                "metadata": {"name": self.cluster_queue},
                "spec": {
                    "namespaceSelector": {},
                    "preemption": {"withinClusterQueue": "LowerPriority"},
                    "resourceGroups": [
                        {
                            "coveredResources": list(self.quota),
                            "flavors": [
                                {
                                    "name": self.resource_flavor,
                                    "resources": [
                                        {"name": r, "nominalQuota": q}
                                        for r, q in self.quota.items()
                                    ],
                                }
                            ],
                        }
                    ],
                },
            },
        )
        for name, value in self.priorities.items():
            self._create(
                client,
                "workloadpriorityclasses",
                # No description: manifests/examples/kueue/setup.yaml (same names and values)
                # then applies server-side without a conflict.
                {"apiVersion": KUEUE_API, "kind": "WorkloadPriorityClass",
                 "metadata": {"name": name}, "value": value},
            )  # fmt: skip

        def active() -> bool:
            cq = kubernetes.client.CustomObjectsApi(client).get_cluster_custom_object(
                KUEUE_GROUP, KUEUE_VERSION, "clusterqueues", self.cluster_queue
            )
            conditions = cq.get("status", {}).get("conditions") or []
            return any(c["type"] == "Active" and c["status"] == "True" for c in conditions)

        wait_until(f"ClusterQueue {self.cluster_queue} Active", active, timeout=START_TIMEOUT)
