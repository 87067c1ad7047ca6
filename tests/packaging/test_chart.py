"""The Helm chart: lint, rendering in each mode, values schema, least-privilege RBAC, and the plain
install manifests generated from it."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.packaging.chart import (
    CHART_DIR,
    find_objects,
    is_user_role,
    render,
    render_raw,
    rules_of,
)
from tests.packaging.tools import REPO_ROOT, require_tool, run_tool

READ = {"get", "list", "watch"}


@pytest.fixture(scope="module")
def helm() -> str:
    return require_tool("helm")


def _deployment(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = find_objects(objects, "Deployment")
    return deployment


def _operator_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = _deployment(objects)["spec"]["template"]["spec"]["containers"]
    return container


def _init_env(objects: list[dict[str, Any]]) -> dict[str, str]:
    (init,) = _deployment(objects)["spec"]["template"]["spec"]["initContainers"]
    assert init["name"] == "ensure-peering"
    return {e["name"]: e["value"] for e in init["env"]}


def test_helm_lint_strict(helm: str) -> None:
    run_tool(helm, "lint", "--strict", str(CHART_DIR))


@pytest.mark.parametrize(
    "values",
    [
        {"watchNamespaces": ["team-a", "team-b"], "replicaCount": 0},
        {"metrics": {"serviceMonitor": {"enabled": True}}},
        {"checkpointStorage": {"persistentVolumeClaim": {"claimName": "ckpt"}}},
        {"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "mine"}},
    ],
    ids=["namespaced", "service-monitor", "pvc", "byo-rbac"],
)
def test_helm_lint_with_values(helm: str, values: dict[str, Any], tmp_path: Path) -> None:
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    run_tool(helm, "lint", "--strict", str(CHART_DIR), "--values", str(values_file))


def test_cluster_wide_mode(helm: str) -> None:
    objects = render(helm)
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == sorted(
        [
            "ServiceAccount",
            "ClusterRole",
            "ClusterRole",
            "ClusterRoleBinding",
            "ClusterRoleBinding",
            "Service",
            "Deployment",
            # preemptible-edit and preemptible-view, aggregated into edit/admin and view
            "ClusterRole",
            "ClusterRole",
            # the operator's own writes, and the Jobs/Services it creates (docs/install.md)
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
        ]
    )
    assert not find_objects(objects, "Role")
    args = _operator_container(objects)["args"]
    assert args[0] == "run"
    assert "--all-namespaces" in args
    assert not any(a.startswith("--namespace") for a in args)
    # The init container creates the ClusterKopfPeering the operator's --peering names.
    env = _init_env(objects)
    assert f"--peering={env['PEERING_NAME']}" in args
    assert env["PEERING_NAMESPACES"] == ""
    # The bindings point at the chart's ServiceAccount in the release namespace.
    (sa,) = find_objects(objects, "ServiceAccount")
    for binding in find_objects(objects, "ClusterRoleBinding"):
        assert binding["subjects"] == [
            {
                "kind": "ServiceAccount",
                "name": sa["metadata"]["name"],
                "namespace": "preemptible-system",
            }
        ]


def test_namespaced_mode(helm: str, tmp_path: Path) -> None:
    objects = render(helm, {"watchNamespaces": ["team-a", "team-b"]}, tmp_path=tmp_path)
    roles = find_objects(objects, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in find_objects(objects, "RoleBinding")) == [
        "team-a",
        "team-b",
    ]
    assert _init_env(objects)["PEERING_NAMESPACES"] == "team-a team-b"
    # Nothing namespaced is granted cluster-wide: the only ClusterRole reads CRDs, Nodes,
    # priority classes and Namespaces.
    (cluster_role,) = [o for o in find_objects(objects, "ClusterRole") if not is_user_role(o)]
    assert cluster_role["rules"] == [
        {
            "apiGroups": ["apiextensions.k8s.io"],
            "resources": ["customresourcedefinitions"],
            "verbs": ["list", "watch"],
        },
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
        {"apiGroups": ["scheduling.k8s.io"], "resources": ["priorityclasses"], "verbs": ["list"]},
        {
            "apiGroups": ["kueue.x-k8s.io"],
            "resources": ["workloadpriorityclasses"],
            "verbs": ["get", "list"],
        },
        {"apiGroups": ["kueue.x-k8s.io"], "resources": ["resourceflavors"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
    ]
    args = _operator_container(objects)["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args
    assert "--all-namespaces" not in args


@pytest.mark.parametrize("kind", ["ClusterRole", "Role"])
def test_rbac_is_least_privilege(helm: str, kind: str, tmp_path: Path) -> None:
    values = {"watchNamespaces": ["team-a"]} if kind == "Role" else None
    rules = rules_of(render(helm, values, tmp_path=tmp_path), kind)
    assert rules
    granted: dict[str, set[str]] = {}
    for rule in rules:
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field], f"wildcard in {field}: {rule}"
        assert not rule.get("resourceNames")
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault(f"{group}/{resource}", set()).update(rule["verbs"])
    # Never Secrets (user credentials) nor privilege-escalation verbs.
    assert not [r for r in granted if r.endswith(("/secrets", "/configmaps"))]
    assert not [
        v for verbs in granted.values() for v in verbs if v in {"escalate", "bind", "impersonate"}
    ]
    # Pods: read, patch (the attempt finalizer), graceful delete; never create, never evict.
    assert granted["/pods"] <= READ | {"patch", "delete"}
    assert "/pods/eviction" not in granted
    assert granted["preemptible.dev/trainingjobs/status"] <= {"get", "update", "patch"}
    assert "create" in granted["batch/jobs"]
    # Nodes and CRDs are only read.
    assert granted.get("/nodes", set()) <= READ
    assert granted.get("apiextensions.k8s.io/customresourcedefinitions", set()) <= READ
    assert granted.get("/namespaces", set()) <= READ


@pytest.mark.parametrize("mode", ["cluster-wide", "namespaced"])
def test_admission_policy_is_the_generated_one(helm: str, mode: str, tmp_path: Path) -> None:
    """The chart's ValidatingAdmissionPolicy is operator/rbac.py's for the chart's own
    ServiceAccount, bound with Deny, in both modes (the match condition picks the operator)."""
    from preemptible_operator import rbac

    values = {"watchNamespaces": ["team-a"]} if mode == "namespaced" else None
    objects = render(helm, values, tmp_path=tmp_path)
    (sa,) = find_objects(objects, "ServiceAccount")
    policies = {
        p["metadata"]["name"]: p for p in find_objects(objects, "ValidatingAdmissionPolicy")
    }
    bindings = {
        b["metadata"]["name"]: b for b in find_objects(objects, "ValidatingAdmissionPolicyBinding")
    }
    account = sa["metadata"]["name"]
    expected = [
        (
            rbac.admission_policy("preemptible-operator", "preemptible-system", account),
            rbac.admission_policy_binding("preemptible-operator"),
        ),
        (
            rbac.children_policy("preemptible-operator-children", "preemptible-system", account),
            rbac.children_policy_binding("preemptible-operator-children"),
        ),
    ]
    assert policies.keys() == bindings.keys() == {p["metadata"]["name"] for p, _ in expected}
    for policy, binding in expected:
        assert policies[policy["metadata"]["name"]]["spec"] == policy["spec"]
        assert bindings[binding["metadata"]["name"]]["spec"] == binding["spec"]


def test_admission_policy_carries_the_boost_band(helm: str, tmp_path: Path) -> None:
    """operator.priorityBoost.max is the top of the boost the policy lets through."""
    from preemptible_operator import rbac

    objects = render(helm, {"operator": {"priorityBoost": {"max": 40}}}, tmp_path=tmp_path)
    policy = next(
        p
        for p in find_objects(objects, "ValidatingAdmissionPolicy")
        if p["metadata"]["name"] == "preemptible-operator"
    )
    assert policy["spec"]["variables"][0] == rbac.boost_max_variable(40)


def test_user_roles_are_the_generated_ones(helm: str) -> None:
    from preemptible_operator import rbac

    rendered = {
        o["metadata"]["name"]: o
        for o in find_objects(render(helm), "ClusterRole")
        if is_user_role(o)
    }
    expected = {r["metadata"]["name"]: r for r in rbac.user_roles("preemptible")}
    assert rendered.keys() == expected.keys()
    for name, role in expected.items():
        assert rendered[name]["rules"] == role["rules"]
        labels = rendered[name]["metadata"]["labels"]
        assert {k: v for k, v in labels.items() if k.startswith("rbac.")} == role["metadata"][
            "labels"
        ]


def test_admission_policy_and_user_roles_can_be_turned_off(helm: str, tmp_path: Path) -> None:
    values = {"rbac": {"admissionPolicy": False, "aggregateToDefaultRoles": False}}
    objects = render(helm, values, tmp_path=tmp_path)
    assert not find_objects(objects, "ValidatingAdmissionPolicy")
    assert not find_objects(objects, "ValidatingAdmissionPolicyBinding")
    assert not [o for o in find_objects(objects, "ClusterRole") if is_user_role(o)]


def _docs_rbac_table() -> set[tuple[str, str, frozenset[str]]]:
    """Rows of the RBAC table in docs/install.md: (apiGroup, resource, verbs); core: (core)."""
    text = (REPO_ROOT / "docs" / "install.md").read_text()
    section = text.split("\n## RBAC", 1)[1].split("\n## ", 1)[0]
    rows = set()
    for line in section.splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if cells[0] == "API group" or set(cells[0]) <= {"-", ":"}:
            continue
        group = "" if cells[0] == "(core)" else cells[0]
        rows.add((group, cells[1], frozenset(v.strip() for v in cells[2].split(","))))
    return rows


def test_docs_rbac_table_matches_chart(helm: str, tmp_path: Path) -> None:
    """docs/install.md lists exactly what the chart grants (both modes together)."""
    cluster_wide = render(helm)
    namespaced = render(helm, {"watchNamespaces": ["team-a"]}, tmp_path=tmp_path)
    rules = [
        *rules_of(cluster_wide, "ClusterRole"),
        *rules_of(namespaced, "Role"),
        *rules_of(namespaced, "ClusterRole"),
    ]
    chart_rows = {
        (group, resource, frozenset(rule["verbs"]))
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    assert _docs_rbac_table() == chart_rows


def test_deployment_hardening_and_probes(helm: str) -> None:
    objects = render(helm)
    pod = _deployment(objects)["spec"]["template"]["spec"]
    container = _operator_container(objects)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    liveness = next(a for a in container["args"] if a.startswith("--liveness="))
    assert liveness == f"--liveness=http://0.0.0.0:{ports['health']}/healthz"
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    (service,) = find_objects(objects, "Service")
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    assert service["spec"]["selector"] == _deployment(objects)["spec"]["selector"]["matchLabels"]
    assert container["command"] == ["preemptible-operator"]


def test_checkpoint_storage_values(helm: str, tmp_path: Path) -> None:
    values = {
        "checkpointStorage": {
            "persistentVolumeClaim": {"claimName": "ckpt", "mountPath": "/checkpoints"},
            "pathMap": {"/checkpoints": "/checkpoints"},
            "credentialsSecret": "s3-reader",
        }
    }
    objects = render(helm, values, tmp_path=tmp_path)
    pod = _deployment(objects)["spec"]["template"]["spec"]
    container = _operator_container(objects)
    volume = next(v for v in pod["volumes"] if v["name"] == "checkpoints")
    assert volume["persistentVolumeClaim"] == {"claimName": "ckpt", "readOnly": True}
    mount = next(m for m in container["volumeMounts"] if m["name"] == "checkpoints")
    assert mount == {"name": "checkpoints", "mountPath": "/checkpoints", "readOnly": True}
    assert container["envFrom"] == [{"secretRef": {"name": "s3-reader"}}]
    assert "--checkpoint-path-map=/checkpoints=/checkpoints" in container["args"]


def test_object_store_read_access_values(helm: str, tmp_path: Path) -> None:
    """The values docs/install.md gives for checkpoints on S3: a path map of the bucket prefix to
    itself and the credentials Secret as the operator's environment (no volume)."""
    values = {
        "checkpointStorage": {
            "pathMap": {"s3://checkpoints/runs": "s3://checkpoints/runs"},
            "credentialsSecret": "operator-s3",
        }
    }
    objects = render(helm, values, tmp_path=tmp_path)
    container = _operator_container(objects)
    assert container["envFrom"] == [{"secretRef": {"name": "operator-s3"}}]
    paths = [a for a in container["args"] if a.startswith("--checkpoint-path-map")]
    assert paths == ["--checkpoint-path-map=s3://checkpoints/runs=s3://checkpoints/runs"]
    pod = _deployment(objects)["spec"]["template"]["spec"]
    assert not [v for v in pod.get("volumes", []) if v["name"] == "checkpoints"]


def test_pvc_alone_maps_its_mount_path(helm: str, tmp_path: Path) -> None:
    values = {"checkpointStorage": {"persistentVolumeClaim": {"claimName": "ckpt"}}}
    args = _operator_container(render(helm, values, tmp_path=tmp_path))["args"]
    assert [a for a in args if a.startswith("--checkpoint-path-map")] == [
        "--checkpoint-path-map=/checkpoints=/checkpoints"
    ]
    assert not [
        a for a in _operator_container(render(helm))["args"] if a.startswith("--checkpoint-path")
    ]


def test_metrics_toggles(helm: str, tmp_path: Path) -> None:
    off = render(helm, {"metrics": {"enabled": False}}, tmp_path=tmp_path)
    assert not find_objects(off, "Service")
    assert "--metrics-port=0" in _operator_container(off)["args"]
    monitor = render(
        helm,
        {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kp"}}}},
        tmp_path=tmp_path,
    )
    (sm,) = find_objects(monitor, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "kp"
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"replicaCount": "two"}, "replicaCount"),
        ({"imagee": {"repository": "x"}}, "imagee"),
        ({"watchNamespaces": ["Not_A_Namespace"]}, "watchNamespaces"),
        ({"image": {"repository": "x", "pullPolicy": "Sometimes"}}, "pullPolicy"),
        ({"health": {"port": 70000}}, "port"),
        ({"operator": {"logFormat": "xml"}}, "logFormat"),
        ({"replicaCount": 2}, "replicaCount"),
        ({"checkpointStorage": {"persistentVolumeClaim": {"mountPath": "relative"}}}, "mountPath"),
    ],
    ids=[
        "type",
        "unknown-key",
        "namespace-name",
        "enum",
        "port-range",
        "log-format",
        "replicas",
        "abs-path",
    ],
)
def test_values_schema_rejects_bad_values(
    helm: str, values: dict[str, Any], needle: str, tmp_path: Path
) -> None:
    proc = render_raw(helm, values, tmp_path=tmp_path, check=False)
    assert proc.returncode != 0, f"helm accepted {values}"
    assert needle in proc.stderr, proc.stderr


def test_serviceaccount_name_required_without_create(helm: str, tmp_path: Path) -> None:
    proc = render_raw(helm, {"serviceAccount": {"create": False}}, tmp_path=tmp_path, check=False)
    assert proc.returncode != 0
    assert "serviceAccount.name is required" in proc.stderr


def test_install_manifests_are_generated_from_chart(helm: str) -> None:
    proc = run_tool(
        sys.executable,
        str(REPO_ROOT / "scripts" / "render_manifests.py"),
        "--check",
        check=False,
        env={"HELM": helm, "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr


def test_install_manifests_content() -> None:
    docs = [
        d for d in yaml.safe_load_all((REPO_ROOT / "manifests" / "install.yaml").read_text()) if d
    ]
    assert docs[0] == {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": "preemptible-system",
            "labels": {"app.kubernetes.io/part-of": "preemptible"},
        },
    }
    crds = {d["metadata"]["name"] for d in docs if d["kind"] == "CustomResourceDefinition"}
    assert crds == {
        "trainingjobs.preemptible.dev",
        "clusterkopfpeerings.kopf.dev",
        "kopfpeerings.kopf.dev",
    }
    # Every namespaced object lands in the install namespace.
    for doc in docs:
        ns = doc["metadata"].get("namespace")
        assert ns in (None, "preemptible-system"), doc["metadata"]


def test_chart_crd_is_the_generated_one() -> None:
    """charts/.../crds/trainingjobs.yaml and manifests/crd.yaml are the same generated CRD."""
    chart_crd = CHART_DIR / "crds" / "trainingjobs.yaml"
    assert chart_crd.exists(), "run `python -m preemptible_operator.crd --write`"
    assert yaml.safe_load(chart_crd.read_text()) == yaml.safe_load(
        (REPO_ROOT / "manifests" / "crd.yaml").read_text()
    )


def test_chart_version_matches_project() -> None:
    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    version = re.search(r'^version = "([^"]+)"', pyproject, re.M)
    assert version is not None
    assert chart["appVersion"] == version.group(1)


@pytest.mark.parametrize(
    "values",
    [
        None,
        {
            "watchNamespaces": ["team-a", "team-b"],
            "operator": {"verbose": True, "logFormat": "text", "extraArgs": ["--no-scrape"]},
            "checkpointStorage": {"pathMap": {"/checkpoints": "/mnt/checkpoints"}},
        },
        {"metrics": {"enabled": False}},
    ],
    ids=["defaults", "namespaced-verbose-pathmap", "no-metrics"],
)
def test_operator_cli_accepts_the_chart_args(
    helm: str, values: dict[str, Any] | None, tmp_path: Path
) -> None:
    """The Deployment's arguments parse with the operator's own CLI parser (no drift)."""
    from preemptible_operator.cli import build_parser

    container = _operator_container(render(helm, values, tmp_path=tmp_path))
    parsed = build_parser().parse_args(container["args"])
    assert parsed.command == "run"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert parsed.liveness.endswith(f":{ports['health']}/healthz")
    if values and values.get("watchNamespaces"):
        assert parsed.namespace == values["watchNamespaces"]
        assert parsed.verbose and parsed.log_format == "text" and parsed.no_scrape
        assert parsed.checkpoint_path_map == ["/checkpoints=/mnt/checkpoints"]
    else:
        assert parsed.all_namespaces
    if "metrics" in ports:
        assert parsed.metrics_port == ports["metrics"]
    else:
        # The operator's own default would still open a port; the chart must not leave it on.
        assert parsed.metrics_port == 0


def _grants(rules: list[dict[str, Any]]) -> dict[tuple[str, str], set[str]]:
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    return granted


@pytest.mark.parametrize("mode", ["cluster-wide", "namespaced"])
def test_chart_grants_nothing_the_operator_does_not_declare(
    helm: str, mode: str, tmp_path: Path
) -> None:
    """operator/rbac.py declares the API access the operator uses; the chart grants a subset of it
    (plus the peering objects' create for its init container). The cluster tests show the subset
    suffices (test_install_cluster.py: no Forbidden in a full preemption)."""
    from preemptible_operator import rbac

    values = {"watchNamespaces": ["team-a"]} if mode == "namespaced" else None
    objects = render(helm, values, tmp_path=tmp_path)
    chart = _grants([*rules_of(objects, "ClusterRole"), *rules_of(objects, "Role")])
    declared = _grants([*rbac.NAMESPACED_RULES, *rbac.CLUSTER_RULES])
    for (group, resource), verbs in chart.items():
        if group == "kopf.dev":
            assert verbs <= {"get", "list", "watch", "patch", "create"}
            continue
        assert (group, resource) in declared, f"{group}/{resource} is not in operator/rbac.py"
        assert verbs <= declared[(group, resource)], (group, resource, verbs)


def test_priority_boost_values(helm: str, tmp_path: Path) -> None:
    """operator.priorityBoost (issue 32): off by default; on, the two operator flags."""
    assert not [a for a in _operator_container(render(helm))["args"] if "priority-boost" in a]
    on = render(
        helm, {"operator": {"priorityBoost": {"enabled": True, "max": 50}}}, tmp_path=tmp_path
    )
    args = _operator_container(on)["args"]
    assert [a for a in args if "priority-boost" in a] == [
        "--priority-boost",
        "--priority-boost-max=50",
    ]
    for bad in ({"max": 0}, {"enabled": "yes"}, {"maxx": 3}):
        proc = render_raw(
            helm, {"operator": {"priorityBoost": bad}}, tmp_path=tmp_path, check=False
        )
        assert proc.returncode != 0, bad
