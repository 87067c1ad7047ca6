"""Replicated (DDP) state split across ranks by bytes: the plan, each rank's files, the index, and
the union read back (by our reader and by transformers' ``from_pretrained``)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.unit.checkpoint.test_checkpoint_io import _run_ranks
from trainer_runtime.checkpoint.io import (
    OPTIMIZER_META_KEY,
    CheckpointReader,
    CheckpointWriter,
    optimizer_state_to_tensors,
)
from trainer_runtime.checkpoint.model_state import MODEL_STEM, OPTIMIZER_STEM
from trainer_runtime.checkpoint.safetensors_stream import TensorFile
from trainer_runtime.checkpoint.shares import (
    ShardFile,
    ShareGroup,
    ShareIndex,
    load_indexed,
    plan_shares,
    shard_file_name,
    share_entries,
)
from trainer_runtime.errors import CheckpointError, ConfigurationError, ResumeError


@pytest.mark.parametrize(
    ("sizes", "world", "shares", "loads"),
    [
        # one rank: everything, in the order given
        ([("a", 5), ("b", 7)], 1, [["a", "b"]], [12]),
        # largest first to the emptiest rank; ties go to the lowest rank
        ([("a", 4), ("b", 4), ("c", 4), ("d", 4)], 2, [["a", "c"], ["b", "d"]], [8, 8]),
        ([("a", 10), ("b", 6), ("c", 4)], 2, [["a"], ["b", "c"]], [10, 10]),
        # more ranks than items: the last ranks write nothing
        ([("a", 3), ("b", 1)], 4, [["a"], ["b"], [], []], [3, 1, 0, 0]),
        # an item larger than an even share stays whole
        ([("big", 100), ("x", 1), ("y", 1)], 2, [["big"], ["x", "y"]], [100, 2]),
        # equal sizes keep the given order as the tie-break (not the name)
        ([("z", 2), ("a", 2)], 2, [["z"], ["a"]], [2, 2]),
    ],
)
def test_plan_table(
    sizes: list[tuple[str, int]], world: int, shares: list[list[str]], loads: list[int]
) -> None:
    assert plan_shares(sizes, world) == (shares, loads)


@pytest.mark.parametrize("seed", range(20))
def test_no_rank_gets_more_than_its_share_plus_the_largest_tensor(seed: int) -> None:
    rng = random.Random(seed)
    sizes = [(f"t{i}", rng.randint(0, 1 << rng.randint(4, 24))) for i in range(rng.randint(1, 300))]
    world = rng.randint(1, 16)
    shares, loads = plan_shares(sizes, world)
    total, largest = sum(s for _, s in sizes), max(s for _, s in sizes)
    assert sum(loads) == total
    assert max(loads) <= total / world + largest
    assert sorted(k for share in shares for k in share) == sorted(k for k, _ in sizes)
    # deterministic: every rank computes the same plan
    assert plan_shares(list(sizes), world) == (shares, loads)


@pytest.mark.parametrize(
    ("sizes", "world", "message"),
    [
        ([("a", 1), ("a", 2)], 2, "unique"),
        ([("a", 1)], 0, "world_size=0"),
        ([("a", 1)], True, "world_size=True"),
    ],
)
def test_plan_refuses(sizes: list[tuple[str, int]], world: Any, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        plan_shares(sizes, world)


def _groups() -> list[ShareGroup]:
    model = {f"layer{i}.weight": torch.full((i + 1, 4), float(i)) for i in range(5)}
    model["embed"] = torch.arange(64, dtype=torch.bfloat16).reshape(16, 4)
    opt = {f"optimizer.state.{i}.exp_avg": torch.full((8,), float(-i)) for i in range(3)}
    return [
        ShareGroup(MODEL_STEM, model, {"format": "pt"}),
        ShareGroup(OPTIMIZER_STEM, opt, index_extra={OPTIMIZER_META_KEY: "{}"}),
    ]


def _written(files: list[dict[str, Any]]) -> dict[str, list[str]]:
    """What the ranks' records give the coordinator: each shard's tensor names."""
    return {n: list(d.tensors) for f in files for n, d in f.items() if isinstance(d, ShardFile)}


def _built(files: list[dict[str, Any]], name: str) -> dict[str, Any]:
    index = files[0][name]
    assert isinstance(index, ShareIndex)
    return json.loads(index.build(_written(files), "here"))


def test_each_rank_writes_its_share_and_the_coordinator_the_indexes() -> None:
    groups, world = _groups(), 3
    per_rank = [share_entries(groups, r, world, coordinator=r == 0) for r in range(world)]
    files = [dict(entries) for entries in per_rank]
    indexes = {n for n in files[0] if n.endswith(".index.json")}
    assert indexes == {"model.safetensors.index.json", "optimizer.safetensors.index.json"}
    assert not any(n.endswith(".index.json") for f in files[1:] for n in f)
    # every tensor is written exactly once, and the index points at the file that holds it
    for group in groups:
        index = _built(files, f"{group.stem}.safetensors.index.json")
        assert index["metadata"]["total_size"] == sum(
            t.numel() * t.element_size() for t in group.tensors.values()
        )
        seen: dict[str, str] = {}
        for f in files:
            for name, data in f.items():
                if isinstance(data, TensorFile) and name.startswith(group.stem + "-"):
                    for key in data.tensors:
                        assert key not in seen
                        seen[key] = name
                    assert dict(data.metadata or {}) == dict(group.metadata or {})
        assert seen == index["weight_map"]
    # shards are numbered among the ranks that hold any, in rank order
    names = sorted(n for f in files for n in f if n.startswith("model-"))
    count = len(names)
    assert names == [shard_file_name("model", i + 1, count) for i in range(count)]
    assert _built(files, "optimizer.safetensors.index.json")[OPTIMIZER_META_KEY] == "{}"


@pytest.mark.parametrize(
    ("written", "needle"),
    [
        ({"model-00001-of-00002.safetensors": ["a"]}, "planned but in no shard: ['b']"),
        (
            {
                "model-00001-of-00002.safetensors": ["a", "b"],
                "model-00002-of-00002.safetensors": ["b"],
            },
            "in two shards: 'b' (model-00001-of-00002.safetensors, model-00002-of-00002",
        ),
        (
            {"model-00001-of-00002.safetensors": ["a", "b", "c"]},
            "in a shard but not planned: ['c']",
        ),
    ],
)
def test_an_index_is_built_only_from_shards_that_match_the_plan(
    written: dict[str, list[str]], needle: str
) -> None:
    index = ShareIndex("model", 8, ("a", "b"))
    with pytest.raises(CheckpointError) as err:
        index.build(written, "ckpt/model.safetensors.index.json")
    assert needle in str(err.value) and "not committed" in str(err.value), str(err.value)
    # another group's shards are not this index's business
    other = {
        "optimizer-00001-of-00001.safetensors": ["x"],
        **{"model-00001-of-00001.safetensors": ["a", "b"]},
    }
    built = json.loads(index.build(other, "here"))
    assert built["weight_map"] == {
        "a": "model-00001-of-00001.safetensors",
        "b": "model-00001-of-00001.safetensors",
    }
    assert built["metadata"]["total_size"] == 8


def test_bytes_per_rank_are_close_to_an_even_split() -> None:
    # 24 layers of 1 MiB and their two Adam moments: 72 MiB over 4 ranks.
    model = {f"l{i}": torch.zeros(1 << 18) for i in range(24)}
    opt = {f"s.{i}.{m}": torch.zeros(1 << 18) for i in range(24) for m in ("exp_avg", "sq")}
    groups = [ShareGroup(MODEL_STEM, model), ShareGroup(OPTIMIZER_STEM, opt)]
    total = 72 << 20
    for world in (1, 2, 4):
        written = [
            sum(d.nbytes for _, d in share_entries(groups, r, world, coordinator=False))
            for r in range(world)
        ]
        assert sum(written) == total
        assert max(written) <= 1.1 * total / world, written


def _write_shared(out: str, world: int, groups: list[ShareGroup]) -> list[Any]:
    def body(rank: int, barrier: Callable[[], None]) -> Any:
        w = CheckpointWriter(out, 7, rank=rank, world_size=world, attempt=1, barrier=barrier)
        w.begin()
        w.write_entries(
            (n, d, False) for n, d in share_entries(groups, rank, world, coordinator=rank == 0)
        )
        if rank == 0:
            w.write_json("trainer_state.json", {"global_step": 7})
        return w.commit()

    return _run_ranks(world, body)


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer, list[ShareGroup]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 6)).sum().backward()
    optimizer.step()
    tensors, meta = optimizer_state_to_tensors(optimizer.state_dict())
    groups = [
        ShareGroup(MODEL_STEM, dict(model.state_dict())),
        ShareGroup(OPTIMIZER_STEM, tensors, index_extra={OPTIMIZER_META_KEY: meta}),
    ]
    return model, optimizer, groups


def test_union_read_back_from_shards_written_by_three_ranks(tmp_path: Path) -> None:
    model, optimizer, groups = _trained()
    for result in _write_shared(str(tmp_path), 3, groups):
        assert not isinstance(result, BaseException), result
    reader = CheckpointReader(str(tmp_path / "checkpoint-7"))
    state = reader.load_optimizer()
    index = reader.load_json("model.safetensors.index.json")
    weights, _ = load_indexed(index, reader.load_tensors_and_metadata, "here")
    reader.wait_verified()
    assert state is not None
    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    fresh.load_state_dict(state)
    before, after = optimizer.state_dict(), fresh.state_dict()
    assert before["param_groups"] == after["param_groups"]
    for pid, entry in before["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, after["state"][pid][key]), (pid, key)
    for name, t in model.state_dict().items():
        assert torch.equal(weights[name], t), name


def test_a_corrupt_shard_is_caught_on_resume(tmp_path: Path) -> None:
    _, _, groups = _trained()
    for result in _write_shared(str(tmp_path), 2, groups):
        assert not isinstance(result, BaseException), result
    ckpt = tmp_path / "checkpoint-7"
    shard = sorted(ckpt.glob("optimizer-*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    reader = CheckpointReader(str(ckpt))
    assert reader.load_optimizer() is not None
    with pytest.raises(ResumeError, match=f"{shard.name} .* is corrupt"):
        reader.wait_verified()


def test_an_index_naming_a_missing_tensor_is_refused() -> None:
    def load(name: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        return {"a": torch.ones(1)}, {}

    with pytest.raises(
        ResumeError, match=r"1 tensor\(s\) of the index are not in their shards \(\[.b.\]\)"
    ):
        load_indexed({"weight_map": {"a": "f1", "b": "f1"}}, load, "ckpt/index")
    with pytest.raises(ResumeError, match="no weight_map"):
        load_indexed({}, load, "ckpt/index")
    # an optimizer without state tensors (SGD without momentum) has an empty map
    assert load_indexed({"weight_map": {}}, load, "ckpt/index") == ({}, {})


def test_a_group_without_tensors_writes_an_empty_index() -> None:
    groups = [ShareGroup(OPTIMIZER_STEM, {}, index_extra={OPTIMIZER_META_KEY: "{}"})]
    (entry,) = share_entries(groups, 0, 2, coordinator=True)
    assert entry[0] == "optimizer.safetensors.index.json"
    assert isinstance(entry[1], ShareIndex)
    assert json.loads(entry[1].build({}, "here"))["weight_map"] == {}
    assert share_entries(groups, 1, 2, coordinator=False) == []


def test_from_pretrained_opens_a_model_shared_by_two_ranks(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from trainer_runtime.checkpoint.hf_format import model_weights, side_files

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    weights = model_weights(model)
    assert weights is not None
    groups = [ShareGroup(MODEL_STEM, weights.tensors, weights.metadata)]

    def body(rank: int, barrier: Callable[[], None]) -> Any:
        w = CheckpointWriter(str(tmp_path), 3, rank=rank, world_size=2, attempt=1, barrier=barrier)
        w.begin()
        entries = [(n, d, False) for n, d in share_entries(groups, rank, 2, coordinator=rank == 0)]
        if rank == 0:
            entries += [(n, d, False) for n, d in side_files(model)]
        w.write_entries(entries)
        return w.commit()

    for result in _run_ranks(2, body):
        assert not isinstance(result, BaseException), result
    ckpt = tmp_path / "checkpoint-3"
    assert sorted(p.name for p in ckpt.glob("model-*")) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    # both ranks wrote model bytes
    assert all(load_file(str(p)) for p in ckpt.glob("model-*"))
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(ckpt))
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name


def test_the_index_comes_from_the_shards_the_ranks_wrote(tmp_path: Path) -> None:
    """A rank whose shard lacks a tensor of the coordinator's plan (plans that differ, had they
    not been checked): the commit fails naming it, instead of an index pointing at a shard
    without the tensor."""
    full = [ShareGroup(MODEL_STEM, {f"t{i}": torch.full((4,), float(i)) for i in range(4)})]
    tensors = {f"t{i}": torch.full((4,), float(i)) for i in range(4) if i != 2}
    lacking = [ShareGroup(MODEL_STEM, tensors)]

    def body(rank: int, barrier: Callable[[], None]) -> Any:
        w = CheckpointWriter(str(tmp_path), 7, rank=rank, world_size=2, attempt=1, barrier=barrier)
        w.begin()
        groups = full if rank == 0 else lacking
        w.write_entries(
            (n, d, False) for n, d in share_entries(groups, rank, 2, coordinator=rank == 0)
        )
        return w.commit()

    results = _run_ranks(2, body)
    assert all(isinstance(r, CheckpointError) for r in results), results
    # rank 1 planned t0, t1, t3 alone and wrote t1 (rank 0 wrote t0 and t2): t3 is in no shard
    assert "planned but in no shard: ['t3']" in str(results[0]), results[0]
    ckpt = tmp_path / "checkpoint-7"
    assert not (ckpt / "manifest.json").exists()
    assert not (ckpt / "model.safetensors.index.json").exists()
