"""FSDP (fully_shard) on CPU/gloo: a sharded checkpoint through torch.distributed.checkpoint is
committed by our manifest, resumes bit-identically, and is refused once incomplete."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.conftest import RUN_TIMEOUT, WORLD_SIZE
from tests.distributed.ranks import free_port
from trainer_runtime.distributed.fsdp import FsdpConfig, check_fsdp_config
from trainer_runtime.errors import ConfigurationError


@pytest.mark.runtime
@pytest.mark.timeout(400)
def test_sharded_checkpoint_roundtrip_on_gloo(tmp_path: Path) -> None:
    port = free_port()
    procs = []
    for rank in range(WORLD_SIZE):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(WORLD_SIZE),
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "OMP_NUM_THREADS": "1",
        }
        env.pop("PREEMPTIBLE_ATTEMPT", None)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.distributed.fsdp_worker", str(tmp_path / "out")],
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
    assert len(results) == WORLD_SIZE, outputs
    for r in results:
        assert r["complete"], r
        # every rank's shard, DCP's metadata and the JSON, all listed in one manifest
        assert r["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "trainer_state.json"]
        assert r["extra"] == {"trainer_state.json": {"step": 3}}, r
        assert r["identical"], f"rank {r['rank']}: resumed sharded run differs"
        assert "checkpoint-is-incomplete.txt" in r["refused"] or "incomplete" in r["refused"], r
    manifest = json.loads((tmp_path / "out" / "checkpoint-3" / "manifest.json").read_text())
    assert manifest["world_size"] == WORLD_SIZE
    assert manifest["sharding"]["format"] == "fsdp-dcp/1"


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
