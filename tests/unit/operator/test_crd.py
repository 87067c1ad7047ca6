"""The checked-in CRD YAML is what the models generate, and it is a structural schema."""

from __future__ import annotations

from typing import Any

import yaml

from preemptible_operator import crd


def test_checked_in_crd_files_match_the_models() -> None:
    problems = crd.check_files()
    assert not problems, "; ".join(problems) + " -- run: python -m preemptible_operator.crd --write"


def test_both_files_parse_to_the_same_object() -> None:
    objs = [yaml.safe_load(p.read_text()) for p in crd.CRD_PATHS]
    assert objs[0] == objs[1] == crd.build_crd()


def _walk(node: dict[str, Any], path: str = "") -> list[str]:
    """Violations of the structural-schema rules the apiserver enforces."""
    bad = []
    allowed_untyped = node.get("x-kubernetes-int-or-string") or node.get(
        "x-kubernetes-preserve-unknown-fields"
    )
    if "type" not in node and not allowed_untyped:
        bad.append(f"{path or '/'}: no type")
    for key in ("$ref", "anyOf", "oneOf", "allOf", "$defs", "title", "const"):
        if key in node:
            bad.append(f"{path}: has {key}")
    if node.get("default", 0) is None:
        bad.append(f"{path}: null default")
    for name, child in (node.get("properties") or {}).items():
        bad.extend(_walk(child, f"{path}.{name}"))
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            bad.extend(_walk(node[key], f"{path}[{key}]"))
    return bad


def test_schema_is_structural() -> None:
    schema = crd.openapi_schema()
    assert _walk(schema) == []


def test_crd_shape_printer_columns_status_and_short_name() -> None:
    obj = crd.build_crd()
    assert obj["metadata"]["name"] == "trainingjobs.preemptible.dev"
    assert obj["spec"]["names"]["shortNames"] == ["tj"]
    (version,) = obj["spec"]["versions"]
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == [
        "Phase",
        "Step",
        "Checkpoint",
        "Attempt",
        "Nodes",
        "Preemptions",
        "Grace",
        "Save-Every",
        "Progress",
        "Remaining",
        "Age",
    ]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert set(spec["required"]) == {"image", "checkpoint"}
    assert spec["properties"]["numNodes"]["default"] == 1
    assert spec["properties"]["podTemplate"]["properties"]["spec"][
        "x-kubernetes-preserve-unknown-fields"
    ]
    requests = spec["properties"]["resourcesPerNode"]["properties"]["requests"]
    assert requests["additionalProperties"] == {"x-kubernetes-int-or-string": True}


def test_check_reports_drift(tmp_path: Any) -> None:
    path = tmp_path / "crd.yaml"
    assert crd.check_files((path,)) == [f"{path} is missing"]
    crd.write_files((path,))
    assert crd.check_files((path,)) == []
    path.write_text(path.read_text().replace("shortNames", "shortNamez"))
    assert "differs" in crd.check_files((path,))[0]
