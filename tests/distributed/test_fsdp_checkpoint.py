"""FSDP (fully_shard) on CPU/gloo: a sharded checkpoint, every rank writing its own pieces, is
committed by our manifest, resumes bit-identically, and is refused once incomplete."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.conftest import RUN_TIMEOUT, WORLD_SIZE
from tests.distributed.ranks import free_port
from trainer_runtime.distributed.fsdp import FsdpConfig, check_fsdp_config
from trainer_runtime.errors import ConfigurationError


def _run_ranks(world: int, module: str, *argv: str) -> list[dict[str, Any]]:
    """``world`` gloo ranks of ``python -m module argv``; each one's RESULT line."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world),
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "OMP_NUM_THREADS": "1",
        }
        env.pop("PREEMPTIBLE_ATTEMPT", None)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", module, *argv],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=RUN_TIMEOUT)[0].decode(errors="replace"))
    finally:
        for p in procs:
            p.kill()
    for p, text in zip(procs, outputs, strict=True):
        assert p.returncode == 0, text[-3000:]
    results = [
        json.loads(line.removeprefix("RESULT "))
        for text in outputs
        for line in text.splitlines()
        if line.startswith("RESULT ")
    ]
    assert len(results) == world, outputs
    return sorted(results, key=lambda r: r["rank"])


@pytest.mark.runtime
@pytest.mark.timeout(400)
def test_sharded_checkpoint_roundtrip_on_gloo(tmp_path: Path) -> None:
    results = _run_ranks(WORLD_SIZE, "tests.distributed.fsdp_worker", str(tmp_path / "out"))
    for r in results:
        assert r["complete"], r
        # every rank's file of pieces and the JSON, all listed in one manifest
        assert r["files"] == [
            "fsdp-state-00001-of-00002.safetensors",
            "fsdp-state-00002-of-00002.safetensors",
            "trainer_state.json",
        ]
        assert r["extra"] == {"trainer_state.json": {"step": 3}}, r
        assert r["identical"], f"rank {r['rank']}: resumed sharded run differs"
        assert "checkpoint-is-incomplete.txt" in r["refused"] or "incomplete" in r["refused"], r
    manifest = json.loads((tmp_path / "out" / "checkpoint-3" / "manifest.json").read_text())
    assert manifest["world_size"] == WORLD_SIZE
    assert manifest["sharding"]["format"] == "fsdp-shards/1"


@pytest.mark.runtime
@pytest.mark.timeout(400)
def test_sharded_checkpoint_loads_at_another_world_size(tmp_path: Path) -> None:
    """Saved by 2 ranks, loaded by 3: every rank's new piece (uneven, one empty) is rebuilt from
    the slices of the saved pieces it overlaps, and the gathered model and optimizer state are
    exactly what was saved."""
    out, ref = str(tmp_path / "out"), str(tmp_path / "reference.pt")
    saved = _run_ranks(2, "tests.distributed.fsdp_reshard_worker", "save", out, ref)
    assert all(r["complete"] for r in saved), saved
    assert saved[0]["files"] == [
        "fsdp-state-00001-of-00002.safetensors",
        "fsdp-state-00002-of-00002.safetensors",
    ]
    loaded = _run_ranks(3, "tests.distributed.fsdp_reshard_worker", "load", out, ref)
    for r in loaded:
        assert r["keys_match"] and r["differ"] == [], r
    # the toy's last layer has 4 output rows: over 3 ranks, pieces of 2, 2 and 0 rows
    rows = [r["local_rows"]["net.3.weight"][0] for r in loaded]
    assert rows == [2, 2, 0], rows


@pytest.mark.parametrize(
    ("config", "kw", "needle"),
    [
        (FsdpConfig(), {"world_size": 1}, "at least 2 ranks"),
        (FsdpConfig(cpu_offload=True), {}, "cpu_offload=True needs CUDA"),
        (FsdpConfig(mixed_precision="bf16"), {}, "mixed_precision='bf16' needs CUDA"),
        (FsdpConfig(), {"backend": "nccl"}, "backend 'gloo' on CPU"),
    ],
)
def test_gpu_only_configurations_are_refused_on_cpu(
    config: FsdpConfig, kw: dict, needle: str
) -> None:
    args = {"world_size": 2, "cuda": False, "backend": "gloo", **kw}
    with pytest.raises(ConfigurationError, match=needle.replace("(", r"\(")):
        check_fsdp_config(config, **args)


@pytest.mark.parametrize(
    "config", [FsdpConfig(), FsdpConfig(cpu_offload=True, mixed_precision="bf16")]
)
def test_gpu_configurations_pass_with_cuda(config: FsdpConfig) -> None:
    check_fsdp_config(config, world_size=8, cuda=True, backend="nccl")
