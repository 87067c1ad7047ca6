"""How a JIT save scales with ranks: bytes, extra host memory and time per rank (DDP and FSDP).

For each mode (``ddp``: replicated state, split across the ranks by bytes; ``fsdp``: every rank
its own shards) and each number of ranks, one run of N real processes (gloo on CPU, or one CUDA
process with ``--device cuda``) trains a model of about ``--params`` parameters (an embedding and
blocks of two square and two 4x-wide linear layers, fp32, AdamW) for one step through our
Trainer, then every rank calls the Trainer's JIT save (``save_checkpoint(jit=True)``: what a
SIGTERM triggers) at the same moment. Each rank measures, around that call only:

* bytes written: the growth of ``wchar`` in ``/proc/self/io`` (every byte the process passed to
  write calls, O_DIRECT or not; our own bookkeeping is not trusted for this);
* peak extra host memory: its resident set sampled every 2 ms, peak minus the value just before;
* seconds: the call's wall time; the slowest rank's is the save's time.

Targets (issue 28): bytes per rank <= 1.1 x total / N; extra host memory per rank <= its share
(total / N) + 256 MB; no gathered full-model file in an FSDP JIT checkpoint.

With ``--resume`` (issue 38) every rank then drops that Trainer and resumes a new one (another
initialisation, ``train(resume_from_checkpoint=...)`` with nothing left to train) from the
checkpoint just written, and measures around the load only (the Trainer's
``_load_resume_checkpoint``, fallback agreement included):

* bytes read from storage: the growth of the storage seam's counter (:mod:`read_stats`: whole
  files, ranged reads, local or object store, memory-mapped files counted once);
* extra host memory: the peak resident set minus the value just before, and the same less the
  optimizer state the rank keeps afterwards in host memory (on CPU the state itself lives there;
  on a GPU it would be device memory): the second is held to the target;
* seconds: the load's wall time, printed beside the save's.

Same targets: bytes read per rank <= 1.1 x total / N, extra host memory <= total / N + 256 MB.
``--storage local,s3`` also saves to and resumes from the tier's S3 server (versitygw on
loopback, built by ``tests/cluster/build.sh``).

    python -P benchmarks/jit_scaling.py [--ranks 1,2,4] [--modes ddp,fsdp] [--params 200M]
                                         [--device cpu|cuda] [--workdir DIR]
                                         [--resume] [--storage local,s3]

FSDP needs at least 2 ranks (``--ranks 1`` runs DDP only). On this 2-core VM 4 ranks share two
cores and the save times are not what 4 GPUs' hosts give; bytes and memory per rank are.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

WIDTH = 1024
VOCAB = 32_000
EXTRA_MB = 256


def _model(params: int) -> Any:
    import torch
    from torch import nn

    per_block = 2 * WIDTH * WIDTH + 2 * 4 * WIDTH * WIDTH
    blocks = max(1, round((params - VOCAB * WIDTH) / per_block))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = nn.Linear(WIDTH, WIDTH, bias=False)
            self.o = nn.Linear(WIDTH, WIDTH, bias=False)
            self.up = nn.Linear(WIDTH, 4 * WIDTH, bias=False)
            self.down = nn.Linear(4 * WIDTH, WIDTH, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.o(torch.tanh(self.q(x)))
            return x + self.down(torch.relu(self.up(x)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, WIDTH)
            self.blocks = nn.ModuleList(Block() for _ in range(blocks))

        def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
            x = self.embed(ids)
            for block in self.blocks:
                x = block(x)
            loss = x.float().pow(2).mean()
            return {"loss": loss, "logits": x}

    return Net()


class _Data:
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, Any]:
        import torch

        return {"ids": torch.tensor([i % VOCAB, (7 * i) % VOCAB])}


def _io_written() -> int:
    with open("/proc/self/io") as fh:
        for line in fh:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar")


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakRss:
    """Samples the resident set on a thread until stopped; ``peak`` is the largest seen."""

    def __init__(self) -> None:
        self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __enter__(self) -> _PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _worker(spec: dict[str, Any]) -> None:
    import torch

    from trainer_runtime import Trainer, TrainingArguments
    from trainer_runtime.distributed import collectives

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cuda = spec["device"] == "cuda"
    model = _model(spec["params"])
    if cuda:
        model = model.to("cuda")
    kwargs: dict[str, Any] = {}
    if spec["mode"] == "fsdp":
        kwargs["fsdp"] = "full_shard"
    args = TrainingArguments(
        output_dir=spec["output_dir"],
        max_steps=1,
        per_device_train_batch_size=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        logging_strategy="no",
        use_cpu=not cuda,
        save_async=False,
        **kwargs,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_Data())
    trainer.train()
    collectives.barrier()
    before_io, before_rss = _io_written(), _rss()
    started = time.perf_counter()
    with _PeakRss() as peak:
        info = trainer.save_checkpoint(jit=True)
    seconds = time.perf_counter() - started
    result = {
        "rank": collectives.rank(),
        "bytes": _io_written() - before_io,
        "extra_rss": peak.peak - before_rss,
        "seconds": seconds,
        "files": sorted(f["path"] for f in (info.manifest or {}).get("files", [])),
        "total": sum(f["size"] for f in (info.manifest or {}).get("files", [])),
    }
    if spec.get("resume"):
        del trainer, model
        gc.collect()
        result.update(_resume(spec, info.path, args))
    print("RESULT " + json.dumps(result), flush=True)


def _kept_host_bytes(optimizer: Any) -> int:
    """Bytes of the optimizer state held in host memory (each storage once)."""
    import torch

    seen: dict[int, int] = {}
    for state in optimizer.state.values():
        for value in state.values():
            if hasattr(value, "to_local"):
                value = value.to_local()  # FSDP: a DTensor, this rank's shard
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                storage = value.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _resume(spec: dict[str, Any], path: str, args: Any) -> dict[str, Any]:
    """A new Trainer (another initialisation) resumes from ``path``; the load is measured."""
    import torch

    from trainer_runtime import Trainer
    from trainer_runtime.checkpoint import read_stats
    from trainer_runtime.distributed import collectives

    measured: dict[str, Any] = {}

    class Measured(Trainer):
        def _load_resume_checkpoint(self, info: Any) -> Any:
            collectives.barrier()
            read_stats.reset()
            before = _rss()
            started = time.perf_counter()
            with _PeakRss() as peak:
                loaded = super()._load_resume_checkpoint(info)
            measured["resume_seconds"] = time.perf_counter() - started
            measured["read"] = read_stats.bytes_read()
            measured["resume_rss"] = peak.peak - before
            return loaded

    torch.manual_seed(1)
    model = _model(spec["params"])
    if spec["device"] == "cuda":
        model = model.to("cuda")
    trainer = Measured(model=model, args=args, train_dataset=_Data())
    trainer.train(resume_from_checkpoint=path)
    if not measured:
        raise RuntimeError(f"nothing was resumed from {path}")
    kept = _kept_host_bytes(trainer.optimizer)
    measured["kept"] = kept
    measured["resume_extra"] = measured["resume_rss"] - kept
    return measured


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(
    mode: str,
    ranks: int,
    params: int,
    device: str,
    workdir: Path,
    *,
    resume: bool = False,
    s3: _S3 | None = None,
) -> list[dict[str, Any]]:
    out = workdir / f"{mode}-{ranks}"
    shutil.rmtree(out, ignore_errors=True)
    output_dir = str(out) if s3 is None else f"s3://{s3.bucket}/{mode}-{ranks}"
    spec = {
        "mode": mode,
        "params": params,
        "device": device,
        "output_dir": output_dir,
        "resume": resume,
    }
    port = _free_port()
    procs = []
    for rank in range(ranks):
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTIBLE_")}
        env.update(OMP_NUM_THREADS="1", PREEMPTIBLE_HOST_MALLOC="0")
        if ranks > 1:
            env.update(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                WORLD_SIZE=str(ranks),
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(ranks),
            )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-P", __file__, "--worker", json.dumps(spec)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=1800)[0] for p in procs]
    results = []
    for p, text in zip(procs, outputs, strict=True):
        if p.returncode != 0:
            raise SystemExit(f"{mode} x {ranks}: a rank exited {p.returncode}\n{text[-4000:]}")
        results += [
            json.loads(line.removeprefix("RESULT "))
            for line in text.splitlines()
            if line.startswith("RESULT ")
        ]
    shutil.rmtree(out, ignore_errors=True)
    if s3 is not None:
        shutil.rmtree(s3.server.data_dir / s3.bucket / f"{mode}-{ranks}", ignore_errors=True)
    return sorted(results, key=lambda r: r["rank"])


class _S3:
    """The tier's S3 server (tests/cluster/s3.py), its endpoint and credentials in this
    process's environment (the ranks inherit them)."""

    def __init__(self, workdir: Path) -> None:
        # the repository root after the standard library: its operator/ must not shadow it
        sys.path.append(str(Path(__file__).resolve().parents[1]))
        from tests.cluster.binaries import find_versitygw
        from tests.cluster.s3 import S3Server

        binary, version = find_versitygw()
        if binary is None:
            raise SystemExit(f"--storage s3: versitygw {version} is not built")
        self.server = S3Server(binary, workdir / "s3")
        self.server.start()
        self.bucket = self.server.create_bucket("bench")
        os.environ.update(self.server.client_env())
        print(f"S3 server: versitygw {version} at {self.server.endpoint}", flush=True)

    def stop(self) -> None:
        self.server.stop()


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f}"


def _resume_row(
    storage: str, mode: str, ranks: int, results: list[dict[str, Any]], failures: list[str]
) -> tuple[Any, ...]:
    total = results[0]["total"]
    share = total / ranks
    read = [r["read"] for r in results]
    extra = [r["resume_extra"] for r in results]
    peak = [r["resume_rss"] for r in results]
    ok_bytes = max(read) <= 1.1 * share
    ok_mem = max(extra) <= share + EXTRA_MB * 1e6
    for name, ok in (("resume bytes", ok_bytes), ("resume memory", ok_mem)):
        if not ok:
            failures.append(f"{storage} {mode} x {ranks}: {name}")
    return (
        storage,
        mode,
        ranks,
        _mb(total),
        " / ".join(_mb(b) for b in read),
        f"{max(read) / share:.2f}",
        " / ".join(_mb(x) for x in peak),
        " / ".join(_mb(r["kept"]) for r in results),
        " / ".join(_mb(x) for x in extra),
        _mb(share + EXTRA_MB * 1e6),
        f"{max(r['resume_seconds'] for r in results):.2f}",
        f"{max(r['seconds'] for r in results):.2f}",
    )


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--ranks", default="1,2,4", help="numbers of ranks, e.g. 1,2,4")
    p.add_argument("--modes", default="ddp,fsdp", help="ddp, fsdp or both")
    p.add_argument("--params", default="200M", help="model size, e.g. 200M")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--resume", action="store_true", help="also measure the resume (issue 38)")
    p.add_argument("--storage", default="local", help="local, s3 or both (s3: the tier's server)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        _worker(json.loads(a.worker))
        return 0
    text = a.params.strip().upper()
    scale = {"M": 1e6, "B": 1e9}.get(text[-1])
    params = int(float(text[:-1]) * scale) if scale else int(text)
    rank_counts = [int(x) for x in a.ranks.split(",")]
    if a.device == "cuda" and rank_counts != [1]:
        raise SystemExit("--device cuda runs one rank (one GPU): use --ranks 1")
    storages = [x.strip() for x in a.storage.split(",") if x.strip()]
    if set(storages) - {"local", "s3"}:
        raise SystemExit(f"--storage {a.storage!r}: use local, s3 or both")
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="jit-scaling-"))
    s3 = _S3(workdir) if "s3" in storages else None
    rows, resume_rows, failures = [], [], []
    try:
        for storage in storages:
            for mode in [m.strip() for m in a.modes.split(",")]:
                for ranks in rank_counts:
                    if mode == "fsdp" and ranks < 2:
                        continue
                    try:
                        results = _run(
                            mode,
                            ranks,
                            params,
                            a.device,
                            workdir,
                            resume=a.resume,
                            s3=s3 if storage == "s3" else None,
                        )
                    except SystemExit as exc:  # one configuration failed: report, go on
                        print(exc, file=sys.stderr, flush=True)
                        failures.append(f"{storage} {mode} x {ranks}: failed")
                        continue
                    rows.append(_save_row(storage, mode, ranks, results, failures))
                    if a.resume:
                        resume_rows.append(_resume_row(storage, mode, ranks, results, failures))
                    print(f"done: {storage} {mode} x {ranks}", file=sys.stderr, flush=True)
    finally:
        if s3 is not None:
            s3.stop()
    print(f"params {params:,} ({a.device}); targets: bytes <= 1.1 x total/N, extra host memory")
    print(f"<= total/N + {EXTRA_MB} MB, no full-model file in an FSDP JIT checkpoint")
    print("\nsave (JIT):")
    _table(
        (
            "storage",
            "mode",
            "ranks",
            "total MB",
            "written MB per rank",
            "max/(total/N)",
            "extra host MB per rank",
            "limit MB",
            "save s per rank",
            "slowest s",
            "mean s",
            "full model file",
        ),
        rows,
    )
    if a.resume:
        print("\nresume (the load; extra = peak RSS above the baseline less the optimizer")
        print("state kept in host memory, which a GPU run keeps on the device):")
        _table(
            (
                "storage",
                "mode",
                "ranks",
                "total MB",
                "read MB per rank",
                "max/(total/N)",
                "peak RSS MB per rank",
                "kept state MB",
                "extra host MB per rank",
                "limit MB",
                "resume s (slowest)",
                "save s (slowest)",
            ),
            resume_rows,
        )
    print("all targets met" if not failures else "NOT MET: " + "; ".join(failures))
    return 0 if not failures else 1


def _save_row(
    storage: str, mode: str, ranks: int, results: list[dict[str, Any]], failures: list[str]
) -> tuple[Any, ...]:
    total = results[0]["total"]
    share = total / ranks
    per_rank = [r["bytes"] for r in results]
    extra = [r["extra_rss"] for r in results]
    seconds = [r["seconds"] for r in results]
    full_file = "model.safetensors" in results[0]["files"]
    ok_bytes = max(per_rank) <= 1.1 * share
    ok_mem = max(extra) <= share + EXTRA_MB * 1e6
    ok_file = not (mode == "fsdp" and full_file)
    for name, ok in (("bytes", ok_bytes), ("memory", ok_mem), ("no full file", ok_file)):
        if not ok:
            failures.append(f"{storage} {mode} x {ranks}: {name}")
    return (
        storage,
        mode,
        ranks,
        _mb(total),
        " / ".join(_mb(b) for b in per_rank),
        f"{max(per_rank) / share:.2f}",
        " / ".join(_mb(x) for x in extra),
        _mb(share + EXTRA_MB * 1e6),
        " / ".join(f"{s:.2f}" for s in seconds),
        f"{max(seconds):.2f}",
        f"{statistics.mean(seconds):.2f}",
        "yes" if full_file else "no",
    )


if __name__ == "__main__":
    sys.exit(main())
