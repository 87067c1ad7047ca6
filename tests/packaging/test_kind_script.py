"""tests/kind/run.sh cannot run here (no Docker daemon able to run kind, no internet), so it is kept
correct by what can run: bash -n, shellcheck, its dry run, and the files and names it relies on."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

from tests.packaging.tools import REPO_ROOT, require_tool, run_tool

SCRIPT = REPO_ROOT / "tests" / "kind" / "run.sh"
WORKFLOW = REPO_ROOT / ".github" / "workflows" / "kind.yaml"


def _dry_run(**env: str) -> str:
    proc = run_tool("bash", str(SCRIPT), "--dry-run", env={**os.environ, **env}, timeout=60)
    return proc.stdout


SCRIPTS = [SCRIPT, REPO_ROOT / "tests" / "packaging" / "docker_smoke.sh"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script: Path) -> None:
    run_tool("bash", "-n", str(script))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck(script: Path) -> None:
    shellcheck = require_tool("shellcheck")
    run_tool(shellcheck, "--severity=style", str(script))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_executable(script: Path) -> None:
    assert os.access(script, os.X_OK)


def test_dry_run_prints_every_step_in_order() -> None:
    out = _dry_run()
    steps = [
        "+ kind create cluster --name preemptible",
        "+ docker build --target operator -t preemptible-operator:0.1.0",
        "+ docker build --build-arg",
        "+ kind load docker-image preemptible-operator:0.1.0 --name preemptible",
        "+ kind load docker-image preemptible:0.1.0 --name preemptible",
        "+ kubectl apply --server-side -f https://github.com/kubernetes-sigs/kueue/releases/download/v0.19.2/manifests.yaml",
        "+ wait until Kueue accepts its objects",
        "+ helm install preemptible",
        "+ kubectl -n preemptible-demo apply -f",
        "+ wait until low-priority is Running",
        "+ wait until low-priority was preempted",
        "+ wait until high-priority Succeeded",
        "+ wait until low-priority Succeeded",
        "+ kind delete cluster --name preemptible",
    ]
    positions = [out.find(step) for step in steps]
    assert -1 not in positions, [s for s, p in zip(steps, positions, strict=True) if p == -1]
    assert positions == sorted(positions), out


def test_dry_run_honours_overrides() -> None:
    out = _dry_run(
        CLUSTER_NAME="ci",
        IMAGE="example/preemptible:dev",
        OPERATOR_IMAGE="example/preemptible-operator:dev",
        KUEUE_VERSION="v9.9.9",
    )
    assert "kind create cluster --name ci" in out
    assert "kind load docker-image example/preemptible:dev --name ci" in out
    assert "kind load docker-image example/preemptible-operator:dev --name ci" in out
    # the chart runs the operator image; the examples' TrainingJobs name the runtime image
    assert "--set image.repository=example/preemptible-operator --set image.tag=dev" in out
    assert "download/v9.9.9/manifests.yaml" in out


def test_rejects_unknown_arguments() -> None:
    proc = run_tool("bash", str(SCRIPT), "--bogus", check=False)
    assert proc.returncode == 2
    assert "unknown argument: --bogus" in proc.stderr


def test_script_uses_real_files_and_pinned_versions() -> None:
    text = SCRIPT.read_text()
    for rel in re.findall(r'"\$examples/([^"]+)"', text):
        assert (REPO_ROOT / "manifests" / "examples" / rel).is_file(), rel
    # The TrainingJob names the script waits on are the examples' names.
    for name in set(re.findall(r"tj_\w+ (low-priority|high-priority) ", text)):
        doc = list(
            yaml.safe_load_all(
                (REPO_ROOT / "manifests/examples/kueue" / f"{name}.yaml").read_text()
            )
        )
        assert doc[-1]["metadata"]["name"] == name
    out = _dry_run()
    pinned = re.search(
        r"^KUEUE_VERSION=(\S+)$", (REPO_ROOT / "tests/cluster/versions.env").read_text(), re.M
    )
    assert pinned and f"/download/{pinned.group(1)}/" in out


def test_workflow_runs_the_script() -> None:
    workflow = yaml.safe_load(WORKFLOW.read_text())
    (job,) = workflow["jobs"].values()
    runs = [step.get("run", "") for step in job["steps"]]
    assert "tests/kind/run.sh" in runs
    assert any("shellcheck tests/kind/run.sh" in r for r in runs)
    assert any(step.get("uses", "").startswith("actions/checkout@") for step in job["steps"])
