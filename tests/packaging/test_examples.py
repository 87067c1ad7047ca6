"""manifests/examples/: every TrainingJob validates against the operator's models and renders into
an attempt Job; storage, Kueue names and quotas are consistent, so the examples do what they say."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from preemptible_operator import models, render, shape
from tests.packaging.tools import REPO_ROOT

EXAMPLES = REPO_ROOT / "manifests" / "examples"
EXAMPLE_FILES = sorted(EXAMPLES.rglob("*.yaml"))


def _load(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _training_jobs() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p in EXAMPLE_FILES for d in _load(p) if d["kind"] == models.KIND]


TRAINING_JOBS = _training_jobs()
TJ_IDS = [str(p.relative_to(EXAMPLES)) for p, _ in TRAINING_JOBS]


def _cpu(quantity: str | int) -> float:
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def test_the_promised_examples_exist() -> None:
    names = {str(p.relative_to(EXAMPLES)) for p in EXAMPLE_FILES}
    assert {
        "minimal.yaml",
        "grace-auto-pvc.yaml",
        "multi-node.yaml",
        "gpu-2x8.yaml",
        "kueue/setup.yaml",
        "kueue/low-priority.yaml",
        "kueue/high-priority.yaml",
        "s3.yaml",
    } <= names
    assert len(TRAINING_JOBS) >= 5


@pytest.mark.parametrize(("path", "tj"), TRAINING_JOBS, ids=TJ_IDS)
def test_training_job_validates_against_models(path: Path, tj: dict[str, Any]) -> None:
    assert tj["apiVersion"] == models.API_VERSION
    assert render.validate_name(tj["metadata"]["name"]) is None
    spec = models.parse_spec(tj["spec"])  # extra="forbid": a misspelt field fails here
    # Nothing in the example is silently dropped or renamed by the models.
    dumped = spec.model_dump(by_alias=True, exclude_unset=True, mode="json")
    assert dumped == tj["spec"]


@pytest.mark.parametrize(("path", "tj"), TRAINING_JOBS, ids=TJ_IDS)
def test_training_job_renders_an_attempt(path: Path, tj: dict[str, Any]) -> None:
    spec = models.parse_spec(tj["spec"])
    meta = {**tj["metadata"], "namespace": "default", "uid": "00000000-0000-0000-0000-000000000001"}
    params = render.AttemptParams(attempt=1, grace_seconds=120, resume_from="", suspended=False)
    job = render.render_job(meta, spec, params)
    assert job["spec"]["completions"] == spec.num_nodes
    pod = job["spec"]["template"]["spec"]
    trainer = next(c for c in pod["containers"] if c["name"] == render.CONTAINER_NAME)
    assert trainer["image"] == tj["spec"]["image"]
    # The command as written; behind the launcher with several processes per pod.
    command = tj["spec"]["command"]
    assert trainer["command"][-len(command) :] == command
    if shape.procs_per_node(spec) > 1:
        assert trainer["command"][: len(shape.LAUNCH_COMMAND)] == list(shape.LAUNCH_COMMAND)
        assert {"name": render.SHM_VOLUME, "mountPath": "/dev/shm"} in trainer["volumeMounts"]
    else:
        assert trainer["command"] == command


def test_gpu_example_is_two_nodes_of_eight_gpus() -> None:
    (tj,) = [d for d in _load(EXAMPLES / "gpu-2x8.yaml") if d["kind"] == models.KIND]
    spec = models.parse_spec(tj["spec"])
    assert (spec.num_nodes, shape.procs_per_node(spec)) == (2, 8)
    meta = {**tj["metadata"], "namespace": "default", "uid": "u"}
    params = render.AttemptParams(attempt=1, grace_seconds=120, resume_from="", suspended=False)
    pod = render.render_job(meta, spec, params)["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert (env["WORLD_SIZE"], env["PET_NNODES"], env["PET_NPROC_PER_NODE"]) == ("16", "2", "8")
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert pod["tolerations"] and pod["nodeSelector"]


def test_examples_use_the_chart_image() -> None:
    chart = yaml.safe_load((REPO_ROOT / "charts" / "preemptible" / "Chart.yaml").read_text())
    for _, tj in TRAINING_JOBS:
        assert tj["spec"]["image"] == f"preemptible:{chart['appVersion']}"


@pytest.mark.parametrize(("path", "tj"), TRAINING_JOBS, ids=TJ_IDS)
def test_checkpoints_survive_the_pod(path: Path, tj: dict[str, Any]) -> None:
    """The checkpoint URI lies on a mounted PVC, whose claim the same file creates, or in an
    object store whose credentials come from a Secret the same file creates."""
    spec = tj["spec"]
    if spec["checkpoint"]["uri"].startswith("s3://"):
        secrets = {d["metadata"]["name"]: d for d in _load(path) if d["kind"] == "Secret"}
        secret = secrets[spec["checkpoint"]["credentialsSecret"]]
        assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(secret["stringData"])
        assert "volumes" not in spec  # nothing local to lose with the node
        return
    volumes = {v["name"]: v for v in spec["volumes"]}
    uri = spec["checkpoint"]["uri"]
    mount = next(
        m for m in spec["volumeMounts"] if uri.startswith(m["mountPath"].rstrip("/") + "/")
    )
    claim = volumes[mount["name"]]["persistentVolumeClaim"]["claimName"]
    claims = {d["metadata"]["name"]: d for d in _load(path) if d["kind"] == "PersistentVolumeClaim"}
    assert claim in claims
    if spec.get("numNodes", 1) > 1:
        assert "ReadWriteMany" in claims[claim]["spec"]["accessModes"]


def test_grace_auto_example_is_automatic() -> None:
    (tj,) = _load(EXAMPLES / "grace-auto-pvc.yaml")[1:]
    grace = models.parse_spec(tj["spec"]).grace_period
    assert grace.seconds is None  # "auto": no pinned seconds
    assert grace.min <= grace.initial_seconds <= grace.max


def test_kueue_example_preempts() -> None:
    """Names line up, high outranks low, and the quota fits one job but not both."""
    setup = _load(EXAMPLES / "kueue" / "setup.yaml")
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for obj in setup:
        assert obj["apiVersion"] == "kueue.x-k8s.io/v1beta2"
        by_kind.setdefault(obj["kind"], []).append(obj)
    (flavor,) = by_kind["ResourceFlavor"]
    (cq,) = by_kind["ClusterQueue"]
    (lq,) = by_kind["LocalQueue"]
    priorities = {p["metadata"]["name"]: p["value"] for p in by_kind["WorkloadPriorityClass"]}
    assert lq["spec"]["clusterQueue"] == cq["metadata"]["name"]
    assert cq["spec"]["preemption"]["withinClusterQueue"] == "LowerPriority"
    (group,) = cq["spec"]["resourceGroups"]
    (cq_flavor,) = group["flavors"]
    assert cq_flavor["name"] == flavor["metadata"]["name"]
    cpu_quota = _cpu(next(r["nominalQuota"] for r in cq_flavor["resources"] if r["name"] == "cpu"))

    low = _load(EXAMPLES / "kueue" / "low-priority.yaml")[-1]["spec"]
    high = _load(EXAMPLES / "kueue" / "high-priority.yaml")[-1]["spec"]
    for spec in (low, high):
        assert spec["queueName"] == lq["metadata"]["name"]
        assert spec["priorityClass"] in priorities
    assert priorities[high["priorityClass"]] > priorities[low["priorityClass"]]

    def cpu(spec: dict[str, Any]) -> float:
        return spec.get("numNodes", 1) * _cpu(spec["resourcesPerNode"]["requests"]["cpu"])

    assert cpu(low) <= cpu_quota and cpu(high) <= cpu_quota
    assert cpu(low) + cpu(high) > cpu_quota
