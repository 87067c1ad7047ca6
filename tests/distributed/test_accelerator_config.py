"""accelerator_config over two real gloo ranks: dispatch_batches=True and even_batches=False.

Every run records, per training forward pass, the dataset indices each rank trained on (toy
``--record-samples``), so the tests compare the global sample set of every step across runs.
"""

from __future__ import annotations

import json
import signal
from collections import Counter
from pathlib import Path

import pytest

from tests.distributed.conftest import RUN_TIMEOUT, WORLD_SIZE
from tests.distributed.ranks import RankedRun
from trainer_runtime.protocol import EXIT_PREEMPTED
from trainer_runtime.testing import weights_identical

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(900)]

MAX_STEPS = 10
BASE = ["--max-steps", str(MAX_STEPS), "--save-steps", "4", "--seed", "5", "--record-samples"]
DISPATCH = json.dumps({"dispatch_batches": True})


def _run(
    out: Path,
    workdir: Path,
    args: list[str],
    *,
    attempt: int = 1,
    resume_from: str | None = None,
    sigterm_at: tuple[int, int] | None = None,
) -> RankedRun:
    """Train on WORLD_SIZE ranks; ``sigterm_at=(rank, step)`` sends that rank SIGTERM once the
    step began. Returns the finished run (exit codes checked)."""
    with RankedRun(
        out, workdir, world_size=WORLD_SIZE, args=args, attempt=attempt, resume_from=resume_from
    ) as run:
        if sigterm_at is not None:
            rank, step = sigterm_at
            run.ranks[rank].wait_for_event("step_begin", step=step, timeout=RUN_TIMEOUT)
            run.send(rank, signal.SIGTERM)
        codes = run.wait(RUN_TIMEOUT)
    expected = EXIT_PREEMPTED if sigterm_at is not None else 0
    assert codes == [expected] * WORLD_SIZE, f"exit codes {codes}\n{run.tails()}"
    return run


def _samples(run: RankedRun) -> dict[int, list[tuple[int, list[int], bool]]]:
    """step -> [(rank, indices, padding)] over every rank of the run."""
    steps: dict[int, list[tuple[int, list[int], bool]]] = {}
    for rank in range(WORLD_SIZE):
        for event in run.ranks[rank].events():
            if event["event"] == "samples":
                entry = (rank, list(event["indices"]), bool(event["padding"]))
                steps.setdefault(int(event["step"]), []).append(entry)
    return steps


def _global_sets(steps: dict[int, list[tuple[int, list[int], bool]]]) -> dict[int, list[int]]:
    return {
        step: sorted(i for _, indices, pad in entries if not pad for i in indices)
        for step, entries in steps.items()
    }


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, RankedRun]:
    """The reference: default accelerator_config (every rank reads its own shard)."""
    root = tmp_path_factory.mktemp("plain")
    return root / "out", _run(root / "out", root, BASE)


def test_dispatch_batches_trains_like_sharded_ranks_and_resumes_exactly(
    tmp_path: Path, plain: tuple[Path, RankedRun]
) -> None:
    plain_out, plain_run = plain
    dispatched = _run(
        tmp_path / "dispatch", tmp_path / "dispatch-w", [*BASE, "--accelerator-config", DISPATCH]
    )
    plain_steps, dispatch_steps = _samples(plain_run), _samples(dispatched)
    assert sorted(dispatch_steps) == list(range(1, MAX_STEPS + 1))
    # Every step trains on the same global sample set, and each rank on its own shard of it.
    assert _global_sets(dispatch_steps) == _global_sets(plain_steps)
    assert dispatch_steps == plain_steps
    same, detail = weights_identical(
        tmp_path / "dispatch" / f"checkpoint-{MAX_STEPS}",
        plain_out / f"checkpoint-{MAX_STEPS}",
    )
    assert same, f"dispatch_batches changed the result: {detail}"

    # SIGTERM to the non-main rank mid-run (slow steps), then resume: bit-identical weights and
    # the same samples per step as the uninterrupted dispatch run.
    out = tmp_path / "resumed"
    args = [*BASE, "--accelerator-config", DISPATCH]
    first = _run(out, tmp_path / "r", [*args, "--step-sleep", "0.3"], sigterm_at=(1, 4))
    stopped = first.ranks[0].termination_message().step
    assert stopped is not None and 4 <= stopped < MAX_STEPS
    second = _run(out, tmp_path / "r", args, attempt=2, resume_from="latest")
    assert second.steps_begun(0)[0] == stopped + 1
    combined = {s: e for s, e in _samples(first).items() if s <= stopped}
    combined.update(_samples(second))
    assert combined == dispatch_steps
    same, detail = weights_identical(
        out / f"checkpoint-{MAX_STEPS}", tmp_path / "dispatch" / f"checkpoint-{MAX_STEPS}"
    )
    assert same, f"resumed dispatch run differs from the uninterrupted one: {detail}"


@pytest.mark.parametrize("dispatch", [False, True], ids=["sharded", "dispatched"])
def test_split_batches_gives_each_rank_its_share(
    tmp_path: Path, plain: tuple[Path, RankedRun], dispatch: bool
) -> None:
    # split_batches: --batch-size is the global batch (16 = 2 ranks x 8, the plain run's 8).
    config = json.dumps({"split_batches": True, "dispatch_batches": dispatch})
    args = [*BASE, "--batch-size", "16", "--accelerator-config", config]
    run = _run(tmp_path / "out", tmp_path, args)
    plain_out, plain_run = plain
    assert _samples(run) == _samples(plain_run)
    same, detail = weights_identical(
        tmp_path / "out" / f"checkpoint-{MAX_STEPS}", plain_out / f"checkpoint-{MAX_STEPS}"
    )
    assert same, f"split_batches changed the result: {detail}"


@pytest.mark.parametrize("dispatch", [False, True], ids=["sharded", "dispatched"])
def test_even_batches_false_sees_each_sample_once_and_predicts_each_once(
    tmp_path: Path, dispatch: bool
) -> None:
    # 41 samples, 4 per rank and micro-batch, 2 ranks: rank 0 gets 21 (6 batches), rank 1 20
    # (5 batches + 1 padding). 12 steps = 2 epochs of 6 steps.
    config = json.dumps({"even_batches": False, "dispatch_batches": dispatch})
    args = [
        *BASE[:1],
        "12",
        *BASE[2:],
        "--num-samples",
        "41",
        "--batch-size",
        "4",
        "--accelerator-config",
        config,
        "--predict-samples",
        "33",
        "--eval-batch-size",
        "8",
    ]
    run = _run(tmp_path / "out", tmp_path, args)
    for rank in range(WORLD_SIZE):
        assert run.steps_ended(rank) == list(range(1, 13)), run.tails()
    steps = _samples(run)
    for epoch_steps in (range(1, 7), range(7, 13)):
        seen = Counter(
            i for step in epoch_steps for _, indices, pad in steps[step] if not pad for i in indices
        )
        assert sorted(seen) == list(range(41)) and set(seen.values()) == {1}, seen
    padding = sorted((step, rank) for step, e in steps.items() for rank, _, pad in e if pad)
    assert padding == [(6, 1), (12, 1)]

    # 33 predictions over 2 ranks and batches of 8: 5 batches, rank 1 pads the third round.
    for rank in range(WORLD_SIZE):
        (predict,) = [e for e in run.ranks[rank].events() if e["event"] == "predict"]
        assert predict["rows"] == 33
        assert predict["label_ids"] == predict["expected"]
