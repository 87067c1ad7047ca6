"""The spec a pass works with (pass_spec.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from preemptible_operator import render
from preemptible_operator.pass_spec import pass_spec

VALID_RAW: dict[str, Any] = {"image": "img", "command": ["python"], "checkpoint": {"uri": "/c"}}


ATTEMPT_JOB: dict[str, Any] = {
    "metadata": {
        "name": "tj-a1",
        "annotations": {
            render.ANNOTATION_SPEC: json.dumps({**VALID_RAW, "image": "old"}),
        },
    }
}


SPECS = [
    # (id, raw spec, name invalid, attempt, job, spec image, invalid words, rejected words)
    ("valid", VALID_RAW, None, 0, None, "img", None, None),
    ("bad-name", VALID_RAW, "name too long", 0, None, "img", "name too long", None),
    (
        "invalid-before-any-attempt",
        {**VALID_RAW, "numNodes": 0},
        None,
        0,
        None,
        None,
        "numNodes",
        None,
    ),
    # An edit after the job ran: rejected, the attempt's own spec goes on.
    (
        "invalid-edit-after-a-run",
        {**VALID_RAW, "numNodes": 0},
        None,
        1,
        ATTEMPT_JOB,
        "old",
        None,
        "numNodes",
    ),
    (
        "invalid-edit-no-attempt-spec",
        {**VALID_RAW, "numNodes": 0},
        None,
        1,
        None,
        None,
        None,
        "numNodes",
    ),
]


@pytest.mark.parametrize(
    ("raw", "name_invalid", "attempt", "job", "image", "invalid", "rejected"),
    [c[1:] for c in SPECS],
    ids=[c[0] for c in SPECS],
)
def test_pass_spec(
    raw: dict[str, Any],
    name_invalid: str | None,
    attempt: int,
    job: dict[str, Any] | None,
    image: str | None,
    invalid: str | None,
    rejected: str | None,
) -> None:
    got = pass_spec(raw, name_invalid, attempt, job)
    assert (got.spec.image if got.spec else None) == image
    for said, words in ((got.invalid, invalid), (got.rejected, rejected)):
        assert (said is None) is (words is None)
        assert words is None or (said is not None and words in said)


def test_pass_spec_notes_unknown_fields() -> None:
    got = pass_spec({**VALID_RAW, "newFeature": 1}, None, 0, None)
    assert got.spec is not None and got.invalid is None
    assert got.note is not None and "spec.newFeature" in got.note
