"""Training processes checkpointing to the real S3 server under real signals: the JIT checkpoint
goes to S3 on SIGTERM, the next attempt resumes from it bit-identical to an uninterrupted local run,
and a bad object store fails the attempt before the first step with a message naming the URL."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.cluster.s3 import S3Server
from tests.runtime.conftest import (
    MAX_STEPS,
    RUN_TIMEOUT,
    SAVE_STEPS,
    Reference,
    assert_preempted,
    resume_to_end,
    toy_args,
)
from tests.s3.helpers import download
from trainer_runtime.checkpoint.layout import CheckpointStore
from trainer_runtime.testing import ToyRun, weights_identical

pytestmark = [pytest.mark.s3, pytest.mark.runtime, pytest.mark.timeout(400)]


def test_jit_checkpoint_to_s3_and_bit_identical_resume(
    s3_server: S3Server, s3_bucket: str, s3_env: dict, tmp_path: Path, reference: Reference
) -> None:
    out = f"s3://{s3_bucket}/run"
    run = ToyRun(out, tmp_path, args=toy_args(step_sleep=0.3)).start()
    try:
        run.wait_for_event("step_end", step=SAVE_STEPS + 2, timeout=RUN_TIMEOUT)
        run.send(signal.SIGTERM)
        code = run.wait(RUN_TIMEOUT)
    finally:
        run.kill()
    msg = assert_preempted(run, code, min_step=SAVE_STEPS + 2)
    assert msg.checkpoint is not None and msg.checkpoint.startswith(out), msg
    steps = [c.step for c in CheckpointStore(out).list() if c.complete]
    assert steps == [SAVE_STEPS, msg.step], steps

    resume_to_end(out, tmp_path, attempt=2, expect_first_step=msg.step + 1)
    final = download(s3_server, f"{out}/checkpoint-{MAX_STEPS}", tmp_path / "final")
    same, detail = weights_identical(final, reference.final_checkpoint)
    assert same, f"resumed run on S3 differs from the uninterrupted one: {detail}"


@pytest.mark.parametrize("case", ["missing bucket", "no credentials"])
def test_a_bad_object_store_fails_the_attempt_before_training(
    case: str, s3_server: S3Server, s3_bucket: str, s3_env: dict, tmp_path: Path
) -> None:
    url = "s3://no-such-bucket-29/run" if case == "missing bucket" else f"s3://{s3_bucket}/run"
    env = {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""} if case == "no credentials" else {}
    run = ToyRun(url, tmp_path, args=toy_args(), env=env).start()
    try:
        code = run.wait(RUN_TIMEOUT)
    finally:
        run.kill()
    assert code == 1, f"exit code {code}\n{run.tail()}"
    assert list(run.steps_begun()) == [], "training started before the store was checked"
    msg = run.termination_message()
    assert msg.reason == "failed" and msg.message, msg
    assert repr(url) in msg.message and s3_server.endpoint in msg.message, msg.message
    expected = "does not exist" if case == "missing bucket" else "Unable to locate credentials"
    assert expected in msg.message, msg.message
