"""One rank of the FSDP checkpoint test (run as ``python -m tests.distributed.fsdp_worker``).

Trains a sharded toy model for STOP steps, saves a sharded checkpoint, trains on to END; then a
fresh sharded model loads the checkpoint, trains from STOP to END, and must end bit-identical.
Finally the checkpoint is made incomplete again (sentinel back) and loading it must be refused.
Prints one line ``RESULT {json}`` per rank.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from trainer_runtime.checkpoint.layout import SENTINEL_NAME, CheckpointStore
from trainer_runtime.distributed.collectives import run_and_exit
from trainer_runtime.distributed.fsdp import FsdpConfig, load_sharded, save_sharded, shard_model
from trainer_runtime.errors import ResumeError
from trainer_runtime.toy import ToyDataset, ToyModel

STOP, END, BATCH = 3, 6, 8


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = shard_model(ToyModel(dropout=0.0), FsdpConfig())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(
    model: torch.nn.Module, opt: torch.optim.Optimizer, data: ToyDataset, steps: range
) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        start = (step * world + rank) * BATCH
        batch = data[list(range(start, start + BATCH))]
        model(batch["x"], batch["labels"])["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def main() -> int:
    out = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data = ToyDataset(256, seed=3)
    model, opt = build()
    train(model, opt, data, range(STOP))
    info = save_sharded(out, STOP, model, opt, json_files={"trainer_state.json": {"step": STOP}})
    train(model, opt, data, range(STOP, END))
    reference = full(model)

    model2, opt2 = build()
    extra = load_sharded(info.path, model2, opt2)
    train(model2, opt2, data, range(STOP, END))
    resumed = full(model2)
    identical = all(torch.equal(reference[k], resumed[k]) for k in reference)

    dist.barrier()
    if rank == 0:  # an interrupted rewrite of the same step: the sentinel is back
        with open(os.path.join(info.path, SENTINEL_NAME), "w") as fh:
            fh.write("{}")
    dist.barrier()
    try:
        load_sharded(info.path, *build())
        refused = ""
    except ResumeError as exc:
        refused = str(exc)
    listed = sorted(f["path"] for f in (info.manifest or {}).get("files", []))
    result = {
        "rank": rank,
        "complete": info.complete,
        "files": listed,
        "extra": extra,
        "identical": identical,
        "refused": refused,
        "store_complete": [c.step for c in CheckpointStore(out).list() if c.complete],
    }
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    # The process group destroyed and no interpreter teardown: on gloo, torch's teardown
    # occasionally aborts ("terminate called without an active exception", exit -6) after
    # everything was reported (seen in CI on 4 December).
    run_and_exit(main)
