"""CheckpointWriter with one copy per node (``each_node``, the save_on_each_node protocol).

Ranks are threads; ``gather`` is a real all-gather between them (a barrier and a shared list), so
the writer's agreement steps run as they would across processes. Two "nodes" of two ranks each
write to two different directories, as nodes with their own disks would.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer_runtime.checkpoint.io import CheckpointReader, CheckpointWriter
from trainer_runtime.checkpoint.layout import SENTINEL_NAME, CheckpointStore
from trainer_runtime.errors import CheckpointError

WORLD = 4
PER_NODE = 2


class ThreadGather:
    """An all-gather of Python objects between ``world`` threads (one round at a time)."""

    def __init__(self, world: int) -> None:
        self.slots: list[Any] = [None] * world
        self.barrier = threading.Barrier(world, timeout=60)

    def for_rank(self, rank: int) -> Callable[[Any], list[Any]]:
        def gather(obj: Any) -> list[Any]:
            self.slots[rank] = obj
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()  # nobody overwrites a slot before everyone copied the round
            return out

        return gather


def _run(body: Callable[[int, Callable[[Any], list[Any]]], Any]) -> list[Any]:
    g = ThreadGather(WORLD)
    results: list[Any] = [None] * WORLD

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank, g.for_rank(rank))
        except BaseException as exc:
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results


def _writer(
    out: Path, rank: int, gather: Callable[[Any], list[Any]], step: int
) -> CheckpointWriter:
    return CheckpointWriter(
        str(out),
        step,
        rank=rank,
        world_size=WORLD,
        attempt=1,
        barrier=lambda: None,  # each_node agrees through gather, never through the barrier
        each_node=True,
        local_rank=rank % PER_NODE,
        node=str(rank // PER_NODE),
        gather=gather,
    )


def _save(
    dirs: list[Path], step: int, fail: Callable[[int], None] | None = None
) -> Callable[[int, Callable[[Any], list[Any]]], Any]:
    def body(rank: int, gather: Callable[[Any], list[Any]]) -> Any:
        w = _writer(dirs[rank // PER_NODE], rank, gather, step)
        w.begin()
        if w.is_coordinator:
            w.write_tensors("model.safetensors", {"w": torch.arange(6.0)})
            w.write_json("trainer_state.json", {"global_step": step})
        w.write_tensors(
            f"rng_state_{rank}.safetensors", {"s": torch.full((2,), rank)}, per_rank=True
        )
        if fail is not None:
            fail(rank)
        return w.commit()

    return body


def test_every_node_holds_a_complete_copy_with_every_ranks_records(tmp_path: Path) -> None:
    dirs = [tmp_path / "node0" / "out", tmp_path / "node1" / "out"]
    results = _run(_save(dirs, 7))
    for r in results:
        assert not isinstance(r, BaseException), r
        assert r.complete and r.step == 7
    for node, d in enumerate(dirs):
        info = CheckpointStore(str(d)).inspect("checkpoint-7")
        assert info.complete, info.reason
        m = info.manifest
        assert m is not None and m["world_size"] == WORLD
        assert m["node_copy"] == {"node": str(node), "nodes": ["0", "1"], "writer_rank": 2 * node}
        listed = {f["path"] for f in m["files"]}
        assert listed == {
            "model.safetensors",
            "trainer_state.json",
            *(f"rng_state_{r}.safetensors" for r in range(WORLD)),
        }
        reader = CheckpointReader(info.path)
        for rank in range(WORLD):  # any rank can resume from any node's copy
            rng = reader.load_tensors(f"rng_state_{rank}.safetensors")["s"]
            assert torch.equal(rng, torch.full((2,), rank))
        assert not [f for f in (d / "checkpoint-7").iterdir() if f.name.startswith(".partial")]


def test_a_failure_on_one_node_commits_no_copy(tmp_path: Path) -> None:
    dirs = [tmp_path / "node0" / "out", tmp_path / "node1" / "out"]
    lost = dirs[1] / "checkpoint-9"

    def fail(rank: int) -> None:
        if rank == 2:  # node 1's disk loses the copy before its writer wrote every rank's file
            shutil.rmtree(lost)
            lost.write_text("not a directory any more")

    results = _run(_save(dirs, 9, fail))
    assert all(isinstance(r, BaseException) for r in results), results
    assert "node 1 (rank 2)" in str(results[0]), results[0]
    # node 0 was ready, but no node writes its manifest unless every node is
    info = CheckpointStore(str(dirs[0])).inspect("checkpoint-9")
    assert not info.complete and (dirs[0] / "checkpoint-9" / SENTINEL_NAME).exists(), info
    assert not CheckpointStore(str(dirs[1])).inspect("checkpoint-9").complete


def test_nodes_sharing_storage_are_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    results = _run(_save([shared, shared], 3))
    assert all(isinstance(r, CheckpointError) for r in results), results
    text = " ".join(str(r) for r in results)
    assert "save_on_each_node=True" in text and "share" in text, text
    assert not CheckpointStore(str(shared)).inspect("checkpoint-3").complete


def test_a_rank_file_not_marked_per_rank_on_a_non_writer_is_still_gathered(tmp_path: Path) -> None:
    dirs = [tmp_path / "node0", tmp_path / "node1"]

    def body(rank: int, gather: Callable[[Any], list[Any]]) -> Any:
        w = _writer(dirs[rank // PER_NODE], rank, gather, 5)
        w.begin()
        if w.is_coordinator:
            w.write_json("trainer_state.json", {"global_step": 5})
        else:
            w.write_json(f"extra_{rank}.json", {"rank": rank})
        return w.commit()

    results = _run(body)
    assert not any(isinstance(r, BaseException) for r in results), results
    for d in dirs:
        names = {f["path"] for f in CheckpointStore(str(d)).inspect("5").manifest["files"]}
        assert names == {"trainer_state.json", "extra_1.json", "extra_3.json"}


def test_each_node_needs_gather(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="gather is required"):
        CheckpointWriter(
            str(tmp_path), 1, rank=0, world_size=2, barrier=lambda: None, each_node=True
        )
