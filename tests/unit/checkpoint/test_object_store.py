"""The pure decisions of the object-store paths (part sizes, read ranges, client defaults, error
hints, checkpoints from one listing) and the generic fsspec upload on the in-memory store. The
behaviour against a real S3 server is tested in tests/s3/."""

from __future__ import annotations

import errno
import socket

import fsspec
import pytest

from trainer_runtime.checkpoint import object_store
from trainer_runtime.checkpoint.layout import infos_from_listing
from trainer_runtime.checkpoint.object_store import (
    accepts_socket_factory,
    error_hint,
    part_size,
    read_ranges,
    s3_options,
    tcp_socket,
)
from trainer_runtime.checkpoint.storage import Storage

MiB = 1 << 20


@pytest.mark.parametrize(
    ("index", "base", "expected"),
    [
        (1, 16 * MiB, 16 * MiB),
        (2000, 16 * MiB, 16 * MiB),
        (2001, 16 * MiB, 32 * MiB),
        (4001, 16 * MiB, 64 * MiB),
        (10_000, 16 * MiB, 256 * MiB),
        (1, 1 * MiB, 5 * MiB),  # never below S3's minimum part
    ],
)
def test_part_size(index: int, base: int, expected: int) -> None:
    assert part_size(index, base) == expected


def test_ten_thousand_parts_hold_about_a_terabyte() -> None:
    assert sum(part_size(i, 16 * MiB) for i in range(1, 10_001)) > 900 << 30
    with pytest.raises(ValueError):
        part_size(0, 16 * MiB)


@pytest.mark.parametrize(
    ("size", "chunk", "expected"),
    [
        (0, 4, []),
        (3, 4, [(0, 3)]),
        (8, 4, [(0, 4), (4, 8)]),
        (9, 4, [(0, 4), (4, 8), (8, 9)]),
    ],
)
def test_read_ranges(size: int, chunk: int, expected: list[tuple[int, int]]) -> None:
    assert read_ranges(size, chunk) == expected


@pytest.mark.parametrize(
    ("options", "environ", "retries"),
    [
        ({}, {}, {"max_attempts": 3, "mode": "standard"}),
        ({}, {"AWS_MAX_ATTEMPTS": "10"}, None),  # the user's environment wins
        ({}, {"AWS_RETRY_MODE": "adaptive"}, None),
        ({"config_kwargs": {"retries": {"max_attempts": 9}}}, {}, {"max_attempts": 9}),
    ],
)
def test_s3_options_add_bounded_retries_unless_the_user_set_them(
    options: dict, environ: dict, retries: dict | None
) -> None:
    out = s3_options(options, environ)
    assert out["config_kwargs"].get("retries") == retries
    assert out["config_kwargs"]["connect_timeout"] == 5
    assert out["config_kwargs"]["read_timeout"] == 15
    assert options == dict(options)  # not modified in place
    user = s3_options({"config_kwargs": {"read_timeout": 60}}, {})
    assert user["config_kwargs"]["read_timeout"] == 60
    # TCP_USER_TIMEOUT through aiobotocore's socket_factory, where it accepts one
    assert s3_options({}, {}, socket_factory=True)["config_kwargs"]["connector_args"] == {
        "socket_factory": tcp_socket
    }
    assert "connector_args" not in s3_options({}, {}, socket_factory=False)["config_kwargs"]


@pytest.mark.parametrize(
    ("version", "accepted"),
    [("2.25.2", False), ("3.0.0", False), ("3.1.0", True), ("3.10.0", True), ("4", True)],
)
def test_which_aiobotocore_takes_a_socket_factory(version: str, accepted: bool) -> None:
    assert accepts_socket_factory(version) is accepted


def test_the_sockets_of_the_s3_client_give_up_on_unacknowledged_data() -> None:
    info = socket.getaddrinfo("127.0.0.1", 80, socket.AF_INET, socket.SOCK_STREAM)[0]
    with tcp_socket(info) as sock:
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        timeout = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)
        assert timeout == int(object_store.TCP_USER_TIMEOUT * 1000) > 0


class NoCredentialsError(Exception):
    pass


class EndpointConnectionError(Exception):
    pass


@pytest.mark.parametrize(
    ("exc", "fragment"),
    [
        (NoCredentialsError("Unable to locate credentials"), "AWS_ACCESS_KEY_ID"),
        (PermissionError("InvalidAccessKeyId: the key"), "credentials are wrong"),
        (FileNotFoundError(errno.ENOENT, "bucket 'x' does not exist"), "bucket does not exist"),
        (PermissionError(errno.EACCES, "Forbidden"), "access denied"),
        (FileExistsError("pre-conditions"), "another writer published it first"),
        (EndpointConnectionError("Could not connect"), "endpoint cannot be reached"),
        (OSError(121, "We encountered an internal error"), "full or read-only bucket"),
        (OSError(5, "(InsufficientStorage) No space left on device"), "storage is full"),
        (ValueError("something else"), None),
    ],
)
def test_error_hint(exc: BaseException, fragment: str | None) -> None:
    hint = error_hint(exc)
    if fragment is None:
        assert hint is None
    else:
        assert hint is not None and fragment in hint


def test_infos_from_listing_apply_the_commit_order_without_reading_manifests() -> None:
    listing = {
        "checkpoint-2/manifest.json": 100,
        "checkpoint-2/model.safetensors": 10,
        "checkpoint-4/checkpoint-is-incomplete.txt": 5,
        "checkpoint-4/manifest.json": 100,  # being rewritten: the sentinel wins
        "checkpoint-6/trainer_state.json": 3,  # a stock transformers checkpoint
        "checkpoint-6/model.safetensors": 7,
        "checkpoint-8/model.safetensors": 10,  # neither: an abandoned write
        ".preemptible-attempts/attempt-1.json": 2,
        "runs/x": 1,
        "checkpoint-x/manifest.json": 1,
    }
    infos = infos_from_listing("s3://b/run/", listing)
    assert [(i.name, i.complete, i.size_bytes) for i in infos] == [
        ("checkpoint-2", True, 110),
        ("checkpoint-4", False, 105),
        ("checkpoint-6", True, 10),
        ("checkpoint-8", False, 10),
    ]
    assert infos[0].path == "s3://b/run/checkpoint-2"
    assert "sentinel" in (infos[1].reason or "")


def test_a_failed_write_to_the_in_memory_store_leaves_nothing() -> None:
    fs = fsspec.filesystem("memory")
    fs.pipe_file("/objstore-29/keep.bin", b"old")
    storage = Storage("memory://objstore-29")

    class Interrupted(Exception):
        pass

    for name in ("keep.bin", "new.bin"):
        with pytest.raises(Interrupted), storage.open_write(name) as fh:
            fh.write(b"partial")
            raise Interrupted
    # (the in-memory store replaced the old file when it was opened: it is gone, not partial)
    assert not fs.exists("/objstore-29/keep.bin")
    assert not fs.exists("/objstore-29/new.bin")
    storage.write_bytes("m.json", b"{}", exclusive=True)
    with pytest.raises(Exception, match="exists"):
        storage.write_bytes("m.json", b"{}", exclusive=True)
    fs.rm("/objstore-29", recursive=True)
