"""FSDP resume from the tier's S3 server: each rank's ranged GETs add up to about its share of
the checkpoint (not every file whole on every rank), no file is held whole in memory, and the
resume is bit-identical."""

from __future__ import annotations

import pytest

from tests.distributed.test_fsdp_checkpoint import _run_ranks

pytestmark = [pytest.mark.s3]


@pytest.mark.timeout(400)
def test_fsdp_ranks_read_their_share_from_s3(s3_bucket: str, s3_env: dict) -> None:
    results = _run_ranks(
        2, "tests.distributed.fsdp_resume_worker", "bytes", f"s3://{s3_bucket}/run"
    )
    for r in results:
        assert r["differ"] == [], r
        share = r["state_bytes"] / 2
        assert 0.9 * share <= r["bytes_read"] <= 1.1 * share + r["header_bytes"], r
        # no file held whole: the load's peak extra memory stays below even one rank's share
        assert r["extra_rss"] is None or r["extra_rss"] < share, r
