"""FSDP resume on CPU/gloo: each rank reads only what its piece needs (counted at the storage
seam), parameters without optimizer state and saves before the first step resume bit-identical,
and pieces that do not cover a tensor make the checkpoint corrupt (fallback), not an error."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.conftest import MAX_STEPS, RUN_TIMEOUT, SAVE_STEPS, WORLD_SIZE
from tests.distributed.fsdp_resume_worker import shift_a_piece
from tests.distributed.ranks import RankedRun
from tests.distributed.test_fsdp_checkpoint import _run_ranks
from tests.distributed.test_fsdp_trainer import fsdp_args, fsdp_reference  # noqa: F401
from trainer_runtime.checkpoint import fallback
from trainer_runtime.testing import weights_identical

WORKER = "tests.distributed.fsdp_resume_worker"


@pytest.mark.runtime
@pytest.mark.timeout(300)
def test_each_rank_reads_about_its_share_and_resumes_bit_identical(tmp_path: Path) -> None:
    results = _run_ranks(WORLD_SIZE, WORKER, "bytes", str(tmp_path / "out"))
    for r in results:
        assert r["differ"] == [], r
        share = r["state_bytes"] / WORLD_SIZE
        # at most 1.1 x its share plus every file's header (each rank reads them all) ...
        assert r["bytes_read"] <= 1.1 * share + r["header_bytes"], r
        # ... and at least its share: the counter sees the reads (nothing bypasses the seam)
        assert r["bytes_read"] >= 0.9 * share, r


@pytest.mark.runtime
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("case", "optimizer_entries"),
    [
        # the toy's 4 parameters train; the unused head's 2 never get state
        ("unused", 4),
        # saved before the first step: the live optimizer still has no state after the save
        ("step0", 0),
    ],
)
def test_state_gaps_save_and_resume_bit_identical(
    tmp_path: Path, case: str, optimizer_entries: int
) -> None:
    results = _run_ranks(WORLD_SIZE, WORKER, case, str(tmp_path / "out"))
    for r in results:
        assert r["complete"] and r["error"] is None, r
        assert r["save_untouched"], r
        assert r["optimizer_entries"] == optimizer_entries, r
        assert r["differ"] == [], r
        assert not any(".unused." in k for k in r["optim_keys"]), r


@pytest.mark.runtime
@pytest.mark.timeout(300)
def test_pieces_that_miss_rows_make_the_checkpoint_corrupt(tmp_path: Path) -> None:
    results = _run_ranks(WORLD_SIZE, WORKER, "gap", str(tmp_path / "out"))
    assert all(r["verdict"] == fallback.CORRUPT for r in results), results
    named = [r["error"] for r in results if "net.0.weight" in (r["error"] or "")]
    assert named, results
    assert "do not cover rows" in named[0], named


@pytest.mark.runtime
@pytest.mark.timeout(600)
def test_the_trainer_falls_back_from_pieces_that_miss_rows(
    tmp_path: Path,
    fsdp_reference: Path,  # noqa: F811
) -> None:
    """The newest checkpoint's pieces miss rows of a weight (its checksums match: only the
    layout is wrong): the Trainer marks it corrupt, resumes from the one before, and ends
    bit-identical to the uninterrupted run."""
    out = tmp_path / "out"
    newest = 2 * SAVE_STEPS
    for step in (SAVE_STEPS, newest):
        source, target = fsdp_reference / f"checkpoint-{step}", out / f"checkpoint-{step}"
        target.mkdir(parents=True)
        for item in source.iterdir():
            (target / item.name).write_bytes(item.read_bytes())
    shift_a_piece(str(out / f"checkpoint-{newest}"))
    with RankedRun(
        out, tmp_path, world_size=WORLD_SIZE, args=fsdp_args(), attempt=2, resume_from="latest"
    ) as run:
        codes = run.wait(RUN_TIMEOUT)
    assert codes == [0] * WORLD_SIZE, f"resumed run exited {codes}\n{run.tails()}"
    # marked corrupt (the marker went when step 8 was saved again), named with the rows
    logs = run.tails()
    assert f"checkpoint-{newest} is corrupt: its pieces of 'model.net.0.weight'" in logs, logs
    assert "do not cover rows 16:17" in logs and "marked corrupt" in logs, logs
    for rank in range(WORLD_SIZE):
        begun = run.steps_begun(rank)
        assert begun and begun[0] == SAVE_STEPS + 1, f"rank {rank} resumed at {begun[:1]}"
    same, detail = weights_identical(
        out / f"checkpoint-{MAX_STEPS}", fsdp_reference / f"checkpoint-{MAX_STEPS}"
    )
    assert same, detail
