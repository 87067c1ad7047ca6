"""Pods of several processes (spec.numProcPerNode): how many, which command, which /dev/shm."""

from __future__ import annotations

from typing import Any

import pytest

from preemptible_operator import shape
from tests.unit.operator.builders import make_spec

GPU = "nvidia.com/gpu"


@pytest.mark.parametrize(
    ("overrides", "procs"),
    [
        ({}, 1),
        ({"numProcPerNode": 1}, 1),
        ({"numProcPerNode": 8}, 8),
        ({"numProcPerNode": "auto", "resourcesPerNode": {"limits": {GPU: 8}}}, 8),
        ({"numProcPerNode": "auto", "resourcesPerNode": {"limits": {GPU: "4"}}}, 4),
        # limits first (extended resources are requested through limits), then requests
        ({"numProcPerNode": "auto", "resourcesPerNode": {"limits": {GPU: 2},
                                                         "requests": {GPU: 2, "cpu": 8}}}, 2),
        ({"numProcPerNode": "auto", "resourcesPerNode": {"requests": {GPU: 4}}}, 4),
        ({"numProcPerNode": "auto", "resourcesPerNode": {"limits": {GPU: 0}}}, 1),
    ],
)  # fmt: skip
def test_procs_per_node(overrides: dict[str, Any], procs: int) -> None:
    assert shape.procs_per_node(make_spec(**overrides)) == procs


@pytest.mark.parametrize(
    ("argv", "launcher"),
    [
        (["python", "train.py"], None),
        (["python", "-m", "trainer_runtime.toy"], None),
        (["torchrun", "--nproc-per-node", "8", "train.py"], "torchrun"),
        (["/usr/local/bin/torchrun", "train.py"], "torchrun"),
        (["python", "-m", "torch.distributed.run", "train.py"], "torchrun"),
        (["python3", "-u", "-m", "torch.distributed.launch", "t.py"], "torchrun"),
        (["python", "-mtorch.distributed.run", "t.py"], "torchrun"),
        (["accelerate", "launch", "--multi_gpu", "t.py"], "accelerate launch"),
        (["accelerate", "config"], None),
        (["python", "-m", "accelerate.commands.launch", "t.py"], "accelerate launch"),
        (["trainer-runtime", "launch", "--transformers", "--", "t.py"], "trainer-runtime launch"),
        (["python", "-m", "trainer_runtime.cli", "launch", "--", "t.py"],
         "trainer-runtime launch"),
        (["trainer-runtime", "inspect", "/c"], None),
        (["env", "-u", "X", "NCCL_DEBUG=INFO", "torchrun", "t.py"], "torchrun"),
        (["sh", "-c", "exec torchrun --nproc-per-node 8 t.py"], "torchrun"),
        (["bash", "-c", "accelerate launch t.py"], "accelerate launch"),
        (["bash", "-c", "cd /w && torchrun t.py"], None),  # not seen: documented
        (["bash", "-c", "'unbalanced"], None),
        (["python", "train.py", "torchrun"], None),
        ([], None),
    ],
)  # fmt: skip
def test_launcher_in(argv: list[str], launcher: str | None) -> None:
    assert shape.launcher_in(argv) == launcher


@pytest.mark.parametrize(
    ("overrides", "command"),
    [
        ({}, ["python", "-m", "trainer_runtime.toy"]),
        ({"numProcPerNode": 1}, ["python", "-m", "trainer_runtime.toy"]),
        ({"numProcPerNode": 2}, ["trainer-runtime", "launch", "--", "python", "-m",
                                 "trainer_runtime.toy"]),
        # The launcher named in the command (or in its args): kept as it is, never nested.
        ({"numProcPerNode": 2, "command": ["torchrun", "t.py"]}, ["torchrun", "t.py"]),
        ({"numProcPerNode": 2, "command": ["python"], "args": ["-m", "torch.distributed.run",
                                                               "t.py"]}, ["python"]),
        ({"numProcPerNode": 8, "command": ["trainer-runtime", "launch", "--transformers", "--",
                                           "t.py"]},
         ["trainer-runtime", "launch", "--transformers", "--", "t.py"]),
        ({"numProcPerNode": "auto", "resourcesPerNode": {"limits": {GPU: 1}}},
         ["python", "-m", "trainer_runtime.toy"]),
        ({"command": None}, None),
    ],
)  # fmt: skip
def test_pod_command(overrides: dict[str, Any], command: list[str] | None) -> None:
    assert shape.pod_command(make_spec(**overrides)) == command


@pytest.mark.parametrize(
    ("overrides", "limit"),
    [
        ({}, None),
        ({"numProcPerNode": 1}, None),
        ({"numProcPerNode": 2}, "4Gi"),
        ({"numProcPerNode": "auto", "resourcesPerNode": {"limits": {GPU: 8}}}, "16Gi"),
        ({"numProcPerNode": 8, "shmSize": "64Gi"}, "64Gi"),
        ({"numProcPerNode": 8, "shmSize": "0"}, None),
        ({"shmSize": "1Gi"}, "1Gi"),  # asked for with one process per pod
    ],
)
def test_shm_size_limit(overrides: dict[str, Any], limit: str | None) -> None:
    assert shape.shm_size_limit(make_spec(**overrides)) == limit
