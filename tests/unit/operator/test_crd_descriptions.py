"""`kubectl explain trainingjob.spec...` has something to say about every field: each property of
the generated schema carries a description, and that description is the field's docstring in
operator/models.py (the single source), not text written into the CRD by hand."""

from __future__ import annotations

import typing
from typing import Any

import pytest
from pydantic import BaseModel

from preemptible_operator import crd, models


def test_every_field_of_the_generated_schema_has_a_description() -> None:
    missing = crd.missing_descriptions(crd.openapi_schema())
    assert missing == [], (
        f"fields without a description (kubectl explain shows nothing for them): {missing}; "
        "add a docstring under each field in operator/models.py and run "
        "`python -m preemptible_operator.crd --write`"
    )


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        ({"description": "root", "properties": {"a": {"type": "string"}}}, ["trainingjob.a"]),
        ({"properties": {"a": {"description": "x"}}}, ["trainingjob"]),
        (
            {
                "description": "root",
                "properties": {
                    "list": {
                        "description": "a list",
                        "items": {"properties": {"b": {"description": "  "}}},
                    },
                    "map": {
                        "description": "a map",
                        "additionalProperties": {"properties": {"c": {}}},
                    },
                },
            },
            ["trainingjob.list[].b", "trainingjob.map{}.c"],
        ),
        # scalar items and values are explained by their field's description
        (
            {
                "description": "root",
                "properties": {"args": {"description": "args", "items": {"type": "string"}}},
            },
            [],
        ),
    ],
    ids=["property", "root", "nested-in-items-and-maps", "scalar-items"],
)
def test_missing_descriptions_finds_each_undocumented_field(
    schema: dict[str, Any], expected: list[str]
) -> None:
    assert crd.missing_descriptions(schema) == expected


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside X, X | None, list[X]."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _pairs(model: type[BaseModel], schema: dict[str, Any], path: str):
    """(path, field docstring, schema description) for every field, recursively."""
    for name, field in model.model_fields.items():
        alias = field.alias or name
        node = schema["properties"][alias]
        yield f"{path}.{alias}", field.description, node.get("description")
        sub = _model_of(field.annotation)
        if sub is not None:
            yield from _pairs(sub, node.get("items", node), f"{path}.{alias}")


@pytest.mark.parametrize("part", ["spec", "status"])
def test_descriptions_are_the_models_docstrings(part: str) -> None:
    model = models.TrainingJobSpec if part == "spec" else models.TrainingJobStatus
    schema = crd.openapi_schema()["properties"][part]
    pairs = list(_pairs(model, schema, part))
    assert len(pairs) > 20
    for path, docstring, description in pairs:
        assert docstring, f"{path}: the model field has no docstring"
        assert description == " ".join(docstring.split()), path
