"""Edits of a TrainingJob that has run: invalid ones are rejected (the running attempt goes on with
the spec its Job was created from), fields of a newer CRD are ignored rather than refused."""

from __future__ import annotations

from typing import Any

import pytest

from preemptible_operator import render
from preemptible_operator.pass_spec import parse_spec_tolerant, spec_of_job
from tests.unit.operator.builders import META, make_spec

BASE: dict[str, Any] = {
    "image": "img",
    "command": ["python", "train.py"],
    "checkpoint": {"uri": "/ckpt/run"},
}


@pytest.mark.parametrize(
    ("raw", "valid", "invalid_words", "note_words"),
    [
        (BASE, True, None, None),
        # Version skew: a newer CRD's field at the top level and nested.
        ({**BASE, "newFeature": {"x": 1}}, True, None, "spec.newFeature"),
        ({**BASE, "checkpoint": {"uri": "/c", "tiering": "hot"}}, True, None, "checkpoint.tiering"),
        # A real error stays an error, with the field named.
        ({**BASE, "numNodes": 0}, False, "numNodes", None),
        ({**BASE, "numNodes": 0, "newFeature": 1}, False, "numNodes", None),
    ],
)
def test_parse_spec_tolerant(
    raw: dict[str, Any], valid: bool, invalid_words: str | None, note_words: str | None
) -> None:
    spec, invalid, note = parse_spec_tolerant(raw)
    assert (spec is not None) is valid
    if invalid_words:
        assert invalid is not None and invalid_words in invalid
    else:
        assert invalid is None
    if note_words:
        assert note is not None and note_words in note
    else:
        assert note is None


def test_the_running_attempts_spec_comes_back_from_its_job() -> None:
    spec = make_spec(numNodes=2)
    params = render.AttemptParams(attempt=1, grace_seconds=30, resume_from="", suspended=False)
    job = render.render_job(META, spec, params)
    assert spec_of_job(job) == spec
    assert spec_of_job(None) is None
    job["metadata"]["annotations"][render.ANNOTATION_SPEC] = "{not json"
    assert spec_of_job(job) is None
