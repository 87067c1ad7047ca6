"""Faults of the object store while a training process checkpoints to it, with nothing lost: the
server killed in the middle of the JIT checkpoint's upload, the network cut in the middle of it,
the server restarted between attempts, a read-only bucket and wrong credentials. Each attempt that
meets a fault ends with an error naming the endpoint, the bucket and the key; the next attempt
resumes from the newest complete checkpoint and ends bit-identical to an uninterrupted run.

The toy carries 24 MiB of ballast (``--ballast-mb``: a buffer training never touches) and the
client reaches the server through a ``FaultyLink`` at 8 MB/s, so the JIT checkpoint's upload
takes about 3 s and a fault lands inside it (the test waits until 4 MiB of it have gone up)."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.s3 import FaultyLink, S3Server
from tests.runtime.conftest import (
    MAX_STEPS,
    RUN_TIMEOUT,
    SAVE_STEPS,
    Reference,
    toy_args,
)
from tests.s3.helpers import client, download
from trainer_runtime.checkpoint.layout import SENTINEL_NAME, CheckpointStore
from trainer_runtime.testing import ToyRun, load_model_tensors

pytestmark = [pytest.mark.s3, pytest.mark.runtime, pytest.mark.timeout(600)]

MiB = 1 << 20
BALLAST = ("--ballast-mb", "24", "--save-async", "false")
STOP_AFTER = SAVE_STEPS + 2  # SIGTERM once checkpoint-4 is committed and two more steps ran


@pytest.fixture
def link(s3_server: S3Server) -> Iterator[FaultyLink]:
    faulty = FaultyLink(s3_server.port, rate=8 * MiB)
    yield faulty
    faulty.close()


def _run(url: str, workdir: Path, attempt: int, env: dict[str, str], **kw: object) -> ToyRun:
    return ToyRun(
        url,
        workdir,
        args=[*toy_args(step_sleep=0.3), *BALLAST],
        attempt=attempt,
        resume_from="latest",
        grace_seconds=90,
        env=env,
        **kw,  # type: ignore[arg-type]
    ).start()


def _preempt_into_upload(run: ToyRun, link: FaultyLink, fault: str, server: S3Server) -> None:
    """SIGTERM after step 6, then the fault once 4 MiB of the JIT checkpoint went up."""
    run.wait_for_event("step_end", step=STOP_AFTER, timeout=RUN_TIMEOUT)
    before = link.bytes_up
    run.send(signal.SIGTERM)
    deadline = time.monotonic() + 60
    while link.bytes_up - before < 4 * MiB:
        assert run.proc is not None and run.proc.poll() is None, run.tail()
        assert time.monotonic() < deadline, f"no upload after SIGTERM\n{run.tail()}"
        time.sleep(0.02)
    if fault == "kill":
        server.kill()
    else:
        link.cut()


def _assert_failed_naming(run: ToyRun, code: int, *, endpoint: str, key_prefix: str) -> str:
    assert code == 1, f"exit code {code}, expected 1 (the save failed)\n{run.tail()}"
    msg = run.termination_message()
    assert msg.reason == "failed" and msg.message, msg
    assert endpoint in msg.message, msg.message
    assert key_prefix in msg.message, msg.message  # s3://<bucket>/<key>
    return msg.message


def _assert_incomplete_and_nothing_partial(server: S3Server, url: str, step: int) -> None:
    info = CheckpointStore(url).inspect(f"checkpoint-{step}")
    assert not info.complete and SENTINEL_NAME in (info.reason or ""), info
    # the model file whose upload was under way was never published, not even truncated
    key = f"{url.removeprefix('s3://')}/checkpoint-{step}/model.safetensors"
    assert not client(server).exists(key), f"{key} was published by a failed upload"
    latest = CheckpointStore(url).latest_complete()
    assert latest is not None and latest.step == SAVE_STEPS, latest


def _resume_to_end_bit_identical(
    url: str, workdir: Path, attempt: int, env: dict[str, str], server: S3Server, ref: Reference
) -> None:
    run = _run(url, workdir, attempt, env)
    try:
        code = run.wait(RUN_TIMEOUT)
    finally:
        run.kill()
    assert code == 0, f"attempt {attempt} exited with {code}\n{run.tail()}"
    first = next(run.steps_begun(), None)
    assert first == SAVE_STEPS + 1, f"resumed at step {first}, not from checkpoint-{SAVE_STEPS}"
    final = download(server, f"{url}/checkpoint-{MAX_STEPS}", workdir / f"final-a{attempt}")
    ours = load_model_tensors(final)
    ballast = ours.pop("ballast")
    assert ballast.numel() * 4 == 24 * MiB
    theirs = load_model_tensors(ref.final_checkpoint)
    assert set(ours) == set(theirs)
    for name in sorted(ours):
        assert ours[name].equal(theirs[name]), f"{name} differs from the uninterrupted run"


def test_server_killed_mid_jit_upload_then_restarted_then_wrong_credentials(
    s3_server: S3Server,
    s3_bucket: str,
    s3_env: dict,
    link: FaultyLink,
    tmp_path: Path,
    reference: Reference,
) -> None:
    url = f"s3://{s3_bucket}/run"
    via_link = {**s3_env, "AWS_ENDPOINT_URL": link.endpoint}
    run = _run(url, tmp_path / "a1", 1, via_link)
    try:
        _preempt_into_upload(run, link, "kill", s3_server)
        code = run.wait(RUN_TIMEOUT)
    finally:
        run.kill()
    text = _assert_failed_naming(
        run, code, endpoint=link.endpoint, key_prefix=f"s3://{s3_bucket}/run/checkpoint-"
    )
    stopped = int(text.split("/checkpoint-")[1].split("/")[0])
    assert stopped >= STOP_AFTER, text

    s3_server.restart()  # between the attempts
    _assert_incomplete_and_nothing_partial(s3_server, url, stopped)

    wrong = {**s3_env, "AWS_SECRET_ACCESS_KEY": "not-the-secret"}
    run = _run(url, tmp_path / "a2", 2, wrong)
    try:
        code = run.wait(RUN_TIMEOUT)
    finally:
        run.kill()
    _assert_failed_naming(run, code, endpoint=s3_server.endpoint, key_prefix=repr(url))
    assert "wrong credentials" in run.termination_message().message  # type: ignore[operator]
    assert list(run.steps_begun()) == []

    _resume_to_end_bit_identical(url, tmp_path / "a3", 3, s3_env, s3_server, reference)


def test_network_cut_mid_jit_upload(
    s3_server: S3Server,
    s3_bucket: str,
    s3_env: dict,
    link: FaultyLink,
    tmp_path: Path,
    reference: Reference,
) -> None:
    url = f"s3://{s3_bucket}/run"
    # 5 s without an acknowledgement ends a connection (20 s by default): CI time
    env = {**s3_env, "AWS_ENDPOINT_URL": link.endpoint, "PREEMPTIBLE_S3_TCP_USER_TIMEOUT": "5"}
    run = _run(url, tmp_path / "a1", 1, env)
    try:
        _preempt_into_upload(run, link, "cut", s3_server)
        cut_at = time.monotonic()
        code = run.wait(RUN_TIMEOUT)
        took = time.monotonic() - cut_at
    finally:
        run.kill()
    text = _assert_failed_naming(
        run, code, endpoint=link.endpoint, key_prefix=f"s3://{s3_bucket}/run/checkpoint-"
    )
    # TCP_USER_TIMEOUT (5 s here) and three attempts bound it: inside the 90 s grace period
    print(f"network cut surfaced after {took:.1f} s")
    assert took < 45, f"the cut took {took:.0f} s to surface"
    stopped = int(text.split("/checkpoint-")[1].split("/")[0])
    link.restore()
    _assert_incomplete_and_nothing_partial(s3_server, url, stopped)
    _resume_to_end_bit_identical(url, tmp_path / "a2", 2, s3_env, s3_server, reference)


def test_read_only_bucket_during_the_jit_checkpoint(
    s3_server: S3Server, s3_bucket: str, s3_env: dict, tmp_path: Path, reference: Reference
) -> None:
    url = f"s3://{s3_bucket}/run"
    run = _run(url, tmp_path / "a1", 1, s3_env)
    try:
        run.wait_for_event("step_end", step=STOP_AFTER, timeout=RUN_TIMEOUT)
        with s3_server.read_only_bucket(s3_bucket):
            run.send(signal.SIGTERM)
            code = run.wait(RUN_TIMEOUT)
    finally:
        run.kill()
    text = _assert_failed_naming(
        run, code, endpoint=s3_server.endpoint, key_prefix=f"s3://{s3_bucket}/run/checkpoint-"
    )
    assert "full or read-only bucket" in text, text
    latest = CheckpointStore(url).latest_complete()
    assert latest is not None and latest.step == SAVE_STEPS, latest
    _resume_to_end_bit_identical(url, tmp_path / "a2", 2, s3_env, s3_server, reference)
