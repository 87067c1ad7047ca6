"""The spec a pass works with (pure): a spec of a newer CRD is parsed without the fields this
operator does not know, an invalid edit of a job that has run is rejected in favour of the spec
the current attempt's Job was created from (tests/unit/operator/test_pass_spec.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from preemptible_operator import models, render

__all__ = [
    "PassSpec",
    "parse_spec_tolerant",
    "pass_spec",
    "spec_of_job",
]


def parse_spec_tolerant(
    raw: dict[str, Any] | None,
) -> tuple[models.TrainingJobSpec | None, str | None, str | None]:
    """(spec, why it is invalid, note). Fields this operator does not know (a newer CRD: version
    skew between CRD and operator) are dropped with a note rather than refused; anything else
    invalid is reported with the field, value and fix."""
    try:
        return models.parse_spec(raw), None, None
    except ValidationError as exc:
        unknown = [e["loc"] for e in exc.errors() if e["type"] == "extra_forbidden"]
        if not unknown or len(unknown) != len(exc.errors()):
            return None, models.format_validation_error(exc), None
    pruned = json.loads(json.dumps(raw or {}))
    for loc in unknown:
        parent: Any = pruned
        for key in loc[:-1]:
            parent = parent[key]
        parent.pop(loc[-1], None)
    try:
        spec = models.parse_spec(pruned)
    except ValidationError as exc:
        return None, models.format_validation_error(exc), None
    shown = ", ".join("spec." + ".".join(str(p) for p in loc) for loc in unknown)
    return spec, None, f"ignored fields this operator does not know (a newer CRD?): {shown}"


def spec_of_job(job: dict[str, Any] | None) -> models.TrainingJobSpec | None:
    """The spec an attempt's Job was created from (its annotation), None when unknown."""
    raw = ((job or {}).get("metadata", {}).get("annotations") or {}).get(render.ANNOTATION_SPEC)
    if not raw:
        return None
    try:
        return models.parse_spec(json.loads(raw))
    except (ValueError, ValidationError):
        return None


@dataclass(frozen=True)
class PassSpec:
    """The spec a pass works with."""

    spec: models.TrainingJobSpec | None
    invalid: str | None
    """Why the TrainingJob cannot run at all (its name, or a spec invalid before any attempt)."""
    rejected: str | None
    """Why an edit after the job ran is rejected (``spec`` is then the current attempt's)."""
    note: str | None
    """Fields this operator does not know, dropped (logged)."""


def pass_spec(
    raw: dict[str, Any] | None, name_invalid: str | None, attempt: int, job: dict[str, Any] | None
) -> PassSpec:
    """An invalid spec before any attempt fails the job; an invalid edit of a job that has run
    is rejected, and the pass goes on with the spec the current attempt was created from (held
    between attempts until the spec is fixed)."""
    spec, spec_invalid, note = parse_spec_tolerant(raw)
    if spec_invalid is None:
        return PassSpec(spec, name_invalid, None, note)
    if attempt:
        return PassSpec(spec_of_job(job), name_invalid, spec_invalid, note)
    return PassSpec(spec, name_invalid or spec_invalid, None, note)
