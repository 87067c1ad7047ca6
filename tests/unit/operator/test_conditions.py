"""set_condition keeps Kubernetes condition semantics."""

from __future__ import annotations

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
