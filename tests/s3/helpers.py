"""Helpers of the tests on the tier's real S3 server: a client of the test's own, downloading a
checkpoint to compare it with local files, and ``S3Calls``, which counts the requests an s3fs
filesystem makes, by operation."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.s3 import S3Server

s3fs = pytest.importorskip("s3fs", reason="s3fs is the S3 client: pip install 'preemptible[s3]'")


def client(server: S3Server) -> Any:
    """A client of our own (not the cached instance the code under test uses)."""
    return s3fs.S3FileSystem(**server.storage_options(), skip_instance_cache=True)


def download(server: S3Server, url: str, dest: Path) -> Path:
    """Copy the checkpoint directory ``url`` to ``dest`` (to compare weights with local ones)."""
    fs = client(server)
    root = url.removeprefix("s3://").rstrip("/")
    for key in fs.find(root):
        target = dest / key[len(root) + 1 :]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(fs.cat_file(key))
    return dest


class S3Calls:
    """Counts the S3 API calls an s3fs filesystem makes (botocore's before-call event), and the
    most calls of one operation in flight at once."""

    def __init__(self, fs: Any) -> None:
        fs.connect()
        self._events = fs.s3.meta.events
        self.calls: Counter[str] = Counter()
        self.keys: list[tuple[str, str]] = []
        self.ranges: list[str] = []
        self._inflight: Counter[str] = Counter()
        self.max_inflight: Counter[str] = Counter()
        self._lock = threading.Lock()

    def _before(self, params: dict[str, Any], model: Any, **_: Any) -> None:
        with self._lock:
            self.calls[model.name] += 1
            self.keys.append((model.name, str(params.get("url_path", ""))))
            headers = params.get("headers") or {}
            if model.name == "GetObject" and "Range" in headers:
                self.ranges.append(str(headers["Range"]))
            self._inflight[model.name] += 1
            self.max_inflight[model.name] = max(
                self.max_inflight[model.name], self._inflight[model.name]
            )

    def _after(self, model: Any, **_: Any) -> None:
        with self._lock:
            self._inflight[model.name] -= 1

    def __enter__(self) -> S3Calls:
        self._events.register("before-call.s3", self._before)
        self._events.register("after-call.s3", self._after)
        return self

    def __exit__(self, *exc: object) -> None:
        self._events.unregister("before-call.s3", self._before)
        self._events.unregister("after-call.s3", self._after)

    @property
    def total(self) -> int:
        return sum(self.calls.values())
