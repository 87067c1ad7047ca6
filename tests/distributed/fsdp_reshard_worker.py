"""One rank of the FSDP re-sharding test (``python -m tests.distributed.fsdp_reshard_worker``).

``save OUT REF``: train a sharded toy model a few steps, save a sharded checkpoint (every rank its
own pieces), and write the gathered model and optimizer state to REF (rank 0).
``load OUT REF``: a fresh sharded model over another number of ranks loads the checkpoint; its
gathered model and optimizer state must equal REF exactly. Prints ``RESULT {json}`` per rank.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from trainer_runtime.checkpoint.layout import CheckpointStore
from trainer_runtime.distributed.collectives import run_and_exit
from trainer_runtime.distributed.fsdp import FsdpConfig, load_sharded, save_sharded, shard_model
from trainer_runtime.toy import ToyDataset, ToyModel

STEPS, BATCH = 3, 8


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = shard_model(ToyModel(dropout=0.0), FsdpConfig())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def gathered(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the model and optimizer state, gathered (a collective)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    model_sd, optim_sd = get_state_dict(model, opt, options=options)
    flat = {f"model.{k}": v for k, v in model_sd.items()}
    for fqn, state in optim_sd["state"].items():
        for name, value in state.items():
            flat[f"optim.{fqn}.{name}"] = value
    return {k: v.detach().clone() for k, v in flat.items()}


def main() -> int:
    phase, out, ref = sys.argv[1:4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build()
    result: dict[str, object] = {"rank": rank, "world": world}
    if phase == "save":
        data = ToyDataset(256, seed=3)
        for step in range(STEPS):
            start = (step * world + rank) * BATCH
            batch = data[list(range(start, start + BATCH))]
            model(batch["x"], batch["labels"])["loss"].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        info = save_sharded(out, STEPS, model, opt)
        state = gathered(model, opt)
        if rank == 0:
            torch.save(state, ref)
        result["complete"] = info.complete
        result["files"] = sorted(f["path"] for f in (info.manifest or {}).get("files", []))
    else:
        info = CheckpointStore(out).inspect(f"checkpoint-{STEPS}")
        load_sharded(info.path, model, opt)
        state = gathered(model, opt)
        expected = torch.load(ref, weights_only=True)
        result["keys_match"] = sorted(state) == sorted(expected)
        result["differ"] = sorted(
            k for k in expected if k not in state or not torch.equal(state[k], expected[k])
        )
        result["local_rows"] = {
            name: list(p.to_local().shape) for name, p in model.named_parameters()
        }
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    # The process group destroyed and no interpreter teardown: on gloo, torch's teardown
    # occasionally aborts ("terminate called without an active exception", exit -6) after
    # everything was reported (seen in CI on 4 December).
    run_and_exit(main)
