"""set_condition keeps Kubernetes condition semantics."""

from __future__ import annotations

from typing import Any

import pytest

from preemptible_operator import conditions as c


def test_set_condition_transition_time_changes_only_with_status() -> None:
    conds = c.set_condition(None, c.RUNNING, "True", "Started", "", "t1", 1)
    conds = c.set_condition(conds, c.RUNNING, "True", "Started", "again", "t2", 2)
    (running,) = conds
    assert running.last_transition_time == "t1" and running.message == "again"
    assert running.observed_generation == 2
    conds = c.set_condition(conds, c.RUNNING, "False", "KueuePreempted", "x", "t3", 2)
    assert conds[0].last_transition_time == "t3" and conds[0].reason == "KueuePreempted"


def test_conditions_are_kept_in_a_stable_order() -> None:
    conds = None
    for ctype in reversed(c.ALL_TYPES):
        conds = c.set_condition(conds, ctype, "False", "R", "", "t")
    assert [x.type for x in conds or []] == list(c.ALL_TYPES)
    assert c.find_condition(conds, c.PREEMPTED) is not None
    assert c.find_condition(conds, "Nope") is None


def test_preemption_reasons_are_disjoint_from_failures() -> None:
    assert c.Reason.TRAINING_FAILED not in c.PREEMPTION_REASONS
    assert c.Reason.KUEUE_PREEMPTED in c.PREEMPTION_REASONS


def _types(conds: list[Any] | None) -> dict[str, tuple[str, str | None]]:
    return {x.type: (x.status, x.reason) for x in conds or []}


@pytest.mark.parametrize(
    ("before", "phase", "after"),
    [
        # `kubectl wait --for=condition=Complete`: True only once the job succeeded
        ({}, "Running", {}),
        ({}, "Succeeded", {"Complete": ("True", "Completed")}),
        # `kubectl wait --for=condition=Suspended`: True while suspended, False once resumed
        ({}, "Suspended", {"Suspended": ("True", "Suspended")}),
        ({"Suspended": "True"}, "Requeueing", {"Suspended": ("False", "Resumed")}),
        ({"Suspended": "False"}, "Running", {"Suspended": ("False", "R")}),
        # Failed is the failing pass's (with its reason); Complete never comes with it
        ({"Failed": "True"}, "Failed", {"Failed": ("True", "R")}),
    ],
)
def test_lifecycle_conditions(
    before: dict[str, str], phase: str, after: dict[str, tuple[str, str]]
) -> None:
    conds = None
    for ctype, status in before.items():
        conds = c.set_condition(conds, ctype, status, "R", "", "t0")  # type: ignore[arg-type]
    got = c.lifecycle_conditions(conds, phase, "t1", 3)
    assert _types(got) == after


def test_condition_type_names_are_what_kubectl_wait_users_type() -> None:
    assert (c.COMPLETE, c.FAILED, c.SUSPENDED) == ("Complete", "Failed", "Suspended")
