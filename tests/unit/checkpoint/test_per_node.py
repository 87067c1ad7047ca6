"""save_on_each_node: the pure decisions (which step every node resumes from, who writes)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trainer_runtime.checkpoint.per_node import (
    NodeReport,
    check_requested_checkpoint,
    choose_latest_step,
    is_checkpoint_writer,
    newer_than_requested,
    node_label,
)
from trainer_runtime.errors import ConfigurationError, ResumeError
from trainer_runtime.training_args import TrainingArguments


def _reports(**steps: tuple[int, ...]) -> list[NodeReport]:
    # one report per rank: two ranks per node, as torchrun with --nproc-per-node 2 gives
    return [NodeReport(node.removeprefix("n"), s) for node, s in steps.items() for _ in range(2)]


@pytest.mark.parametrize(
    ("steps", "expected", "note_needle"),
    [
        ({"n0": (), "n1": ()}, None, None),  # nothing anywhere: start from scratch
        ({"n0": (4, 8), "n1": (4, 8)}, 8, None),  # agreement
        ({"n0": (4, 8), "n1": (4,)}, 4, "checkpoint-8 is not complete on every node"),
        ({"n0": (4,), "n1": (4, 8)}, 4, "node 0: 4; node 1: 4, 8"),
        ({"n0": (4, 6, 8), "n1": (4, 6), "n2": (6, 8)}, 6, "every node resumes from checkpoint-6"),
        ({"n0": (8,)}, 8, None),  # one node
    ],
)
def test_newest_step_complete_on_every_node(
    steps: dict[str, tuple[int, ...]], expected: int | None, note_needle: str | None
) -> None:
    step, note = choose_latest_step(_reports(**steps))
    assert step == expected
    if note_needle is None:
        assert note is None
    else:
        assert note is not None and note_needle in note, note


@pytest.mark.parametrize(
    ("steps", "needle"),
    [
        ({"n0": (4, 8), "n1": ()}, "node 0: 4, 8; node 1: none"),
        ({"n0": (4,), "n1": (8,)}, "node 0: 4; node 1: 8"),
    ],
)
def test_no_common_step_is_a_clear_error(steps: dict[str, tuple[int, ...]], needle: str) -> None:
    with pytest.raises(ResumeError) as err:
        choose_latest_step(_reports(**steps))
    text = str(err.value)
    assert needle in text and "no checkpoint step is complete on every node" in text, text
    assert "resume_from_checkpoint=False" in text  # the fix is named


def test_ranks_of_one_node_that_disagree_count_what_all_of_them_see() -> None:
    reports = [NodeReport("0", (4, 8)), NodeReport("0", (4,)), NodeReport("1", (4, 8))]
    assert choose_latest_step(reports)[0] == 4


@pytest.mark.parametrize(
    ("requested", "expected", "needle"),
    [
        ({"0": (True, 8, None), "1": (True, 8, None)}, 8, None),
        ({"0": (True, 8, None), "1": (False, 8, "sentinel present")}, None, "node 1: not usable"),
        ({"0": (False, -1, "directory does not exist"), "1": (True, 8, None)}, None, "node 0"),
        ({"0": (True, 8, None), "1": (True, 4, None)}, None, "the same step"),
    ],
)
def test_an_explicit_checkpoint_must_be_complete_on_every_node(
    requested: dict[str, tuple[bool, int, str | None]], expected: int | None, needle: str | None
) -> None:
    reports = [NodeReport(node, (), value) for node, value in requested.items()]
    if expected is not None:
        assert check_requested_checkpoint("out/checkpoint-8", reports) == expected
        return
    with pytest.raises(ResumeError) as err:
        check_requested_checkpoint("out/checkpoint-8", reports)
    assert needle is not None and needle in str(err.value), str(err.value)
    assert "out/checkpoint-8" in str(err.value)


@pytest.mark.parametrize(
    ("steps", "requested", "expected"),
    [
        # issue 37: the operator's path is older than the newest step complete on every node
        ({"n0": (4, 8), "n1": (4, 8)}, 4, 8),
        ({"n0": (4, 8, 12), "n1": (4, 8)}, 4, 8),  # the newest one every node has
        ({"n0": (4, 8), "n1": (4, 8)}, 8, None),  # the path is the newest: as asked
        ({"n0": (4, 8), "n1": (4,)}, 4, None),  # nothing newer on every node
        ({"n0": (4,), "n1": (8,)}, 4, None),  # no common step: the path's own checks decide
        ({"n0": (), "n1": ()}, 4, None),
        ({"n0": (4, 8), "n1": (4, 8)}, -1, None),  # a path that names no step
    ],
)
def test_a_newer_step_than_the_requested_one(
    steps: dict[str, tuple[int, ...]], requested: int, expected: int | None
) -> None:
    reports = [
        NodeReport(node.removeprefix("n"), s, (requested in s, requested, None))
        for node, s in steps.items()
    ]
    assert newer_than_requested(reports) == expected


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"GROUP_RANK": "1", "NODE_RANK": "3"}, "1"),  # torchrun's node rank first
        ({"NODE_RANK": "3"}, "3"),  # one process per pod (the operator's env)
        ({"NODE_RANK": " "}, None),  # blank: the host name
    ],
)
def test_node_label(env: dict[str, str], expected: str | None) -> None:
    label = node_label(env)
    assert label == expected if expected is not None else label and label.strip()


@pytest.mark.parametrize(
    ("each_node", "main", "local_main", "writes"),
    [
        (False, True, True, True),
        (False, False, True, False),  # node 1's main process: rank 0 writes the only copy
        (True, False, True, True),  # ... unless every node keeps its own copy
        (True, False, False, False),
        (True, True, True, True),
    ],
)
def test_who_writes_and_rotates(
    each_node: bool, main: bool, local_main: bool, writes: bool
) -> None:
    args = TrainingArguments(output_dir="out", save_on_each_node=each_node)
    got = is_checkpoint_writer(args, is_main_process=main, is_local_main_process=local_main)
    assert got is writes


def test_save_on_each_node_is_accepted_and_refused_with_fsdp() -> None:
    assert TrainingArguments(output_dir="out", save_on_each_node=True).save_on_each_node
    with pytest.raises(ConfigurationError) as err:
        TrainingArguments(output_dir="out", save_on_each_node=True, fsdp="full_shard")
    assert "save_on_each_node" in str(err.value) and "fsdp" in str(err.value), str(err.value)


def test_module_is_torch_free() -> None:
    code = (
        "import trainer_runtime.checkpoint.per_node, sys; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
