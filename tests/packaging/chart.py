"""Rendering the Helm chart for tests: `helm template` with values, parsed into objects."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from tests.packaging.tools import REPO_ROOT, run_tool

__all__ = ["CHART_DIR", "find_objects", "is_user_role", "render", "render_raw", "rules_of"]

CHART_DIR = REPO_ROOT / "charts" / "preemptible"


def render_raw(
    helm: str,
    values: dict[str, Any] | None = None,
    *,
    release: str = "preemptible",
    namespace: str = "preemptible-system",
    include_crds: bool = False,
    tmp_path: Path | None = None,
    check: bool = True,
):
    """Run `helm template` with ``values`` (written to a file: no --set quoting surprises)."""
    args = [helm, "template", release, str(CHART_DIR), "--namespace", namespace]
    if include_crds:
        args.append("--include-crds")
    if values:
        assert tmp_path is not None, "values need a tmp_path to be written to"
        values_file = tmp_path / "values.json"
        values_file.write_text(json.dumps(values))
        args += ["--values", str(values_file)]
    return run_tool(*args, check=check)


def render(helm: str, values: dict[str, Any] | None = None, **kwargs: Any) -> list[dict[str, Any]]:
    """The rendered objects (empty documents dropped)."""
    proc = render_raw(helm, values, **kwargs)
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def find_objects(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o.get("kind") == kind]


def is_user_role(obj: dict[str, Any]) -> bool:
    """A ClusterRole aggregated into the built-in admin/edit/view roles: users' access to
    TrainingJobs, granted to no ServiceAccount of the chart."""
    labels = obj.get("metadata", {}).get("labels") or {}
    return any(k.startswith("rbac.authorization.k8s.io/aggregate-to-") for k in labels)


def rules_of(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """All rules of every object of ``kind`` (Role or ClusterRole) the operator is bound to
    (the aggregated user roles left out)."""
    return [
        rule
        for obj in find_objects(objects, kind)
        if not is_user_role(obj)
        for rule in obj.get("rules", [])
    ]
