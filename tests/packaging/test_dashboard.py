"""The Grafana dashboard shipped with the chart: every PromQL query names only series our code
exports (derived from the operator's and the runtime's metric objects, not a hand list), every
panel shows at least one of them, the chart ships it as a sidecar ConfigMap only when asked, and
docs/install.md lists exactly its panels."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.metrics import MetricWrapperBase

from preemptible_operator import metrics as operator_metrics
from tests.packaging.chart import CHART_DIR, find_objects, render
from tests.packaging.tools import REPO_ROOT, require_tool
from trainer_runtime.metrics import TrainingMetrics

DASHBOARD = CHART_DIR / "dashboards" / "preemptible.json"

# PromQL words that are not series: functions, aggregations, keywords (what the dashboard uses
# and their close relatives; an unknown word fails the test, which is the point).
PROMQL_WORDS = frozenset(
    {
        "sum", "max", "min", "avg", "count", "topk", "bottomk", "quantile", "stddev", "group",
        "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
        "and", "or", "unless", "rate", "irate", "increase", "delta", "idelta", "deriv",
        "histogram_quantile", "max_over_time", "min_over_time", "avg_over_time", "last_over_time",
        "sum_over_time", "clamp_min", "clamp_max", "abs", "ceil", "floor", "round", "time",
        "vector", "scalar", "label_replace", "absent", "changes", "resets", "sort", "sort_desc",
        "inf", "nan", "le",
    }
)  # fmt: skip

_SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
}


def _series_of(families: Any) -> set[str]:
    names = set()
    for family in families:
        names.update(family.name + suffix for suffix in _SAMPLE_SUFFIXES[family.type])
        names.update(sample.name for sample in family.samples)
    return names


def exported_series() -> set[str]:
    """Every series name the operator (module-level metric objects of operator/metrics.py) and a
    training process (trainer_runtime.metrics.TrainingMetrics) can serve."""
    names: set[str] = set()
    for value in vars(operator_metrics).values():
        if isinstance(value, MetricWrapperBase):
            names |= _series_of(value.describe())
    names |= _series_of(TrainingMetrics().registry.collect())
    return names


def _strip(expr: str) -> str:
    """The expression without what cannot name a series: strings, label matchers, ranges,
    grouping clauses, Grafana variables, numbers."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', " ", expr)
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\$\{?\w+\}?", " ", expr)
    return re.sub(r"\b\d+(\.\d+)?([eE][-+]?\d+)?\b", " ", expr)


def unknown_series(expr: str, exported: set[str]) -> tuple[set[str], set[str]]:
    """(series named by ``expr``, words in it that are neither PromQL nor exported series)."""
    label_values = re.fullmatch(r"\s*label_values\((.*),\s*\w+\)\s*", expr)
    if label_values:  # Grafana's variable query: the label after the comma is no series
        expr = label_values.group(1)
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", _strip(expr)))
    named = words - PROMQL_WORDS
    return named & exported, named - exported


def _queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    found = []
    for panel in dashboard["panels"]:
        found += [(panel["title"], t["expr"]) for t in panel.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var.get("type") == "query":
            found.append((f"variable {var['name']}", var["query"]))
    return found


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def exported() -> set[str]:
    return exported_series()


def test_exported_series_come_from_the_code(exported: set[str]) -> None:
    """The derivation sees both halves and each metric type's sample names."""
    assert "preemptible_operator_preemptions_total" in exported  # counter
    assert "preemptible_operator_queue_wait_seconds_bucket" in exported  # histogram
    assert "preemptible_operator_attempt" in exported  # gauge with labels
    assert "preemptible_step_seconds_ema" in exported  # the runtime's own registry
    assert "preemptible_operator_preemptions" not in exported  # a counter's family name
    assert not any(n.startswith(("process_", "python_")) for n in exported)


@pytest.mark.parametrize(
    ("expr", "named", "unknown"),
    [
        (
            'sum by (reason) (increase(preemptible_operator_preemptions_total{a="b c"}[5m]))',
            {"preemptible_operator_preemptions_total"},
            set(),
        ),
        ("rate(preemptible_operator_preemptions[5m])", set(), {"preemptible_operator_preemptions"}),
        ("max(preemptible_step_seconds_avg) > 2", set(), {"preemptible_step_seconds_avg"}),
        (
            'label_values(preemptible_operator_attempt{namespace=~"$namespace"}, name)',
            {"preemptible_operator_attempt"},
            set(),
        ),
        ("histogram_quantile(0.9, sum by (le) (rate(x_bucket[5m])))", set(), {"x_bucket"}),
    ],
    ids=["known", "counter-without-total", "misspelt", "grafana-variable", "foreign"],
)  # fmt: skip
def test_unknown_series_checker(expr: str, named: set[str], unknown: set[str], exported) -> None:
    assert unknown_series(expr, exported) == (named, unknown)


def test_every_query_names_only_exported_series(dashboard: dict[str, Any], exported) -> None:
    problems = []
    for where, expr in _queries(dashboard):
        named, unknown = unknown_series(expr, exported)
        if unknown or not named:
            problems.append(f"{where}: {expr!r} names {sorted(unknown) or 'no exported series'}")
    assert not problems, "\n".join(problems)


def test_every_panel_shows_exported_series(dashboard: dict[str, Any], exported) -> None:
    for panel in dashboard["panels"]:
        assert panel.get("targets"), panel["title"]
        named = set().union(*(unknown_series(t["expr"], exported)[0] for t in panel["targets"]))
        assert named, panel["title"]


def test_dashboard_covers_what_operators_look_at(dashboard: dict[str, Any]) -> None:
    """The issue's list: preemptions and reasons, lost steps, grace vs SIGTERM-to-exit, save and
    step times, attempts per job, queue wait, operator reconcile errors."""
    series = " ".join(expr for _, expr in _queries(dashboard))
    for needed in (
        "preemptible_operator_preemptions_total",
        "preemptible_operator_lost_steps_total",
        "preemptible_operator_attempt_grace_seconds",
        "preemptible_operator_sigterm_to_exit_seconds",
        "preemptible_step_seconds_",
        "preemptible_save_seconds_",
        "preemptible_operator_attempt{",
        "preemptible_operator_queue_wait_seconds_bucket",
        "preemptible_operator_reconcile_errors_total",
    ):
        assert needed in series, needed
    assert "by (reason)" in series
    # Unique ids, panels inside a 24-column grid, variables the queries use are defined.
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert all(p["gridPos"]["x"] + p["gridPos"]["w"] <= 24 for p in dashboard["panels"])
    defined = {v["name"] for v in dashboard["templating"]["list"]}
    used = set(re.findall(r"\$(\w+)", json.dumps(dashboard["panels"])))
    assert used - {"__rate_interval", "__range", "__interval"} <= defined


def test_docs_list_every_panel(dashboard: dict[str, Any]) -> None:
    """docs/install.md's panel table names exactly the dashboard's panels, in order."""
    text = (REPO_ROOT / "docs" / "install.md").read_text()
    section = text.split("### Grafana dashboard", 1)[1].split("\n#", 1)[0]
    listed = re.findall(r"^\| \*\*(.+?)\*\* \|", section, flags=re.M)
    assert listed == [p["title"] for p in dashboard["panels"]]


# ----------------------------------------------------------------------------------- the chart


@pytest.fixture(scope="module")
def helm() -> str:
    return require_tool("helm")


def test_chart_ships_no_dashboard_by_default(helm: str) -> None:
    assert not find_objects(render(helm), "ConfigMap")
    assert not find_objects(render(helm), "PodMonitor")


def test_chart_ships_the_dashboard_configmap(helm: str, tmp_path: Path) -> None:
    values = {
        "grafana": {
            "dashboard": {
                "enabled": True,
                "namespace": "monitoring",
                "annotations": {"grafana_folder": "Training"},
            }
        }
    }
    (cm,) = find_objects(render(helm, values, tmp_path=tmp_path), "ConfigMap")
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "Training"}
    assert json.loads(cm["data"]["preemptible.json"]) == json.loads(DASHBOARD.read_text())


def test_sidecar_label_is_configurable(helm: str, tmp_path: Path) -> None:
    values = {"grafana": {"dashboard": {"enabled": True, "label": "dash", "labelValue": "yes"}}}
    (cm,) = find_objects(render(helm, values, tmp_path=tmp_path), "ConfigMap")
    assert cm["metadata"]["labels"]["dash"] == "yes"
    assert "grafana_dashboard" not in cm["metadata"]["labels"]
    assert cm["metadata"]["namespace"] == "preemptible-system"


@pytest.mark.parametrize("namespaced", [False, True], ids=["cluster-wide", "namespaced"])
def test_pod_monitor_labels_training_pods_by_job(
    helm: str, tmp_path: Path, namespaced: bool
) -> None:
    """The runtime panels filter on name=<TrainingJob>: the PodMonitor copies the operator's pod
    label into it; the operator's ServiceMonitor keeps the series' own namespace/name."""
    from preemptible_operator import render as op_render

    values: dict[str, Any] = {
        "metrics": {"podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": True}}
    }
    if namespaced:
        values["watchNamespaces"] = ["team-a"]
    objects = render(helm, values, tmp_path=tmp_path)
    (pm,) = find_objects(objects, "PodMonitor")
    (expr,) = pm["spec"]["selector"]["matchExpressions"]
    assert expr == {"key": op_render.LABEL_TRAINING_JOB, "operator": "Exists"}
    selector = pm["spec"]["namespaceSelector"]
    assert selector == ({"matchNames": ["team-a"]} if namespaced else {"any": True})
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics"
    meta = "__meta_kubernetes_pod_label_" + re.sub(r"[^a-z0-9]", "_", op_render.LABEL_TRAINING_JOB)
    assert {"sourceLabels": [meta], "targetLabel": "name"} in endpoint["relabelings"]
    (sm,) = find_objects(objects, "ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["honorLabels"] is True
