"""Issue 37: the ranks of a rank-shared save agree on the plan (a digest of it, all-gathered) and
a disagreement fails the save naming the tensors (pure parts; the 2-rank run:
tests/distributed/test_share_plan_agreement.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from trainer_runtime.checkpoint.shares import (
    PlanItem,
    ShareGroup,
    agree_on_plan,
    plan_digest,
    plan_disagreement,
    plan_listing,
)
from trainer_runtime.errors import CheckpointError

A: PlanItem = ("model", "a.weight", "float32", (4, 2))
B: PlanItem = ("model", "b.weight", "float32", (3,))
S: PlanItem = ("optimizer", "optimizer.state.0.exp_avg", "float32", (4, 2))


@pytest.mark.parametrize(
    ("listings", "expected"),
    [
        ([[A, B], [A, B]], None),
        ([[A, B]], None),
        ([[], []], None),
        # a tensor on one rank only: named, with where it is and where not
        (
            [[A], [A, B]],
            "model tensor 'b.weight' is on rank(s) 1 only (not on 0)",
        ),
        (
            [[A, B, S], [A, B], [A, B]],
            "optimizer tensor 'optimizer.state.0.exp_avg' is on rank(s) 0 only (not on 1, 2)",
        ),
        # another shape or dtype on one rank
        (
            [[A, B], [A, ("model", "b.weight", "bfloat16", (3,))]],
            "model tensor 'b.weight' differs (rank 0: float32[3], rank 1: bfloat16[3])",
        ),
        (
            [[A], [("model", "a.weight", "float32", (2, 4))]],
            "model tensor 'a.weight' differs (rank 0: float32[4, 2], rank 1: float32[2, 4])",
        ),
        # the same tensors in another order: another plan (the order breaks ties)
        (
            [[A, B], [B, A]],
            "the tensors come in another order on rank 1 (position 0: 'a.weight' on rank 0, "
            "'b.weight' on rank 1)",
        ),
    ],
)
def test_plan_disagreement(listings: list[list[PlanItem]], expected: str | None) -> None:
    assert plan_disagreement(listings) == expected


def test_only_the_first_problems_are_listed() -> None:
    extra = [("model", f"t{i}", "float32", (1,)) for i in range(8)]
    text = plan_disagreement([[A], [A, *extra]], limit=3)
    assert text is not None and text.endswith("; and 5 more") and "'t0'" in text, text


@pytest.mark.parametrize(
    ("one", "other", "world_one", "world_other", "same"),
    [
        ([A, B], [A, B], 2, 2, True),
        ([A, B], [A, B], 2, 4, False),
        ([A, B], [B, A], 2, 2, False),
        ([A, B], [A], 2, 2, False),
        ([A], [("model", "a.weight", "float16", (4, 2))], 2, 2, False),
        ([A], [("optimizer", "a.weight", "float32", (4, 2))], 2, 2, False),
    ],
)
def test_plan_digest(
    one: list[PlanItem], other: list[PlanItem], world_one: int, world_other: int, same: bool
) -> None:
    assert (plan_digest(one, world_one) == plan_digest(other, world_other)) is same


def test_listing_reads_names_dtypes_and_shapes_in_order() -> None:
    groups = [
        ShareGroup("model", {"w": torch.zeros(2, 3), "e": torch.zeros(5, dtype=torch.bfloat16)}),
        ShareGroup("optimizer", {"s": torch.zeros(())}),
    ]
    assert plan_listing(groups) == [
        ("model", "w", "float32", (2, 3)),
        ("model", "e", "bfloat16", (5,)),
        ("optimizer", "s", "float32", ()),
    ]


def _gather_of(per_rank: list[list[ShareGroup]], world: int) -> tuple[list[Any], Any]:
    """An all-gather as rank 0 sees it, with the other ranks' objects computed alike."""
    calls: list[Any] = []

    def gather(obj: Any) -> list[Any]:
        calls.append(obj)
        if isinstance(obj, str):
            return [plan_digest(plan_listing(g), world) for g in per_rank]
        return [plan_listing(g) for g in per_rank]

    return calls, gather


def test_agreeing_ranks_pay_one_gather_of_a_digest() -> None:
    groups = [ShareGroup("model", {"w": torch.zeros(2)})]
    calls, gather = _gather_of([groups, groups], 2)
    agree_on_plan(groups, 2, gather)
    assert len(calls) == 1 and isinstance(calls[0], str) and len(calls[0]) == 64


def test_disagreeing_ranks_fail_naming_the_tensor() -> None:
    mine = [ShareGroup("model", {"w": torch.zeros(2)})]
    theirs = [ShareGroup("model", {"w": torch.zeros(2), "extra": torch.zeros(3)})]
    calls, gather = _gather_of([mine, theirs], 2)
    with pytest.raises(CheckpointError, match=r"model tensor 'extra' is on rank\(s\) 1 only"):
        agree_on_plan(mine, 2, gather)
    assert len(calls) == 2  # the listings travel only once the digests differ
