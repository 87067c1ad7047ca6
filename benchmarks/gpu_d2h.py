"""Device-to-host checks of the checkpoint path on one GPU (``benchmarks/gpu_check.sh`` runs it).

    python -P benchmarks/gpu_d2h.py [--device cuda] [--params 1.5B] [--d2h-gib 4]
        [--snapshot-gib 4] [--only jit,d2h,snapshot,stall] [--workdir DIR]

* ``jit``: a JIT save of a bf16 model of ``--params`` parameters trained with AdamW on the
  device: our Trainer in a child process under the operator's environment, stopped by a real
  SIGTERM after its second step (kill wait 0 s); the checkpoint's bytes, the save's seconds
  (its manifest's ``save_seconds``) and GB/s, SIGTERM to exit, the exit code (75). Where the
  Trainer cannot be imported (a package missing on a bare GPU machine) it falls back to the
  same files written by ``CheckpointWriter`` (the code a JIT save runs once training stopped)
  and says so.
* ``d2h``: device-to-host GB/s of ``--d2h-gib`` of bf16 tensors (172 MiB each): a plain
  ``tensor.to("cpu", non_blocking=True)`` (torch's pinned allocator; first and warm round), a
  ``copy_(non_blocking=True)`` into one pinned buffer, and our staging ring feeding a ``write``
  that does nothing and one that hashes (XXH3, as the checkpoint's checksum does), for blocks
  of 8-64 MiB; also what pinning 1 GiB costs through torch and through ``cudaHostRegister``.
* ``snapshot``: a background save's snapshot of ``--snapshot-gib`` of device state (bf16
  weights, fp32 optimizer state), twice with the memory given back (the default) and twice
  kept (``save_async_keep_snapshot=True``): the training stall, then the pinned host memory
  before / during / after the write (ours, and torch's ``host_memory_stats``).
* ``stall``: the training stall of a background save per GiB of ``--snapshot-gib`` of device
  state, through the real code path (``PinnedStaging`` around ``SnapshotBuffers``, a
  ``BackgroundSave`` writing, the Trainer's calls in its order), in each pinned staging mode:
  ``at_save`` (pinned at the save, given back after the write), ``keep`` (kept pinned between
  saves) and ``pin_ahead`` (given back after the write, pinned again on the side thread before
  the next save); three saves each (the first pins in every mode), beside one blocking save of
  the same state (``CheckpointWriter``): the stall as a fraction of it (the limit is 0.1).
  (``--only stall`` is what ``gpu_check.sh``'s stall step runs.)

On a machine without CUDA, ``--device cpu`` runs the same harness at small sizes (a smoke run:
its figures are not GPU figures).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

GIB = 1 << 30
MIB = 1 << 20


def _params(text: str) -> int:
    scale = {"K": 1e3, "M": 1e6, "B": 1e9}.get(text[-1].upper(), 1)
    return int(float(text.rstrip("KMBkmb")) * scale)


def _gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s" if seconds > 0 else "-"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _host_stats() -> dict[str, int]:
    """Pinned host memory: ours (exact sizes) and torch's caching host allocator (rounded
    blocks; every "...bytes...current" figure this torch reports)."""
    from trainer_runtime.checkpoint import staging

    held = staging.held_bytes()
    out = {"ours_pinned": held["pinned"], "ours_mapped": held["mapped"]}
    if torch.cuda.is_available() and hasattr(torch.cuda, "host_memory_stats"):
        for key, value in sorted(torch.cuda.host_memory_stats().items()):
            if "bytes" in key and key.endswith("current"):
                out[f"torch:{key}"] = int(value)
    return out


def _torch_pinned() -> int:
    """What torch's caching host allocator holds (0 where this torch does not say)."""
    stats = _host_stats()
    for key in ("torch:allocated_bytes.current", "torch:allocated_bytes.all.current"):
        if key in stats:
            return stats[key]
    return 0


def _fmt_stats(stats: dict[str, int]) -> str:
    return ", ".join(f"{k} {v / MIB:.0f} MiB" for k, v in stats.items())


# -- the model of the JIT save -------------------------------------------------------------------
def _width_and_layers(params: int) -> tuple[int, int]:
    width = 8192 if params >= 500_000_000 else 2048 if params >= 20_000_000 else 512
    return width, max(1, round(params / (width * width)))


def _model(params: int, device: str) -> torch.nn.Module:
    from torch import nn

    width, layers = _width_and_layers(params)

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(
                *(nn.Linear(width, width, bias=False, dtype=torch.bfloat16) for _ in range(layers))
            )

        def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
            out = self.layers(x.to(torch.bfloat16)).float()
            loss = nn.functional.mse_loss(out, labels) if labels is not None else None
            return {"loss": loss, "logits": out}

    with torch.device(device):
        torch.manual_seed(0)
        return Stack()


class _Data:
    def __init__(self, width: int, n: int = 1 << 16) -> None:
        self.width, self.n = width, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(self.width, generator=g)
        return {"x": x, "labels": x.flip(0)}


def _jit_child(spec: dict[str, Any]) -> None:
    """Train until SIGTERM; the Trainer writes the JIT checkpoint and exits with 75."""
    from trainer_runtime import Trainer, TrainerCallback, TrainingArguments

    device, ready = spec["device"], Path(spec["ready"])
    model = _model(spec["params"], device)
    width, _ = _width_and_layers(spec["params"])

    class Ready(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 2:
                ready.write_text(str(time.time()))

    args = TrainingArguments(
        output_dir=spec["output_dir"],
        per_device_train_batch_size=4,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        max_steps=1_000_000,
        save_strategy="no",
        logging_steps=1_000_000,
        enable_jit_checkpoint=True,
        use_cpu=device == "cpu",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_Data(width), callbacks=[Ready()])
    trainer.train()


def _checkpoint_figures(root: Path) -> tuple[int, float | None, Path | None]:
    ckpts = sorted(root.glob("checkpoint-*"), key=lambda p: int(p.name.rsplit("-", 1)[-1]))
    if not ckpts:
        return 0, None, None
    path = ckpts[-1]
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    manifest = path / "manifest.json"
    seconds = json.loads(manifest.read_text()).get("save_seconds") if manifest.exists() else None
    return size, seconds, path


def run_jit_trainer(params: int, device: str, workdir: Path) -> bool:
    """The real thing: SIGTERM to a training process; False where the Trainer cannot run."""
    try:
        import trainer_runtime.trainer  # noqa: F401
    except ImportError as exc:
        print(f"jit: the Trainer cannot be imported here ({exc}); using CheckpointWriter")
        return False
    out = workdir / "jit"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    ready, term = out / "ready", out / "termination.json"
    spec = {"params": params, "device": device, "output_dir": str(out), "ready": str(ready)}
    env = {
        **os.environ,
        "PREEMPTIBLE_OUTPUT_DIR": str(out),
        "PREEMPTIBLE_ATTEMPT": "1",
        "PREEMPTIBLE_KILL_WAIT_SECONDS": "0",
        "PREEMPTIBLE_TERMINATION_LOG": str(term),
        "PREEMPTIBLE_GRACE_SECONDS": "600",
    }
    env.pop("PREEMPTIBLE_METRICS_PORT", None)
    started = time.monotonic()
    child = subprocess.Popen(
        [sys.executable, "-P", __file__, "--jit-child", json.dumps(spec)], env=env
    )
    while not ready.exists():
        if child.poll() is not None:
            raise SystemExit(f"jit: the training process ended early (exit {child.returncode})")
        if time.monotonic() - started > 300:
            child.kill()
            raise SystemExit("jit: no second step within 300 s")
        time.sleep(0.05)
    sent = time.monotonic()
    child.send_signal(signal.SIGTERM)
    code = child.wait(timeout=600)
    exited = time.monotonic() - sent
    size, seconds, path = _checkpoint_figures(out)
    message = json.loads(term.read_text()) if term.exists() else {}
    print(
        f"jit (Trainer, real SIGTERM, {device}, {params / 1e9:.2f}B bf16 params + AdamW): "
        f"exit {code}, checkpoint {path.name if path else None} complete="
        f"{message.get('complete')}, {size / 1e9:.2f} GB in {seconds} s "
        f"({_gbps(size, seconds or 0.0)}); SIGTERM to exit {exited:.2f} s"
    )
    print(f"jit: termination message {json.dumps(message, sort_keys=True)[:600]}")
    shutil.rmtree(out, ignore_errors=True)
    return True


def run_jit_writer(params: int, device: str, workdir: Path) -> None:
    """The same files through CheckpointWriter: the model's and AdamW's tensors on the device."""
    from trainer_runtime.checkpoint.io import (
        OPTIMIZER_META_KEY,
        CheckpointWriter,
        optimizer_state_to_tensors,
    )
    from trainer_runtime.checkpoint.safetensors_stream import TensorFile

    model = _model(params, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    width, _ = _width_and_layers(params)
    x = torch.randn(4, width, device=device)
    model(x, x)["loss"].backward()
    opt.step()
    _sync(device)
    tensors, meta = optimizer_state_to_tensors(opt.state_dict())
    out = workdir / "jit-writer"
    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    writer = CheckpointWriter(str(out), 2)
    writer.begin()
    writer.write_entries(
        [
            ("model.safetensors", TensorFile(model.state_dict()), False),
            ("optimizer.safetensors", TensorFile(tensors, {OPTIMIZER_META_KEY: meta}), False),
        ]
    )
    info = writer.commit()
    seconds = time.perf_counter() - started
    size, _, _ = _checkpoint_figures(out)
    print(
        f"jit (CheckpointWriter, {device}, {params / 1e9:.2f}B bf16 params + AdamW): complete="
        f"{info.complete}, {size / 1e9:.2f} GB in {seconds:.2f} s ({_gbps(size, seconds)}); "
        f"host memory now: {_fmt_stats(_host_stats())}"
    )
    shutil.rmtree(out, ignore_errors=True)


# -- device-to-host bandwidth ---------------------------------------------------------------------
def _tensors(total: int, device: str, each: int = 172 * MIB) -> list[torch.Tensor]:
    out = []
    left = total
    while left > 0:
        n = min(each, left)
        out.append(torch.randn(n // 2, device=device, dtype=torch.float32).to(torch.bfloat16))
        left -= n
    _sync(device)
    return out


def _timed(fn: Callable[[], Any], device: str, repeats: int = 3) -> list[float]:
    times = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return times


def run_d2h(total: int, device: str) -> None:
    import xxhash

    from trainer_runtime.checkpoint import staging

    tensors = _tensors(total, device)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    pin = device == "cuda"
    print(f"d2h: {nbytes / GIB:.2f} GiB in {len(tensors)} bf16 tensors of up to 172 MiB, {device}")

    torch_before = _torch_pinned()
    first = _timed(lambda: [t.to("cpu", non_blocking=True) for t in tensors], device, 1)
    warm = _timed(lambda: [t.to("cpu", non_blocking=True) for t in tensors], device)
    print(
        f"d2h: plain .to('cpu', non_blocking=True): first {_gbps(nbytes, first[0])}, then "
        f"{_gbps(nbytes, statistics.median(warm))}; torch's pinned pool grew by "
        f"{(_torch_pinned() - torch_before) / MIB:.0f} MiB for {nbytes / MIB:.0f} MiB of tensors"
    )
    one = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    views, at = [], 0
    for t in tensors:
        n = t.numel() * 2
        views.append(one[at : at + n].view(torch.bfloat16))
        at += n

    def into_one() -> None:
        for v, t in zip(views, tensors, strict=True):
            v.copy_(t, non_blocking=True)

    one_s = statistics.median(_timed(into_one, device))
    print(f"d2h: copy_(non_blocking=True) into one pinned buffer: {_gbps(nbytes, one_s)}")

    def sink(data: Any) -> int:
        return len(memoryview(data))

    hasher = xxhash.xxh3_128()

    def hashing(data: Any) -> int:
        hasher.update(data)
        return len(memoryview(data))

    for block in (8, 16, 32, 64):
        ring = staging.StagingRing(block * MIB, staging.DEPTH, stage_host_tensors=True)
        times = _timed(lambda r=ring: staging.stream_tensors(sink, tensors, ring=r), device)
        hashed = _timed(lambda r=ring: staging.stream_tensors(hashing, tensors, ring=r), device, 1)
        print(
            f"d2h: staging ring {staging.DEPTH} x {block} MiB (pinned={ring.pinned}): "
            f"{_gbps(nbytes, statistics.median(times))}; feeding an XXH3 hash "
            f"{_gbps(nbytes, hashed[0])}"
        )
        del ring
    if pin:
        size = GIB
        t = time.perf_counter()
        a = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        torch_s = time.perf_counter() - t
        t = time.perf_counter()
        b = staging.host_buffer(size, pin=True)
        ours_s = time.perf_counter() - t
        print(
            f"d2h: pinning 1 GiB: torch pin_memory {torch_s:.3f} s, mmap + cudaHostRegister "
            f"{ours_s:.3f} s (pinned: {b.is_pinned()})"
        )
        del a, b


# -- background snapshots -------------------------------------------------------------------------
def _state(total: int, device: str) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    # a third bf16 weights, two thirds fp32 optimizer state, 64 MiB tensors
    weights = total // 3
    yield (
        "model.safetensors",
        {
            f"w{i}": torch.randn(32 * MIB, device=device).to(torch.bfloat16)
            for i in range(max(1, weights // (64 * MIB)))
        },
    )
    yield (
        "optimizer.safetensors",
        {
            f"m{i}": torch.randn(16 * MIB, device=device)
            for i in range(max(1, (total - weights) // (64 * MIB)))
        },
    )


def run_snapshot(total: int, device: str, workdir: Path) -> None:
    from trainer_runtime.checkpoint.background import (
        BackgroundSave,
        SnapshotBuffers,
        snapshot_entry,
    )
    from trainer_runtime.checkpoint.io import CheckpointWriter
    from trainer_runtime.checkpoint.safetensors_stream import TensorFile

    files = dict(_state(total, device))
    nbytes = sum(t.numel() * t.element_size() for f in files.values() for t in f.values())
    _sync(device)
    out = workdir / "snapshot"
    for keep in (False, True):
        label = "keep=True" if keep else "keep=False (the default: given back)"
        buffers = SnapshotBuffers(keep=keep)
        for save in (1, 2):
            before = _host_stats()
            t = time.perf_counter()
            entries = [
                (n, snapshot_entry(n, TensorFile(d), buffers), False) for n, d in files.items()
            ]
            stall = time.perf_counter() - t
            during = _host_stats()
            held_during = buffers.held_bytes
            shutil.rmtree(out, ignore_errors=True)
            writer = CheckpointWriter(str(out), save)
            t = time.perf_counter()
            job = BackgroundSave(writer, entries, begin=True)
            del entries
            job.wait()
            written = time.perf_counter() - t
            if job.error is not None:
                raise job.error
            writer.commit()
            after = _host_stats()
            print(
                f"snapshot {label}, save {save}: {nbytes / GIB:.2f} GiB, stall {stall:.3f} s "
                f"({_gbps(nbytes, stall)}), write {written:.2f} s; held by the snapshot "
                f"{buffers.held_bytes / MIB:.0f} MiB after the write"
            )
            print(f"  before: {_fmt_stats(before)}")
            print(f"  during: {_fmt_stats(during)}, the snapshot's own {held_during / MIB:.0f} MiB")
            print(f"  after:  {_fmt_stats(after)}")
        buffers.clear()
    shutil.rmtree(out, ignore_errors=True)


def run_stall(total: int, device: str, workdir: Path) -> None:
    from trainer_runtime.checkpoint.background import BackgroundSave, snapshot_entry
    from trainer_runtime.checkpoint.io import CheckpointWriter
    from trainer_runtime.checkpoint.pinned import (
        STALL_LIMIT,
        HostMemory,
        PinnedStaging,
        read_host_memory,
    )
    from trainer_runtime.checkpoint.safetensors_stream import TensorFile

    files = dict(_state(total, device))
    nbytes = sum(t.numel() * t.element_size() for f in files.values() for t in f.values())
    gib = nbytes / GIB
    _sync(device)
    out = workdir / "stall"
    memory = read_host_memory()
    print(
        f"stall: {gib:.2f} GiB of state; host memory usable {memory.usable / GIB:.1f} GiB "
        f"(MemAvailable {memory.available / GIB:.1f} GiB, cgroup limit "
        f"{'none' if memory.cgroup_limit is None else f'{memory.cgroup_limit / GIB:.1f} GiB'})"
    )
    # the blocking save of the same state (what the stall is compared with)
    shutil.rmtree(out, ignore_errors=True)
    writer = CheckpointWriter(str(out), 1)
    t = time.perf_counter()
    writer.begin()
    writer.write_entries([(n, TensorFile(d), False) for n, d in files.items()])
    writer.commit()
    blocking = time.perf_counter() - t
    print(f"  blocking save: {blocking:.2f} s ({_gbps(nbytes, blocking)})")
    modes = {
        "at_save": PinnedStaging(None, read_memory=lambda: HostMemory(0)),
        "keep": PinnedStaging(True),
        "pin_ahead": PinnedStaging(False),
    }
    save_steps = 10
    for label, staged in modes.items():
        stalls: list[float] = []
        for save in (1, 2, 3):
            step = save * save_steps
            staged.before_snapshot()
            t = time.perf_counter()
            entries = [
                (n, snapshot_entry(n, TensorFile(d), staged.buffers), False)
                for n, d in files.items()
            ]
            stall = time.perf_counter() - t
            staged.after_snapshot(stall)
            stalls.append(stall)
            shutil.rmtree(out, ignore_errors=True)
            writer = CheckpointWriter(str(out), step)
            t = time.perf_counter()
            job = BackgroundSave(writer, entries, begin=True)
            del entries
            job.wait()
            written = time.perf_counter() - t
            if job.error is not None:
                raise job.error
            writer.commit()
            staged.after_write(job.seconds)
            held = staged.buffers.held_bytes
            pinned = ""
            # the steps before the next save: the pin-ahead thread (in its mode)
            thread = staged.maybe_pin_ahead(step + save_steps - 1, save_steps, 1.0, writing=False)
            if thread is not None:
                t = time.perf_counter()
                thread.join()
                pinned = f", pinned ahead in {time.perf_counter() - t:.2f} s"
            print(
                f"  {label} (mode {staged.mode}), save {save}: stall {stall:.3f} s "
                f"({stall / gib:.3f} s/GiB, {stall / blocking:.3f} x the blocking save), write "
                f"{written:.2f} s; held after the write {held / MIB:.0f} MiB{pinned}"
            )
        later = stalls[1:]
        worst = max(later)
        print(
            f"==> stall {label}: {statistics.median(later) / gib:.3f} s/GiB after the first save "
            f"(first {stalls[0] / gib:.3f} s/GiB); worst {worst / blocking:.3f} x the blocking "
            f"save ({'within' if worst <= STALL_LIMIT * blocking else 'OVER'} the "
            f"{STALL_LIMIT} limit)"
        )
        staged.clear()
    shutil.rmtree(out, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--params", default=None, help="JIT model size (default 1.5B; CPU 20M)")
    p.add_argument("--d2h-gib", type=float, default=None, help="default 4 (CPU 0.25)")
    p.add_argument("--snapshot-gib", type=float, default=None, help="default 4 (CPU 0.25)")
    p.add_argument("--only", default="jit,d2h,snapshot", help="also: stall")
    p.add_argument("--jit-mode", choices=["auto", "trainer", "writer"], default="auto")
    p.add_argument("--workdir", default=None)
    p.add_argument("--jit-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.jit_child:
        _jit_child(json.loads(args.jit_child))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_d2h: CUDA is not available: skipped (use --device cpu for a smoke run)")
        return 0
    cpu = args.device == "cpu"
    params = _params(args.params or ("20M" if cpu else "1.5B"))
    d2h = int((args.d2h_gib or (0.25 if cpu else 4)) * GIB)
    snap = int((args.snapshot_gib or (0.25 if cpu else 4)) * GIB)
    if cpu:
        print("gpu_d2h: CPU smoke run: the harness at small sizes; these are not GPU figures")
    else:
        print(f"gpu_d2h: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="gpu-d2h-"))
    work.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(","))
    try:
        if "jit" in only:
            done = args.jit_mode != "writer" and run_jit_trainer(params, args.device, work)
            if not done:
                if args.jit_mode == "trainer":
                    return 1
                run_jit_writer(params, args.device, work)
        if "d2h" in only:
            run_d2h(d2h, args.device)
        if "snapshot" in only:
            run_snapshot(snap, args.device, work)
        if "stall" in only:
            run_stall(snap, args.device, work)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
