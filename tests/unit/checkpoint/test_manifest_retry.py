"""Issue 37: the manifest's conditional create, refused because the manifest exists, is told
apart by the save's token: our own earlier try (its response lost, the client retried) commits;
another writer's does not. On the in-memory object store (an exclusive create there is a
check-then-write); the lost response itself, on the real S3 server: tests/s3."""

from __future__ import annotations

import json
import uuid

import pytest
import torch

from trainer_runtime.checkpoint.io import CheckpointWriter
from trainer_runtime.checkpoint.layout import MANIFEST_NAME, CheckpointStore
from trainer_runtime.checkpoint.storage import Storage
from trainer_runtime.errors import CheckpointError


@pytest.mark.parametrize(
    ("there", "committed"),
    [
        ("ours", True),  # our earlier try was done by the store: the retry meets it
        ("another token", False),
        ("no token", False),  # a writer of an older version
        ("not json", False),
    ],
)
def test_an_existing_manifest_is_ours_only_with_our_token(there: str, committed: bool) -> None:
    url = f"memory://manifest-retry-{uuid.uuid4().hex}/out"
    writer = CheckpointWriter(url, 3, attempt=1)
    writer.begin()
    writer.write_tensors("model.safetensors", {"w": torch.arange(4.0)})
    manifest = {"format": "preemptible-checkpoint/1", "step": 3, "files": []}
    if there == "ours":
        # what our own first try published (its files, our token), before its response was lost
        manifest = {**manifest, "files": writer.files, "commit_token": writer._token}
    elif there == "another token":
        manifest["commit_token"] = uuid.uuid4().hex
    body = b"{" if there == "not json" else json.dumps(manifest).encode()
    Storage(url).write_bytes(f"checkpoint-3/{MANIFEST_NAME}", body)
    if committed:
        info = writer.commit()
        assert info.complete and info.step == 3
        assert writer.discard() == []  # a failed save's clean-up leaves a committed one alone
        (only,) = CheckpointStore(url).list()
        assert only.complete, only
        return
    with pytest.raises(CheckpointError, match=r"another writer first|cannot be read back"):
        writer.commit()
    assert not CheckpointStore(url).inspect("checkpoint-3").complete
