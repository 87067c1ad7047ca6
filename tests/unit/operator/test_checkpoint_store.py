"""The operator's storage view: path map and the completeness rule over real files."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from fsspec import register_implementation

from preemptible_operator import checkpoint_store
from preemptible_operator.checkpoint_store import (
    CheckpointView,
    PathMap,
    StorageReads,
    parse_path_map,
)
from preemptible_operator.resume import LATEST, resume_checkpoint
from trainer_runtime.checkpoint.layout import CheckpointStore
from trainer_runtime.errors import StorageError
from trainer_runtime.testing import SlowLocalFileSystem


@pytest.mark.parametrize(
    ("entries", "pod_uri", "expected"),
    [
        ([], "/ckpt/run", None),
        (["/ckpt=/mnt/ckpt"], "/ckpt/run", "/mnt/ckpt/run"),
        (["/ckpt=/mnt/ckpt"], "/ckpt", "/mnt/ckpt"),
        (["/ckpt=/mnt/ckpt"], "/ckpts/run", None),  # prefix must end at a path boundary
        (["/ckpt=/a", "/ckpt/run=/b"], "/ckpt/run/x", "/b/x"),  # longest prefix wins
        (["s3://bucket=s3://bucket"], "s3://bucket/job", "s3://bucket/job"),
        (["/data/=/data/"], "/data/job", "/data/job"),
    ],
)
def test_path_map(entries: list[str], pod_uri: str, expected: str | None) -> None:
    assert parse_path_map(entries).to_operator(pod_uri) == expected


def test_parse_path_map_rejects_bad_entries() -> None:
    with pytest.raises(ValueError, match="POD_PREFIX=OPERATOR_PREFIX"):
        parse_path_map(["/ckpt"])


def _checkpoint(root: Path, step: int, *, complete: bool, truncate: bool = False) -> None:
    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"x" * 10)
    if not complete:
        (d / "checkpoint-is-incomplete.txt").write_text("{}")
        return
    manifest = {
        "format": "preemptible-checkpoint/1",
        "step": step,
        "world_size": 1,
        "attempt": 1,
        "save_seconds": 0.5,
        "created_at": "2026-01-01T00:00:00Z",
        "files": [{"path": "model.safetensors", "size": 10, "sha256": "0"}],
    }
    (d / "manifest.json").write_text(json.dumps(manifest))
    if truncate:
        (d / "model.safetensors").write_bytes(b"x" * 3)


def test_snapshot_reports_latest_complete_and_incomplete(tmp_path: Path) -> None:
    host = tmp_path / "host"
    _checkpoint(host, 5, complete=True)
    _checkpoint(host, 10, complete=True, truncate=True)
    _checkpoint(host, 15, complete=False)
    view = CheckpointView("/ckpt/run", PathMap(((("/ckpt/run"), str(host)),)))
    snap = view.snapshot()
    assert snap is not None and snap.latest_complete is not None
    assert snap.latest_complete.step == 5
    assert snap.latest_complete_path == "/ckpt/run/checkpoint-5"  # as the pods see it
    assert snap.latest_complete.save_seconds == 0.5
    incomplete = {info.step: (path, info.reason) for info, path in snap.incomplete}
    assert set(incomplete) == {10, 15}
    assert incomplete[15][0] == "/ckpt/run/checkpoint-15"
    assert "size" in (incomplete[10][1] or "") and "sentinel" in (incomplete[15][1] or "")


def test_unmapped_or_missing_root_is_not_visible_and_an_empty_one_is_seen(
    tmp_path: Path,
) -> None:
    assert CheckpointView("/elsewhere", PathMap()).snapshot() is None
    # A missing directory is not an empty one: the map may point at another volume than the
    # pods' (the chart maps the operator's own PVC path for every namespace).
    missing = CheckpointView("/c", PathMap((("/c", str(tmp_path / "missing")),)))
    assert missing.snapshot() is None
    (tmp_path / "empty").mkdir()
    empty = CheckpointView("/c", PathMap((("/c", str(tmp_path / "empty")),)))
    snap = empty.snapshot()
    assert snap is not None and snap.latest_complete is None and snap.incomplete == ()


def test_a_missing_root_raises_not_found_only_when_asked(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "missing"))
    assert store.names() == [] and store.newest(3) == []  # the runtime: nothing saved yet
    with pytest.raises(StorageError) as err:
        store.names(missing_ok=False)
    assert err.value.not_found
    with pytest.raises(StorageError):
        store.newest(3, missing_ok=False)


def test_newest_stops_at_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    for step in (5, 10):
        _checkpoint(tmp_path, step, complete=True)
    for step in (15, 20, 25):
        _checkpoint(tmp_path, step, complete=False)
    store = CheckpointStore(str(tmp_path))
    assert [i.step for i in store.newest(8)] == [25, 20, 15, 10]
    assert [i.step for i in store.newest(2)] == [25, 20]  # bounded: none complete among them
    view = CheckpointView("/c", PathMap((("/c", str(tmp_path)),)))
    snap = view.snapshot(limit=2)
    assert snap is not None and snap.latest_complete is None
    assert [i.step for i, _ in snap.incomplete] == [20, 25]


class _ProbeFS(SlowLocalFileSystem):
    """``probefile://``: the local disk through fsspec, counting calls; with ``hang`` set every
    metadata call and read blocks (like a dead NFS server) until ``release`` is set, and with
    ``fail`` set it raises that error."""

    protocol = ("probefile",)
    calls: ClassVar[Counter[str]] = Counter()
    hang = False
    delay = 0.0
    release = threading.Event()
    fail: ClassVar[list[Exception]] = []

    def _probe(self, what: str) -> None:
        type(self).calls[what] += 1
        if self.fail:
            raise self.fail[0]
        if self.hang:
            # a safety net: the old code would otherwise keep the test run waiting for good
            self.release.wait(20)
        time.sleep(self.delay)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        self._probe("ls")
        return super().ls(path, detail=detail, **kwargs)

    def exists(self, path: str, **kwargs: Any) -> bool:
        self._probe("exists")
        return super().exists(path, **kwargs)

    def find(self, path: str, *args: Any, **kwargs: Any) -> Any:
        self._probe("find")
        return super().find(path, *args, **kwargs)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kw: Any):
        self._probe("read " + path.rsplit("/", 1)[-1])
        return super().cat_file(path, start=start, end=end, **kw)


@pytest.fixture
def probe() -> Iterator[type[_ProbeFS]]:
    register_implementation("probefile", _ProbeFS, clobber=True)
    _ProbeFS.calls.clear()
    _ProbeFS.hang = False
    _ProbeFS.delay = 0.0
    _ProbeFS.fail.clear()
    _ProbeFS.release = threading.Event()
    yield _ProbeFS
    _ProbeFS.release.set()  # let a hung read of this test end
    _ProbeFS.hang = False
    deadline = time.monotonic() + 5
    while checkpoint_store._in_flight and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_thousand_checkpoints_cost_a_listing_and_the_newest_few_manifests(
    tmp_path: Path, probe: type[_ProbeFS]
) -> None:
    for step in range(1, 1001):
        _checkpoint(tmp_path, step, complete=step <= 998)
    view = CheckpointView("/c", PathMap((("/c", f"probefile://{tmp_path}"),)))
    snap = view.snapshot()
    assert snap is not None and snap.latest_complete is not None
    assert snap.latest_complete.step == 998
    assert [i.step for i, _ in snap.incomplete] == [999, 1000]
    assert probe.calls["read manifest.json"] == 1  # checkpoint-998's only
    assert probe.calls["find"] == 3  # checkpoints 1000, 999, 998 looked into
    assert probe.calls["ls"] == 1  # the names, one listing


def test_recording_and_creating_share_one_look(tmp_path: Path, probe: type[_ProbeFS]) -> None:
    _checkpoint(tmp_path, 4, complete=True)
    view = CheckpointView("/c", PathMap((("/c", f"probefile://{tmp_path}"),)))
    now = [100.0]
    reads = StorageReads(reuse_seconds=60.0, clock=lambda: now[0])
    first = reads.snapshot(view, ("uid", 1))  # the pass recording attempt 1
    now[0] += 1
    assert reads.snapshot(view, ("uid", 1)) is first  # the pass creating attempt 2
    assert probe.calls["read manifest.json"] == 1 and probe.calls["ls"] == 1
    reads.snapshot(view, ("uid", 2))  # another attempt: a new look
    now[0] += 60
    reads.snapshot(view, ("uid", 1))  # too old to reuse
    assert probe.calls["read manifest.json"] == 3


def test_a_hung_storage_call_ends_the_look_in_time_and_resume_is_latest(
    tmp_path: Path, probe: type[_ProbeFS]
) -> None:
    _checkpoint(tmp_path, 4, complete=True)
    view = CheckpointView("/c", PathMap((("/c", f"probefile://{tmp_path}"),)))
    reads = StorageReads(timeout=0.5)
    probe.hang = True
    began = time.monotonic()
    snap = reads.snapshot(view, ("uid", 1))
    took = time.monotonic() - began
    assert snap is None and took < 2.0, took
    choice = resume_checkpoint(snap is not None, None, None)
    assert choice.resume_from == LATEST
    # The first read still hangs: a second look at the root does not start another thread
    # (and does not wait either).
    began = time.monotonic()
    assert view.snapshot(timeout=5.0) is None
    assert time.monotonic() - began < 1.0
    assert probe.calls["exists"] == 1
    # Once storage answers again, so does the look.
    probe.hang = False
    probe.release.set()
    deadline = time.monotonic() + 5
    while checkpoint_store._in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    snap = view.snapshot(timeout=5.0)
    assert snap is not None and snap.latest_complete is not None
    assert snap.latest_complete.step == 4


def test_hung_reads_of_many_roots_are_capped(tmp_path: Path, probe: type[_ProbeFS]) -> None:
    probe.hang = True
    cap = checkpoint_store.MAX_READS_IN_FLIGHT
    views = [
        CheckpointView(f"/c/{i}", PathMap((("/c", f"probefile://{tmp_path}"),)))
        for i in range(cap + 3)
    ]
    began = time.monotonic()
    assert all(v.snapshot(timeout=0.05) is None for v in views)
    assert probe.calls["exists"] == cap  # the rest never started a thread
    assert time.monotonic() - began < 0.05 * cap + 1.0


def test_a_burst_of_slow_but_answering_looks_is_not_refused(
    tmp_path: Path, probe: type[_ProbeFS]
) -> None:
    """Only reads past their deadline count against the cap: many requeues at once (a mass
    preemption) each get their look."""
    probe.delay = 0.05
    n = 3 * checkpoint_store.MAX_READS_IN_FLIGHT
    for i in range(n):
        _checkpoint(tmp_path / str(i), 2, complete=True)
    views = [
        CheckpointView(f"/c/{i}", PathMap((("/c", f"probefile://{tmp_path}"),))) for i in range(n)
    ]
    seen: list[object] = [None] * n

    def look(i: int) -> None:
        seen[i] = views[i].snapshot(timeout=30.0)

    threads = [threading.Thread(target=look, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(s is not None for s in seen)


@pytest.mark.parametrize(
    "error",
    [
        PermissionError(13, "Permission denied"),
        OSError(5, "Input/output error"),
        TimeoutError(),
        ValueError("a backend bug"),
    ],
)
def test_a_storage_error_is_not_visible(
    tmp_path: Path, probe: type[_ProbeFS], error: Exception
) -> None:
    probe.fail.append(error)
    view = CheckpointView("/c", PathMap((("/c", f"probefile://{tmp_path}"),)))
    assert view.snapshot() is None


def test_recording_an_attempt_over_hung_storage_ends_in_time(
    tmp_path: Path, probe: type[_ProbeFS]
) -> None:
    """The reconciler's pass that records an ended attempt, over a root whose every call blocks:
    it returns within the deadline with the runtime's report, and the pass creating the next
    attempt reuses that look instead of waiting again."""
    import kubernetes

    from preemptible_operator import models
    from preemptible_operator.classify import Interruption
    from preemptible_operator.conditions import Reason
    from preemptible_operator.reconcile import OperatorConfig, Reconciler, _Observed
    from preemptible_operator.recording import record_attempt_end
    from tests.unit.operator.builders import make_spec

    path_map = PathMap((("/ckpt", f"probefile://{tmp_path}"),))
    r = Reconciler(kubernetes.client.ApiClient(), OperatorConfig(path_map=path_map))
    r._storage = StorageReads(timeout=0.5)
    spec = make_spec()
    meta = {"namespace": "ns", "name": "tj", "uid": "u1", "generation": 1}
    status = models.TrainingJobStatus(
        last_complete_checkpoint=models.CheckpointRef(step=6, path="/ckpt/run/checkpoint-6")
    )
    record = models.AttemptRecord(attempt=1, job_name="tj-a1", grace_seconds=30)
    obs = _Observed(
        obj={"metadata": meta},
        status=status,
        spec=spec,
        invalid=None,
        jobs={},
        pods_by_attempt={},
        attempt=1,
        job=None,
        pods=[],
        workload=None,
        workload_version=None,
        node_ready={},
    )
    view = CheckpointView(spec.checkpoint.uri, path_map)
    probe.hang = True
    began = time.monotonic()
    look = r._end_look(obs, record, view)  # the record_attempt action's look
    record_attempt_end(
        status, record, spec, [], Interruption("Preempted", Reason.KUEUE_EVICTED, "evicted"),
        look, "2026-12-04T00:00:00Z", time.time(), 1,
    )  # fmt: skip
    assert time.monotonic() - began < 2.0
    assert record.checkpoint == "/ckpt/run/checkpoint-6"  # the runtime's report stands
    # The create pass's look (key: the attempt just recorded) is the same one, at once.
    began = time.monotonic()
    assert r._storage.snapshot(view, ("u1", 1)) is None
    assert time.monotonic() - began < 0.1
    assert probe.calls["exists"] == 1


class _SlowForReaders:
    """The module's lock, slow to take in a reader thread: the reader is descheduled at the end
    of its read, as on a loaded machine."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        if threading.current_thread().name == "checkpoint-read":
            time.sleep(0.2)
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_a_look_right_after_a_finished_one_is_not_refused_as_overlapping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _checkpoint(tmp_path, 4, complete=True)
    monkeypatch.setattr(checkpoint_store, "_in_flight_lock", _SlowForReaders())
    view = CheckpointView("/c", PathMap((("/c", str(tmp_path)),)))
    for _ in range(3):
        snap = view.snapshot(timeout=5.0)
        assert snap is not None and snap.latest_complete is not None, "refused as overlapping"
