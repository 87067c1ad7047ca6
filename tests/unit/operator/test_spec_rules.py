"""Spec rules: one declaration, checked by pydantic and emitted as the CRD's CEL validations."""

from __future__ import annotations

from typing import Any

import pytest

from preemptible_operator import crd, models
from preemptible_operator.spec_rules import (
    IntOrWord,
    Matches,
    NeedsItems,
    NotAbove,
    NotOneOf,
    Requires,
    Rule,
    Within,
    WordNeedsKey,
    cel_message,
    cel_string,
    render_message,
)

ORDER = NotAbove("min ({min}) must not exceed max ({max})", low="min", high="max")
RESERVED = NotOneOf("{name} is reserved", field="name", values=frozenset({"RANK", "WORLD_SIZE"}))
LABEL = Matches('"{q}" is not a label', field="q", pattern="[a-z]+")


@pytest.mark.parametrize(
    ("text", "literal"),
    [
        ("plain", "'plain'"),
        ("it's", "'it\\'s'"),
        ("back\\slash", "'back\\\\slash'"),
    ],
)
def test_cel_string_escapes(text: str, literal: str) -> None:
    assert cel_string(text) == literal


@pytest.mark.parametrize(
    ("template", "expression"),
    [
        ("no values", "'no values'"),
        ("min ({min}) > max ({max})", "'min (%s) > max (%s)'.format([self.min, self.max])"),
        ("{name} is 100% taken", "'%s is 100%% taken'.format([self.name])"),
        ("'{q}' bad", "'\\'%s\\' bad'.format([self.q])"),
    ],
)
def test_cel_message_formats_the_same_template(template: str, expression: str) -> None:
    assert cel_message(template) == expression


@pytest.mark.parametrize(
    ("rule", "values", "message"),
    [
        (ORDER, {"min": 5, "max": 5}, None),
        (ORDER, {"min": 6, "max": 5}, "min (6) must not exceed max (5)"),
        (ORDER, {"min": 6, "max": None}, None),  # absent: nothing to compare
        (RESERVED, {"name": "HF_HOME"}, None),
        (RESERVED, {"name": "RANKS"}, None),
        (RESERVED, {"name": "RANK"}, "RANK is reserved"),
        (LABEL, {"q": "abc"}, None),
        (LABEL, {"q": "abc!"}, '"abc!" is not a label'),
        (LABEL, {"q": "xabc" * 0}, '"" is not a label'),
    ],
)
def test_violation(rule: Rule, values: dict[str, Any], message: str | None) -> None:
    assert rule.violation(values) == message


@pytest.mark.parametrize(
    ("rule", "expected"),
    [
        (
            ORDER,
            {
                "rule": "!(has(self.min) && has(self.max)) || (self.min <= self.max)",
                "message": "min (<min>) must not exceed max (<max>)",
                "messageExpression": "'min (%s) must not exceed max (%s)'.format([self.min, "
                "self.max])",
                "reason": "FieldValueInvalid",
                "fieldPath": ".min",
            },
        ),
        (
            RESERVED,
            {
                "rule": "!(has(self.name)) || (!(self.name in ['RANK', 'WORLD_SIZE']))",
                "message": "<name> is reserved",
                "messageExpression": "'%s is reserved'.format([self.name])",
                "reason": "FieldValueForbidden",
                "fieldPath": ".name",
            },
        ),
        (
            LABEL,
            {
                "rule": "!(has(self.q)) || (self.q.matches('^[a-z]+$'))",
                "message": '"<q>" is not a label',
                "messageExpression": "'\"%s\" is not a label'.format([self.q])",
                "reason": "FieldValueInvalid",
                "fieldPath": ".q",
            },
        ),
    ],
)
def test_to_cel(rule: Rule, expected: dict[str, Any]) -> None:
    assert rule.to_cel() == expected


def test_render_message_uses_str() -> None:
    assert render_message("{a}/{b}", {"a": 1.5, "b": "x"}) == "1.5/x"


def _models_with_rules() -> list[type[models.BaseModel]]:
    return [
        m
        for m in (models.GracePeriodSpec, models.EnvVar, models.ElasticSpec, models.TrainingJobSpec)
        if m.rules
    ]


def _wire_fields(model: type[models.BaseModel]) -> set[str]:
    """Wire names of the model's fields, and dotted paths into its nested models."""
    names = set()
    for name, info in model.model_fields.items():
        wire = info.alias or name
        names.add(wire)
        for nested in getattr(info.annotation, "__args__", (info.annotation,)):
            if isinstance(nested, type) and issubclass(nested, models.BaseModel):
                names |= {f"{wire}.{inner}" for inner in _wire_fields(nested)}
    return names


@pytest.mark.parametrize("model", _models_with_rules(), ids=lambda m: m.__name__)
def test_every_rule_names_fields_of_its_model(model: type[models.BaseModel]) -> None:
    wire = _wire_fields(model)
    for rule in model.rules:  # type: ignore[attr-defined]
        named = set(rule.fields) | {
            value
            for key in ("unless", "other", "max_nodes")
            if isinstance(value := getattr(rule, key, ""), str) and value
        }
        assert named <= wire, (model.__name__, rule)


@pytest.mark.parametrize(
    ("path", "model"),
    [
        (("spec",), models.TrainingJobSpec),
        (("spec", "gracePeriod"), models.GracePeriodSpec),
        (("spec", "env", "[]"), models.EnvVar),
        (("spec", "elastic"), models.ElasticSpec),
    ],
)
def test_the_crd_carries_each_models_rules_where_the_model_is(
    path: tuple[str, ...], model: type[models.BaseModel]
) -> None:
    node = crd.openapi_schema()
    for key in path:
        node = node["items"] if key == "[]" else node["properties"][key]
    expected = [r.to_cel() for r in model.rules]  # type: ignore[attr-defined]
    assert expected and node["x-kubernetes-validations"] == expected


def test_rules_over_lists_and_strings_are_bounded() -> None:
    # The apiserver refuses a CRD whose rules' worst-case cost it cannot bound.
    spec = crd.openapi_schema()["properties"]["spec"]["properties"]
    assert spec["env"]["maxItems"] == models.MAX_ENV
    assert spec["env"]["items"]["properties"]["name"]["maxLength"] == models.MAX_ENV_NAME
    assert spec["queueName"]["maxLength"] == spec["priorityClass"]["maxLength"] == 63


@pytest.mark.parametrize(
    ("overrides", "location"),
    [
        ({"gracePeriod": {"min": 100, "max": 50}}, "spec.gracePeriod.min: min (100)"),
        ({"env": [{"name": "A"}, {"name": "RANK"}]}, "spec.env.1.name: RANK is set"),
        ({"queueName": "a b"}, 'spec.queueName: "a b" is not'),
    ],
)
def test_the_models_report_rule_violations_at_the_rules_field(
    overrides: dict[str, Any], location: str
) -> None:
    with pytest.raises(models.ValidationError) as info:
        models.parse_spec({"image": "i", "checkpoint": {"uri": "/c"}, **overrides})
    assert models.format_validation_error(info.value).startswith(location)


PROCS = IntOrWord("n ({n}) is bad", field="n", minimum=1, word="auto")
GPUS = WordNeedsKey("auto needs gpus", field="n", word="auto", key="gpu", maps=(("res", "limits"),))
COMMAND = NeedsItems("n ({n}) needs a command", field="n", other="command", unless=1)


class _Res:
    """Stands in for a nested model (dumped by alias, as the apiserver sees it)."""

    def __init__(self, limits: dict[str, Any] | None) -> None:
        self.limits = limits

    def model_dump(self, **_: Any) -> dict[str, Any]:
        return {"limits": self.limits} if self.limits is not None else {}


@pytest.mark.parametrize(
    ("rule", "values", "message"),
    [
        (PROCS, {"n": 1}, None),
        (PROCS, {"n": 8}, None),
        (PROCS, {"n": "auto"}, None),
        (PROCS, {"n": 0}, "n (0) is bad"),
        (PROCS, {"n": "8"}, "n (8) is bad"),  # a string is not a number, for the apiserver too
        (PROCS, {"n": True}, "n (True) is bad"),
        (PROCS, {"n": None}, None),
        (GPUS, {"n": 8, "res": None}, None),
        (GPUS, {"n": "auto", "res": _Res({"gpu": 8})}, None),
        (GPUS, {"n": "auto", "res": _Res({"cpu": 8})}, "auto needs gpus"),
        (GPUS, {"n": "auto", "res": None}, "auto needs gpus"),
        (COMMAND, {"n": 1, "command": None}, None),
        (COMMAND, {"n": 2, "command": ["python", "t.py"]}, None),
        (COMMAND, {"n": 2, "command": []}, "n (2) needs a command"),
        (COMMAND, {"n": "auto", "command": None}, "n (auto) needs a command"),
    ],
)
def test_violation_of_shape_rules(rule: Rule, values: dict[str, Any], message: str | None) -> None:
    assert rule.violation(values) == message


@pytest.mark.parametrize(
    ("rule", "cel", "path"),
    [
        (PROCS, "!(has(self.n)) || (type(self.n) == int ? self.n >= 1 : self.n == 'auto')", ".n"),
        (
            GPUS,
            "!(has(self.n)) || (!(type(self.n) == string && self.n == 'auto') || "
            "(has(self.res) && has(self.res.limits) && 'gpu' in self.res.limits))",
            ".n",
        ),
        (
            COMMAND,
            "!(has(self.n)) || ((type(self.n) == int && self.n == 1) || "
            "(has(self.command) && size(self.command) > 0))",
            ".command",
        ),
    ],
)
def test_shape_rules_to_cel(rule: Rule, cel: str, path: str) -> None:
    out = rule.to_cel()
    assert (out["rule"], out["fieldPath"]) == (cel, path)


@pytest.mark.parametrize(
    ("rule", "value", "cel", "broken"),
    [
        (
            Within("n ({n}) out of range", field="n", minimum=1, maximum=10),
            0,
            "self.n >= 1 && self.n <= 10",
            True,
        ),
        (
            Within("n ({n}) out of range", field="n", minimum=1, maximum=10),
            10,
            "self.n >= 1 && self.n <= 10",
            False,
        ),
        (
            Within("h out of range", field="h", minimum=0.0, maximum=2.5),
            2.6,
            "self.h >= 0.0 && self.h <= 2.5",
            True,
        ),
        (
            Within("h out of range", field="h", minimum=0.0, maximum=2.5),
            0,
            "self.h >= 0.0 && self.h <= 2.5",
            False,
        ),
    ],
)
def test_within_checks_and_emits_both_bounds(
    rule: Within, value: float, cel: str, broken: bool
) -> None:
    field = rule.field
    assert rule.to_cel()["rule"] == f"!(has(self.{field})) || ({cel})"
    assert rule.to_cel()["fieldPath"] == f".{field}"
    assert (rule.violation({field: value}) is not None) is broken
    assert rule.violation({field: None}) is None  # an absent optional field breaks nothing
    assert rule.schema_keywords() == {"minimum": rule.minimum, "maximum": rule.maximum}


NESTED = NotAbove("o.low ({o.low}) above top ({top})", low="o.low", high="top", unless="o.high")
NEEDS_QUEUE = Requires("o needs q", field="o", other="q")


@pytest.mark.parametrize(
    ("rule", "values", "message"),
    [
        (NESTED, {"o": {"low": 2}, "top": 3}, None),
        (NESTED, {"o": {"low": 4}, "top": 3}, "o.low (4) above top (3)"),
        (NESTED, {"o": _Res({"x": 1}), "top": 3}, None),  # a nested model without the field
        (NESTED, {"o": {"low": 4, "high": 9}, "top": 3}, None),  # the other bound replaces top
        (NESTED, {"o": None, "top": 3}, None),
        (NEEDS_QUEUE, {"o": {"low": 1}, "q": "team"}, None),
        (NEEDS_QUEUE, {"o": {"low": 1}, "q": None}, "o needs q"),
        (NEEDS_QUEUE, {"o": {"low": 1}, "q": ""}, "o needs q"),
        (NEEDS_QUEUE, {"o": None, "q": None}, None),
    ],
)
def test_violation_of_rules_over_nested_fields(
    rule: Rule, values: dict[str, Any], message: str | None
) -> None:
    assert rule.violation(values) == message


def test_cel_of_a_nested_rule_tests_each_parent_once() -> None:
    out = NESTED.to_cel()
    assert out["rule"] == (
        "!(has(self.o) && has(self.o.low) && has(self.top)) || "
        "((has(self.o) && has(self.o.high)) || self.o.low <= self.top)"
    )
    assert out["messageExpression"] == "'o.low (%s) above top (%s)'.format([self.o.low, self.top])"
    assert out["fieldPath"] == ".o.low"
