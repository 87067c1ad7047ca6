"""Semantic rules of the TrainingJob spec, declared once and checked in two places.

A model lists its rules in ``rules``; pydantic checks them when the operator parses an object
(``models._Model``), and the CRD carries them as CEL ``x-kubernetes-validations`` (the models'
JSON schema, hence ``crd.py``), so ``kubectl apply``/``edit`` of a violating object is refused by
the apiserver with the same message the operator would give. Only rules over a model's own fields
live here; bounds of a single number or string length are plain schema keywords (``Field(ge=...)``,
``max_length``) that pydantic and the apiserver both enforce.

Messages are templates: ``{field}`` is the field's value (wire name, camelCase). Python formats
it with ``str``; CEL with ``%s`` of ``format``, which prints ints and strings the same way.
A field of a nested object is named by its dotted path (``elastic.minNodes``): a rule over a
nested object and the fields around it belongs to the model that holds both.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from trainer_runtime.elastic import sizes_keeping_global_batch

__all__ = [
    "MAX_ELASTIC_NODES",
    "ExcludesItems",
    "IntOrWord",
    "KeepsGlobalBatch",
    "Matches",
    "NeedsItems",
    "NotAbove",
    "NotOneOf",
    "Requires",
    "Rule",
    "Within",
    "WordNeedsKey",
    "cel_message",
    "cel_string",
    "render_message",
]

CelReason = Literal["FieldValueInvalid", "FieldValueForbidden"]

_PLACEHOLDER = re.compile(r"\{([A-Za-z][A-Za-z0-9.]*)\}")


def cel_string(text: str) -> str:
    """A CEL string literal (single-quoted) for ``text``."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def render_message(template: str, values: Mapping[str, Any]) -> str:
    """The message as Python shows it: each ``{field}`` replaced by ``str(value)``."""
    return _PLACEHOLDER.sub(lambda m: str(lookup(values, m.group(1))), template)


def lookup(values: Mapping[str, Any], path: str) -> Any:
    """The value at a wire name or a dotted path into nested objects (None when absent)."""
    if path in values:
        return values[path]
    head, _, rest = path.partition(".")
    if not rest:
        return None
    inner = _wire(values.get(head))
    return lookup(inner, rest) if isinstance(inner, Mapping) else None


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


def _has_terms(path: str) -> list[str]:
    # has() of a nested field needs its parents present (else the access is an error, not false).
    parts = path.split(".")
    return [f"has(self.{'.'.join(parts[: i + 1])})" for i in range(len(parts))]


def _has(path: str) -> str:
    return " && ".join(_has_terms(path))


def _present(fields: Iterable[str]) -> str:
    # A field the object leaves out has no rule to break (defaults are applied before validation;
    # optional fields without a default may really be absent).
    terms = [term for f in fields for term in _has_terms(f)]
    return " && ".join(dict.fromkeys(terms))


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
        if any(lookup(values, f) is None for f in self.fields) or self.holds(values):
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

    unless: str = ""
    """A field whose presence makes the rule moot (e.g. ``elastic.maxNodes``, which replaces
    ``high`` as the bound when set); empty: none."""

    def holds(self, values: Mapping[str, Any]) -> bool:
        if self.unless and lookup(values, self.unless) is not None:
            return True
        return bool(lookup(values, self.low) <= lookup(values, self.high))

    def cel_condition(self) -> str:
        check = f"self.{self.low} <= self.{self.high}"
        return f"({_has(self.unless)}) || {check}" if self.unless else check


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


@dataclass(frozen=True)
class Requires(FieldRule):
    """When the field is present, the string field ``other`` is set and not empty."""

    other: str = ""

    @property
    def field_path(self) -> str | None:
        return self.other  # what is missing

    def holds(self, values: Mapping[str, Any]) -> bool:
        return bool(lookup(values, self.other))

    def cel_condition(self) -> str:
        return f"{_has(self.other)} && size(self.{self.other}) > 0"


# The most nodes an elastic range may name (spec.elastic.maxNodes' schema maximum): CEL has no
# range(), so the sizes the global-batch rule tries are a literal list of 1..this, which keeps
# the rule's cost fixed and small. (The `lists` library's range() is not in every apiserver the
# chart supports.)
MAX_ELASTIC_NODES = 1024
_SIZES = "[" + ", ".join(str(n) for n in range(1, MAX_ELASTIC_NODES + 1)) + "]"


@dataclass(frozen=True)
class KeepsGlobalBatch(Rule):
    """Some size in ``[min_nodes, max_nodes]`` (``max_nodes`` absent: ``nodes``) keeps the global
    batch of ``nodes`` nodes accumulating ``accumulation`` micro-batches: it divides
    ``nodes x accumulation`` (``trainer_runtime.elastic``). The message lists the range, the
    product and every size up to ``MAX_ELASTIC_NODES`` that divides it. ``message`` is unused:
    the values it shows are computed (the same way in Python and CEL), so the class words it."""

    message: str = ""
    nodes: str = ""
    min_nodes: str = ""
    max_nodes: str = ""
    accumulation: str = ""

    @property
    def fields(self) -> tuple[str, ...]:
        return (self.min_nodes, self.nodes, self.accumulation)

    @property
    def field_path(self) -> str | None:
        return self.min_nodes.rpartition(".")[0] or None  # the object the range lies in

    _TEXT = (
        "the range {min_name}..{max_name} ({max_name} default {nodes_name}) = [{min}, {max}] "
        "holds no size that keeps the global batch of {nodes_name} ({nodes}) x {acc_name} ({acc}) "
        "= {total} node micro-batches per optimizer step: a size must divide {total}; sizes that "
        "do: {sizes}; widen the range to include one, or change {acc_name}"
    )

    def _words(self, **values: Any) -> str:
        names = {
            "min_name": self.min_nodes,
            "max_name": self.max_nodes.rpartition(".")[2],
            "nodes_name": self.nodes,
            "acc_name": self.accumulation,
        }
        return self._TEXT.format(**names, **values)

    def _bounds(self, values: Mapping[str, Any]) -> tuple[int, int, int, int]:
        low = lookup(values, self.min_nodes)
        nodes = lookup(values, self.nodes)
        high = lookup(values, self.max_nodes)
        return low, nodes if high is None else high, nodes, lookup(values, self.accumulation)

    def holds(self, values: Mapping[str, Any]) -> bool:
        low, high, nodes, accumulation = self._bounds(values)
        if low > high:
            return True  # an empty range is another rule's message
        return bool(sizes_keeping_global_batch(nodes, accumulation, low, high))

    def violation(self, values: Mapping[str, Any]) -> str | None:
        if any(lookup(values, f) is None for f in self.fields) or self.holds(values):
            return None
        low, high, nodes, accumulation = self._bounds(values)
        total = nodes * accumulation
        works = sizes_keeping_global_batch(nodes, accumulation, 1, min(total, MAX_ELASTIC_NODES))
        return self._words(
            min=low,
            max=high,
            nodes=nodes,
            acc=accumulation,
            total=total,
            sizes="[" + ", ".join(map(str, works)) + "]",  # as CEL's format prints a list
        )

    def _cel_parts(self) -> tuple[str, str, str, str]:
        low, nodes, acc = (f"self.{f}" for f in (self.min_nodes, self.nodes, self.accumulation))
        high = f"({_has(self.max_nodes)} ? self.{self.max_nodes} : {nodes})"
        return low, high, nodes, f"({nodes} * {acc})"

    def cel_condition(self) -> str:
        low, high, nodes, total = self._cel_parts()
        # numNodes itself always divides the product: a range holding it needs no search (and
        # the only ranges past MAX_ELASTIC_NODES hold it: maxNodes is bounded by it).
        return (
            f"{low} > {high} || ({low} <= {nodes} && {nodes} <= {high}) || "
            f"{_SIZES}.exists(n, n >= {low} && n <= {high} && {total} % n == 0)"
        )

    def to_cel(self) -> dict[str, Any]:
        out = super().to_cel()
        low, high, nodes, total = self._cel_parts()
        exprs = {
            "min": low,
            "max": high,
            "nodes": nodes,
            "acc": f"self.{self.accumulation}",
            "total": total,
            "sizes": f"{_SIZES}.filter(n, {total} % n == 0)",
        }
        # One format argument per placeholder, in the order the text shows them.
        order = [m for m in re.findall(r"\{([a-z_]+)\}", self._TEXT) if m in exprs]
        template = self._words(**{k: "\0" for k in exprs})
        literal = cel_string(template.replace("%", "%%").replace("\0", "%s"))
        out["message"] = self._words(**{k: f"<{k}>" for k in exprs})
        out["messageExpression"] = f"{literal}.format([{', '.join(exprs[k] for k in order)}])"
        return out
