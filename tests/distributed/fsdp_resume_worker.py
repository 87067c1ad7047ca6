"""One rank of the FSDP resume tests (``python -m tests.distributed.fsdp_resume_worker CASE OUT``).

Cases (each: train, save a sharded checkpoint, train on to the end for the reference; then a
fresh model loads the checkpoint, trains on and must end bit-identical):

``bytes``    what this rank read from storage during the load (the storage seam's counter).
``unused``   a module never used in forward: its parameters have no optimizer state.
``step0``    a save before the first optimizer step: nothing fabricated, the live optimizer
             untouched.
``gap``      the checkpoint is rewritten (checksums and sizes made to match) so that one piece
             of a weight sits one row off: its rows are missing; the load fails naming the
             tensor and the rows, and the fallback's verdict is CORRUPT.

Prints one line ``RESULT {json}`` per rank.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer_runtime.checkpoint import fallback, read_stats
from trainer_runtime.checkpoint.digest import file_record, hash_stream
from trainer_runtime.checkpoint.safetensors_stream import (
    read_header,
    read_header_range,
    write_safetensors,
)
from trainer_runtime.checkpoint.storage import Storage
from trainer_runtime.distributed.collectives import run_and_exit
from trainer_runtime.distributed.fsdp import FsdpConfig, load_sharded, save_sharded, shard_model
from trainer_runtime.toy import CLASSES, FEATURES, ToyDataset, ToyModel

END, BATCH = 6, 8


class WithUnused(nn.Module):
    """The toy and a head it never uses (no gradient, no optimizer state, ever)."""

    def __init__(self) -> None:
        super().__init__()
        self.toy = ToyModel(dropout=0.0)
        self.unused = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.toy(x, labels)


class Wide(nn.Module):
    """An MLP of ~1.1M parameters (13 MB of state with AdamW): tensor bytes outweigh headers."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(FEATURES, 1024)
        self.mid = nn.Linear(1024, 1024)
        self.out = nn.Linear(1024, CLASSES)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.out(torch.relu(self.mid(torch.relu(self.up(x)))))
        return {"loss": nn.functional.cross_entropy(logits, labels)}


def build(case: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    if case == "bytes":
        module: nn.Module = Wide()
    else:
        module = WithUnused() if case == "unused" else ToyModel(dropout=0.0)
    model = shard_model(module, FsdpConfig())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: nn.Module, opt: torch.optim.Optimizer, data: ToyDataset, steps: range) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        start = (step * world + rank) * BATCH
        batch = data[list(range(start, start + BATCH))]
        model(batch["x"], batch["labels"])["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's local model and optimizer state, copied."""
    out = {f"model.{k}": v.to_local().clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                local = v.to_local() if hasattr(v, "to_local") else v
                out[f"optim.{names[id(p)]}.{k}"] = local.clone()
    return out


def shift_a_piece(path: str, name: str = "fsdp-state-00002-of-00002.safetensors") -> str:
    """Rewrite file ``name`` of checkpoint ``path`` so its piece of the first weight claims to
    start one row later (rows missing), and the manifest's size and checksum to match (only the
    layout is wrong: no checksum can tell)."""
    file = os.path.join(path, name)
    from safetensors.torch import load_file

    tensors = load_file(file)
    with open(file, "rb") as fh:
        metadata = read_header(fh)[0]["__metadata__"]
    layout = json.loads(metadata["preemptible.fsdp"])
    key = "model.net.0.weight"
    layout["pieces"][key]["offsets"][0] += 1
    metadata["preemptible.fsdp"] = json.dumps(layout, separators=(",", ":"), sort_keys=True)
    with open(file + ".tmp", "wb") as fh:  # the loaded tensors may map the old file
        write_safetensors(fh.write, tensors, metadata)
    os.replace(file + ".tmp", file)
    with open(file, "rb") as fh:
        size, digest = hash_stream(fh)
    manifest_path = os.path.join(path, "manifest.json")
    with open(manifest_path) as fh:
        manifest = json.load(fh)
    manifest["files"] = [
        file_record(name, size, digest) if e["path"] == name else e for e in manifest["files"]
    ]
    with open(manifest_path, "w") as fh:
        json.dump(manifest, fh)
    return key


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return -1


def _reset_peak_rss() -> int:
    """Reset the peak resident set (VmHWM) to the current one; the current one, -1 if unable."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return -1
    return _status_bytes("VmRSS")


def main() -> int:
    case, out = sys.argv[1:3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    stop = 0 if case == "step0" else 3
    data = ToyDataset(256, seed=3)
    model, opt = build(case)
    train(model, opt, data, range(stop))
    before = snapshot(model, opt)
    info = save_sharded(out, stop, model, opt)
    after = snapshot(model, opt)
    result: dict[str, Any] = {
        "rank": rank,
        "complete": info.complete,
        # the save changed nothing live (no fake step: Adam's state stays empty at step 0)
        "save_untouched": sorted(before) == sorted(after)
        and all(torch.equal(before[k], after[k]) for k in before),
        "optimizer_entries": len(opt.state),
    }
    train(model, opt, data, range(stop, END))
    reference = snapshot(model, opt)
    if case == "gap":
        dist.barrier()
        if rank == 0:
            result["shifted"] = shift_a_piece(info.path)
        dist.barrier()
    model2, opt2 = build(case)
    rss_before = _reset_peak_rss()
    read_stats.reset()
    error: BaseException | None = None
    try:
        load_sharded(info.path, model2, opt2)
    except Exception as exc:
        error = exc
    result["bytes_read"] = read_stats.bytes_read()
    # peak resident memory during the load above what was resident before it (Linux)
    result["extra_rss"] = _status_bytes("VmHWM") - rss_before if rss_before >= 0 else None
    kind, message = fallback.outcome_of(error)
    result["error"] = message
    if case == "gap":
        result["verdict"] = fallback.settle(kind, message, info.path)[0]
    else:
        assert error is None, message
        train(model2, opt2, data, range(stop, END))
        resumed = snapshot(model2, opt2)
        result["differ"] = sorted(
            k for k in reference if k not in resumed or not torch.equal(reference[k], resumed[k])
        ) + sorted(set(resumed) - set(reference))
        result["optim_keys"] = sorted(k for k in reference if k.startswith("optim."))
    files = {e["path"]: e["size"] for e in (info.manifest or {}).get("files", [])}
    result["state_bytes"] = sum(v for k, v in files.items() if k.startswith("fsdp-state-"))
    headers = 0
    store = Storage(info.path)  # local or s3:// (AWS_* from the environment)
    for name in files:
        if name.startswith("fsdp-state-"):
            headers += read_header_range(lambda o, d, n=name: store.read_range(n, o, d))[1]
    result["header_bytes"] = headers
    result["world"] = world
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    run_and_exit(main)
