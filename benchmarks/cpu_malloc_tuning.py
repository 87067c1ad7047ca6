"""CPU training with and without ``TrainingArguments.cpu_malloc_tuning`` (docs/trainer.md).

Fresh processes, alternating which goes first: four square ``nn.Linear`` layers with AdamW,
trained on the CPU by our Trainer with one torch thread; prints each run's steps/s (median of
steps 2-14) and peak RSS, then the range of each variant. The tuning is off by default in a
user's process; this benchmark turns it on explicitly for one of the two variants.

    python benchmarks/cpu_malloc_tuning.py [--width 5000] [--repeats 2]

(``--width 5000``: 100M parameters, gradients of 100 MB, above glibc's 32 MiB mmap threshold.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence

CHILD = r"""
import json, resource, statistics, sys, tempfile, time
import torch
from torch import nn
from trainer_runtime import Trainer, TrainerCallback, TrainingArguments
from trainer_runtime.features import host_memory
torch.set_num_threads(1)
W, tuning = int(sys.argv[1]), sys.argv[2] == "1"
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(W, W, bias=False) for _ in range(4)))
    def forward(self, x, labels=None):
        out = self.layers(x)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}
class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 4096
    def __getitem__(self, i):
        x = torch.randn(W, generator=torch.Generator().manual_seed(i))
        return {"x": x, "labels": x.flip(0)}
class Clock(TrainerCallback):
    def __init__(self):
        self.begin, self.end = {}, {}
    def on_step_begin(self, args, state, control, **kw):
        self.begin[state.global_step] = time.perf_counter()
    def on_step_end(self, args, state, control, **kw):
        self.end[state.global_step] = time.perf_counter()
clock = Clock()
args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8,
    max_steps=14, save_strategy="no", use_cpu=True, report_to="none", disable_tqdm=True,
    enable_jit_checkpoint=False, logging_steps=1000, learning_rate=1e-4,
    lr_scheduler_type="constant", cpu_malloc_tuning=tuning)
Trainer(model=Model(), args=args, train_dataset=Data(), callbacks=[clock]).train()
steps = [clock.end[s] - clock.begin[s - 1] for s in range(2, 15)]
print(json.dumps({"tuned": host_memory._done, "steps_per_s": 1 / statistics.median(steps),
    "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9}))
"""


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--width", type=int, default=5000, help="Linear layers' width (5000: 100M)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each variant")
    args = p.parse_args(argv)
    prefixes = ("PREEMPTIBLE_", "MALLOC_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env.pop("GLIBC_TUNABLES", None)
    env["OMP_NUM_THREADS"] = "1"
    results: dict[str, list[dict[str, float]]] = {"0": [], "1": []}
    for rep in range(args.repeats):
        for tuning in ("0", "1") if rep % 2 == 0 else ("1", "0"):
            cmd = [sys.executable, "-P", "-c", CHILD, str(args.width), tuning]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            results[tuning].append(result)
            print(f"cpu_malloc_tuning={tuning == '1'}: {result}", flush=True)
    params = 4 * args.width * args.width / 1e6
    print(f"\n{params:.0f}M parameters, {args.repeats} fresh processes each:")
    for tuning, runs in results.items():
        sps = [r["steps_per_s"] for r in runs]
        rss = [r["peak_rss_gb"] for r in runs]
        print(
            f"  cpu_malloc_tuning={tuning == '1'}: {min(sps):.2f}-{max(sps):.2f} steps/s, "
            f"peak RSS {min(rss):.2f}-{max(rss):.2f} GB"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
