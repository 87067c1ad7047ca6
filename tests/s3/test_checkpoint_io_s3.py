"""The storage seam, the writer and the reader against the real S3 server, in this process:
streamed multipart uploads that publish nothing on an error, the manifest as a conditional create,
the attempt fence and rotation at a cost that does not grow with the number of checkpoints,
parallel ranged reads with the checksum beside them, and the checks before training."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.cluster.s3 import FaultyLink, S3Server
from tests.s3.helpers import S3Calls, client
from trainer_runtime.checkpoint import object_store
from trainer_runtime.checkpoint.io import CheckpointReader, CheckpointWriter, rotate_checkpoints
from trainer_runtime.checkpoint.layout import (
    ATTEMPTS_DIR,
    MANIFEST_NAME,
    CheckpointStore,
    registered_attempts,
)
from trainer_runtime.checkpoint.storage import Storage
from trainer_runtime.errors import CheckpointError, ResumeError, StorageError

pytestmark = [pytest.mark.s3]

MiB = 1 << 20


@pytest.fixture
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """S3's smallest parts and 4 MiB ranges, so a few MiB make a multipart upload / many reads."""
    monkeypatch.setattr(object_store, "PART_BYTES", 5 * MiB)
    monkeypatch.setattr(object_store, "READ_CHUNK", 4 * MiB)


def _uploads_in_progress(server: S3Server, bucket: str) -> list[dict]:
    fs = client(server)
    return fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])


def test_a_large_file_streams_in_parallel_parts_and_reads_back_in_ranges(
    s3_server: S3Server, s3_bucket: str, s3_env: dict, small_parts: None
) -> None:
    storage = Storage(f"s3://{s3_bucket}/run")
    data = os.urandom(23 * MiB)
    with S3Calls(storage.fs) as calls, storage.open_write("c/big.bin") as fh:
        for start in range(0, len(data), 3 * MiB):
            fh.write(data[start : start + 3 * MiB])
    assert calls.calls["CreateMultipartUpload"] == 1
    assert calls.calls["UploadPart"] == 5  # 4 parts of 5 MiB and the last 3 MiB
    assert calls.max_inflight["UploadPart"] >= 2, "parts were uploaded one after another"
    assert calls.calls["CompleteMultipartUpload"] == 1
    assert fh.size == len(data)
    assert client(s3_server).cat_file(f"{s3_bucket}/run/c/big.bin") == data

    blocks: list[bytes] = []
    buf = bytearray(len(data))
    with S3Calls(storage.fs) as calls:
        storage.read_into("c/big.bin", memoryview(buf), lambda b: blocks.append(bytes(b)))
    assert buf == data
    assert b"".join(blocks) == data  # in file order
    assert len(calls.ranges) == 6 and calls.max_inflight["GetObject"] >= 2, calls.ranges


def test_an_error_mid_upload_publishes_nothing_and_keeps_the_old_object(
    s3_server: S3Server, s3_bucket: str, s3_env: dict, small_parts: None
) -> None:
    storage = Storage(f"s3://{s3_bucket}/run")
    storage.write_bytes("model.safetensors", b"the committed version")

    class Interrupted(Exception):
        pass

    with pytest.raises(Interrupted), storage.open_write("model.safetensors") as fh:
        fh.write(os.urandom(12 * MiB))  # two parts are uploaded already
        raise Interrupted
    with pytest.raises(Interrupted), storage.open_write("new.safetensors") as fh:
        fh.write(os.urandom(1 * MiB))  # less than a part: nothing was sent yet
        raise Interrupted
    fs = client(s3_server)
    assert fs.cat_file(f"{s3_bucket}/run/model.safetensors") == b"the committed version"
    assert not fs.exists(f"{s3_bucket}/run/new.safetensors")
    assert _uploads_in_progress(s3_server, s3_bucket) == []  # aborted, not left behind


def test_the_manifest_is_a_conditional_create(
    s3_server: S3Server, s3_bucket: str, s3_env: dict
) -> None:
    url = f"s3://{s3_bucket}/run"
    writer = CheckpointWriter(url, 5, attempt=1)
    writer.begin()
    writer.write_tensors("model.safetensors", {"w": torch.arange(10.0)})
    # Another writer commits between our sentinel check and our manifest (the race a
    # check-then-write cannot close): the store refuses our manifest.
    rival = b'{"format": "preemptible-checkpoint/1", "files": [], "step": 5, "rival": true}'
    Storage(url).write_bytes(f"checkpoint-5/{MANIFEST_NAME}", rival)
    with pytest.raises(CheckpointError, match="written by another writer first"):
        writer.commit()
    assert client(s3_server).cat_file(f"{s3_bucket}/run/checkpoint-5/{MANIFEST_NAME}") == rival


def test_a_lost_response_to_the_manifest_put_is_recognised_as_our_own_commit(
    s3_server: S3Server, s3_bucket: str, s3_env: dict
) -> None:
    """Issue 37: the store did our manifest PUT but its response was lost on the way back; the
    client's retry meets the manifest (412) and must not take it for another writer's (the
    save's discard would then remove our own committed checkpoint)."""
    link = FaultyLink(s3_server.port)
    try:
        options = {**s3_server.storage_options(), "endpoint_url": link.endpoint}
        url = f"s3://{s3_bucket}/run"
        writer = CheckpointWriter(url, 5, attempt=1, storage_options=options)
        writer.begin()
        writer.write_tensors("model.safetensors", {"w": torch.arange(10.0)})
        link.drop_response_once(f"PUT /{s3_bucket}/run/checkpoint-5/{MANIFEST_NAME}".encode())
        info = writer.commit()
        assert info.complete and info.step == 5
        puts = [r for r in link.requests if r.startswith(b"PUT") and MANIFEST_NAME.encode() in r]
        assert len(link.dropped) == 1 and len(puts) == 2, (link.dropped, puts)
        writer.discard()  # what a failed save does: nothing, the checkpoint is committed
    finally:
        link.close()
    store = CheckpointStore(url)
    (only,) = store.list()
    assert only.complete and only.step == 5, only
    assert CheckpointReader(only.path).load_tensors("model.safetensors")["w"].tolist() == list(
        range(10)
    )


def _write_checkpoint(url: str, step: int, attempt: int) -> None:
    writer = CheckpointWriter(url, step, attempt=attempt)
    writer.begin()
    writer.write_tensors("model.safetensors", {"w": torch.full((64,), float(step))})
    writer.write_json("trainer_state.json", {"global_step": step})
    writer.commit()


def _save_and_rotate(url: str, step: int, limit: int, fs: object) -> S3Calls:
    with S3Calls(fs) as calls:
        _write_checkpoint(url, step, attempt=3)
        removed = rotate_checkpoints(url, limit, protect=[f"checkpoint-{step}"], attempt=3)
    assert len(removed) == 1, removed
    return calls


def test_fence_and_rotation_cost_the_same_with_3_or_15_checkpoints(
    s3_server: S3Server, s3_bucket: str, s3_env: dict
) -> None:
    counts = {}
    for n in (3, 15):
        url = f"s3://{s3_bucket}/run-{n}"
        for step in range(1, n + 1):
            _write_checkpoint(url, step, attempt=3)
        calls = _save_and_rotate(url, n + 1, n, Storage(url).fs)
        # no manifest of an older checkpoint is read: nothing is inspected per checkpoint
        manifests = [k for op, k in calls.keys if op == "GetObject" and k.endswith(MANIFEST_NAME)]
        assert all(f"checkpoint-{n + 1}/" in k for k in manifests), manifests
        counts[n] = dict(calls.calls)
        left = [c.step for c in CheckpointStore(url).list()]
        assert left == list(range(2, n + 2)), left  # the oldest went, the newest stayed
    assert counts[3] == counts[15], counts


def test_a_newer_attempt_fences_an_older_one(s3_env: dict, s3_bucket: str) -> None:
    url = f"s3://{s3_bucket}/run"
    _write_checkpoint(url, 4, attempt=2)
    _write_checkpoint(url, 6, attempt=3)
    assert registered_attempts(Storage(url)) == [2, 3]
    stale = CheckpointWriter(url, 8, attempt=2)
    with pytest.raises(CheckpointError, match=f"attempt 3 writes checkpoints.*{ATTEMPTS_DIR}"):
        stale.begin()
    with pytest.raises(CheckpointError, match="stale attempt"):
        rotate_checkpoints(url, 1, attempt=2)
    assert [c.step for c in CheckpointStore(url).list()] == [4, 6]


def test_resume_reads_ranges_and_checks_the_checksum_beside_them(
    s3_server: S3Server, s3_bucket: str, s3_env: dict, small_parts: None
) -> None:
    url = f"s3://{s3_bucket}/run"
    weights = {"a": torch.randn(3 * MiB), "b": torch.arange(1000, dtype=torch.int64)}  # 12 MiB
    writer = CheckpointWriter(url, 7, attempt=1)
    writer.begin()
    writer.write_tensors("model.safetensors", weights)
    writer.commit()

    reader = CheckpointReader(f"{url}/checkpoint-7")
    with S3Calls(reader.storage.fs) as calls:
        tensors, _ = reader.load_tensors_and_metadata("model.safetensors")
    reader.wait_verified()
    assert all(torch.equal(tensors[k], weights[k]) for k in weights)
    assert len(calls.ranges) >= 3, calls.ranges

    # The same bytes count with one flipped: only the checksum can tell.
    stored = s3_server.bucket_dir(s3_bucket) / "run" / "checkpoint-7" / "model.safetensors"
    raw = bytearray(stored.read_bytes())
    raw[-5] ^= 0xFF
    stored.write_bytes(bytes(raw))
    reader = CheckpointReader(f"{url}/checkpoint-7")
    reader.load_tensors_and_metadata("model.safetensors")
    with pytest.raises(ResumeError, match=r"model\.safetensors .* is corrupt: xxh3_128"):
        reader.wait_verified()


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("missing bucket", "bucket 'no-such-bucket-29' does not exist"),
        ("wrong secret", "denied .*wrong credentials"),
        ("no credentials", "Unable to locate credentials.*AWS_ACCESS_KEY_ID"),
        ("unknown scheme", "Protocol not known: nosuchfs.*preemptible\\[s3\\]"),
        ("read-only bucket", "HTTP 500\\): a full or read-only bucket"),
    ],
)
def test_checks_before_training_name_the_url_and_the_endpoint(
    case: str,
    expected: str,
    s3_server: S3Server,
    s3_bucket: str,
    s3_env: dict,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = {
        "missing bucket": "s3://no-such-bucket-29/run",
        "unknown scheme": "nosuchfs://somewhere/run",
    }.get(case, f"s3://{s3_bucket}/run")
    if case == "wrong secret":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    if case == "no credentials":
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
        monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    options = {"skip_instance_cache": True}
    with pytest.raises(StorageError, match=expected) as caught:
        if case == "read-only bucket":
            with s3_server.read_only_bucket(s3_bucket):
                Storage(url, options).check_access(write=True)
        else:
            Storage(url, options).check_access(write=True)
    message = str(caught.value)
    assert repr(url.rstrip("/")) in message, message
    if case != "unknown scheme":
        assert f"at endpoint {s3_server.endpoint}" in message, message
    # reading needs no write access: the read-only bucket still passes for a reader
    if case == "read-only bucket":
        with s3_server.read_only_bucket(s3_bucket):
            Storage(url, options).check_access(write=False)


def test_the_checks_create_no_bucket_and_leave_no_probe(
    s3_server: S3Server, s3_bucket: str, s3_env: dict, tmp_path: Path
) -> None:
    Storage(f"s3://{s3_bucket}/run").check_access(write=True)
    assert client(s3_server).find(s3_bucket) == []
    with pytest.raises(StorageError):
        Storage("s3://never-created-29/run").check_access(write=True)
    assert not s3_server.bucket_dir("never-created-29").exists()


def test_a_full_bucket_fails_the_upload_and_publishes_nothing(
    s3_server: S3Server, s3_bucket: str, s3_env: dict, small_parts: None
) -> None:
    storage = Storage(f"s3://{s3_bucket}/run")
    storage.write_bytes("kept.json", b"{}")
    with s3_server.full_bucket(s3_bucket, 8 * MiB):
        with pytest.raises(StorageError) as caught, storage.open_write("c/big.bin") as fh:
            fh.write(os.urandom(20 * MiB))
        message = str(caught.value)
        assert f"s3://{s3_bucket}/run/c/big.bin" in message, message
        assert f"at endpoint {s3_server.endpoint}" in message, message
        assert "storage is full" in message, message
        fs = client(s3_server)
        assert not fs.exists(f"{s3_bucket}/run/c/big.bin")
        assert fs.cat_file(f"{s3_bucket}/run/kept.json") == b"{}"
