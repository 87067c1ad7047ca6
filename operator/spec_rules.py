"""Semantic rules of the TrainingJob spec, declared once and checked in two places.

A model lists its rules in ``rules``; pydantic checks them when the operator parses an object
(``models._Model``), and the CRD carries them as CEL ``x-kubernetes-validations`` (the models'
JSON schema, hence ``crd.py``), so ``kubectl apply``/``edit`` of a violating object is refused by
the apiserver with the same message the operator would give. Only rules over a model's own fields
live here; bounds of a single number or string length are plain schema keywords (``Field(ge=...)``,
``max_length``) that pydantic and the apiserver both enforce.

Messages are templates: ``{field}`` is the field's value (wire name, camelCase). Python formats
it with ``str``; CEL with ``%s`` of ``format``, which prints ints and strings the same way.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "ExcludesItems",
    "IntOrWord",
    "Matches",
    "NeedsItems",
    "NotAbove",
    "NotOneOf",
    "Rule",
    "Within",
    "WordNeedsKey",
    "cel_message",
    "cel_string",
    "render_message",
]

CelReason = Literal["FieldValueInvalid", "FieldValueForbidden"]

_PLACEHOLDER = re.compile(r"\{([A-Za-z][A-Za-z0-9]*)\}")


def cel_string(text: str) -> str:
    """A CEL string literal (single-quoted) for ``text``."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def render_message(template: str, values: Mapping[str, Any]) -> str:
    """The message as Python shows it: each ``{field}`` replaced by ``str(value)``."""
    return _PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), template)


def cel_message(template: str) -> str:
    """The same message as a CEL ``messageExpression``: ``'...%s...'.format([self.f, ...])``.
    (``string(x)`` or ``+`` over it would be cheaper to read, but the apiserver cannot bound the
    size of ``string()``'s result and refuses the CRD as over its cost budget; ``format`` it can.)
    """
    fields = _PLACEHOLDER.findall(template)
    literal = _PLACEHOLDER.sub("%s", template.replace("%", "%%"))
    if not fields:
        return cel_string(template)
    args = ", ".join(f"self.{f}" for f in fields)
    return f"{cel_string(literal)}.format([{args}])"


def _present(fields: Iterable[str]) -> str:
    # A field the object leaves out has no rule to break (defaults are applied before validation;
    # optional fields without a default may really be absent).
    return " && ".join(f"has(self.{f})" for f in fields)


@dataclass(frozen=True)
class Rule:
    """A check over one model's fields (wire names). Subclasses define the Python check and its
    CEL form; the message template is shared."""

    message: str
    """Template naming the field, the value (``{field}``) and the fix."""

    @property
    def fields(self) -> tuple[str, ...]:
        raise NotImplementedError

    @property
    def field_path(self) -> str | None:
        """The field the apiserver's error names (relative to the model), if one field."""
        return None

    reason: CelReason = "FieldValueInvalid"

    def holds(self, values: Mapping[str, Any]) -> bool:
        raise NotImplementedError

    def cel_condition(self) -> str:
        raise NotImplementedError

    def violation(self, values: Mapping[str, Any]) -> str | None:
        """The message when ``values`` (wire name -> value) break the rule, else None."""
        if any(values.get(f) is None for f in self.fields) or self.holds(values):
            return None
        return render_message(self.message, values)

    def to_cel(self) -> dict[str, Any]:
        """The ``x-kubernetes-validations`` entry."""
        rule = f"!({_present(self.fields)}) || ({self.cel_condition()})"
        out: dict[str, Any] = {
            "rule": rule,
            "message": render_message(self.message, {f: f"<{f}>" for f in self.fields}),
            "messageExpression": cel_message(self.message),
            "reason": self.reason,
        }
        if self.field_path:
            out["fieldPath"] = f".{self.field_path}"
        return out


@dataclass(frozen=True)
class NotAbove(Rule):
    """``low <= high`` (two numeric fields of the same model)."""

    low: str = ""
    high: str = ""

    @property
    def fields(self) -> tuple[str, ...]:
        return (self.low, self.high)

    @property
    def field_path(self) -> str | None:
        return self.low

    def holds(self, values: Mapping[str, Any]) -> bool:
        return bool(values[self.low] <= values[self.high])

    def cel_condition(self) -> str:
        return f"self.{self.low} <= self.{self.high}"


@dataclass(frozen=True)
class FieldRule(Rule):
    """A rule over one field, which the apiserver's error names."""

    field: str = ""

    @property
    def fields(self) -> tuple[str, ...]:
        return (self.field,)

    @property
    def field_path(self) -> str | None:
        return self.field


@dataclass(frozen=True)
class NotOneOf(FieldRule):
    """A string field must not take any of ``values``."""

    values: frozenset[str] = frozenset()
    reason: CelReason = "FieldValueForbidden"

    def holds(self, values: Mapping[str, Any]) -> bool:
        return values[self.field] not in self.values

    def cel_condition(self) -> str:
        listed = ", ".join(cel_string(v) for v in sorted(self.values))
        return f"!(self.{self.field} in [{listed}])"


@dataclass(frozen=True)
class Matches(FieldRule):
    """A string field must match ``pattern`` (anchored; RE2 and Python ``re`` alike)."""

    pattern: str = ""

    def holds(self, values: Mapping[str, Any]) -> bool:
        return re.fullmatch(self.pattern, values[self.field]) is not None

    def cel_condition(self) -> str:
        return f"self.{self.field}.matches({cel_string('^' + self.pattern + '$')})"


def _cel_number(value: float) -> str:
    # A `number` field is a CEL double, an `integer` one an int: the literal must match (CEL
    # compares across the two only in newer versions than the apiserver may run).
    return repr(float(value)) if isinstance(value, float) else str(int(value))


@dataclass(frozen=True)
class Within(FieldRule):
    """A number field lies in ``[minimum, maximum]`` (both ints for an integer field, both
    floats for a number field). The model's schema gets ``minimum``/``maximum`` too
    (``schema_keywords``), so the apiserver refuses it twice: with its own words and with this
    message, which names the field, the bounds and the fix."""

    minimum: float = 0
    maximum: float = 0

    def holds(self, values: Mapping[str, Any]) -> bool:
        return bool(self.minimum <= values[self.field] <= self.maximum)

    def cel_condition(self) -> str:
        f = self.field
        low, high = _cel_number(self.minimum), _cel_number(self.maximum)
        return f"self.{f} >= {low} && self.{f} <= {high}"

    def schema_keywords(self) -> dict[str, Any]:
        """Keywords for the field's own schema."""
        return {"minimum": self.minimum, "maximum": self.maximum}


def _wire(value: Any) -> Any:
    """A nested model as the apiserver sees it (camelCase dict); anything else as it is."""
    dump = getattr(value, "model_dump", None)
    return dump(by_alias=True, exclude_none=True) if callable(dump) else value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _cel_is_int(field: str) -> str:
    # An int-or-string field is dynamic in CEL: test its type before comparing it with a number
    # or a string (a comparison across types is an evaluation error, not false).
    return f"type(self.{field}) == int"


@dataclass(frozen=True)
class IntOrWord(FieldRule):
    """An int-or-string field: an integer ``>= minimum``, or exactly ``word``."""

    minimum: int = 1
    word: str = ""

    def holds(self, values: Mapping[str, Any]) -> bool:
        value = values[self.field]
        return (_is_int(value) and value >= self.minimum) or value == self.word

    def cel_condition(self) -> str:
        f = self.field
        word = cel_string(self.word)
        return f"{_cel_is_int(f)} ? self.{f} >= {self.minimum} : self.{f} == {word}"


@dataclass(frozen=True)
class WordNeedsKey(FieldRule):
    """When the field is ``word``, one of the maps ``maps`` (``(object, map)`` field names of the
    same model, e.g. ``("resourcesPerNode", "limits")``) has ``key``."""

    word: str = ""
    key: str = ""
    maps: tuple[tuple[str, str], ...] = ()

    def holds(self, values: Mapping[str, Any]) -> bool:
        if values[self.field] != self.word:
            return True
        for obj, name in self.maps:
            found = _wire(values.get(obj)) or {}
            if self.key in (found.get(name) or {}):
                return True
        return False

    def cel_condition(self) -> str:
        f = self.field
        has_key = " || ".join(
            f"(has(self.{obj}) && has(self.{obj}.{name}) && "
            f"{cel_string(self.key)} in self.{obj}.{name})"
            for obj, name in self.maps
        )
        return f"!(type(self.{f}) == string && self.{f} == {cel_string(self.word)}) || {has_key}"


@dataclass(frozen=True)
class NeedsItems(FieldRule):
    """When the field is present and not the integer ``unless``, the list field ``other`` of
    the same model has at least one item."""

    other: str = ""
    unless: int = 1

    @property
    def field_path(self) -> str | None:
        return self.other  # what is missing

    def holds(self, values: Mapping[str, Any]) -> bool:
        value = values[self.field]
        return (_is_int(value) and value == self.unless) or bool(values.get(self.other))

    def cel_condition(self) -> str:
        f, o = self.field, self.other
        return (
            f"({_cel_is_int(f)} && self.{f} == {self.unless}) || "
            f"(has(self.{o}) && size(self.{o}) > 0)"
        )


@dataclass(frozen=True)
class ExcludesItems(FieldRule):
    """A list field must not contain any of ``values`` (integers)."""

    values: tuple[int, ...] = ()
    reason: CelReason = "FieldValueForbidden"

    def holds(self, values: Mapping[str, Any]) -> bool:
        return not any(v in self.values for v in values[self.field])

    def cel_condition(self) -> str:
        listed = ", ".join(str(v) for v in self.values)
        return f"!self.{self.field}.exists(v, v in [{listed}])"
