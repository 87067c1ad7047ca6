"""FSDP resume on CPU/gloo: each rank reads only what its piece needs (counted at the storage
seam), parameters without optimizer state and saves before the first step resume bit-identical,
and pieces that do not cover a tensor make the checkpoint corrupt (fallback), not an error."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.conftest import WORLD_SIZE
from tests.distributed.test_fsdp_checkpoint import _run_ranks

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
    assert all(r["verdict"] == "CORRUPT" for r in results), results
    named = [r["error"] for r in results if "net.0.weight" in (r["error"] or "")]
    assert named, results
    assert "do not cover rows" in named[0], named
