"""DDP resume from the tier's S3 server (issue 38): each of two gloo ranks downloads about its
share of the shared save (not every shard on every rank), and resumes bit-identical."""

from __future__ import annotations

import pytest

from tests.distributed.test_ddp_resume_share import run_and_check_shares

pytestmark = [pytest.mark.s3, pytest.mark.runtime]


@pytest.mark.timeout(400)
def test_ddp_ranks_download_their_share_from_s3(s3_bucket: str, s3_env: dict) -> None:
    run_and_check_shares(f"s3://{s3_bucket}/run")
