"""CPU training keeps freed gradient-sized blocks in the process instead of page-faulting them
back in every step. Each case runs in a fresh interpreter: the allocator is process state."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# A real CPU training run of our Trainer: four W x W Linear layers (gradients freed by
# zero_grad(set_to_none=True) after every step and allocated again by the next backward); prints
# the median minor page faults of steps 6-14.
PROBE = """
import json, os, resource, statistics, sys, tempfile
import torch
from torch import nn
from trainer_runtime import Trainer, TrainerCallback, TrainingArguments
from trainer_runtime.features import host_memory
W = int(os.environ["PROBE_WIDTH"])
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(W, W, bias=False) for _ in range(4)))
    def forward(self, x, labels=None):
        out = self.layers(x)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}
class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 1024
    def __getitem__(self, i):
        x = torch.randn(W, generator=torch.Generator().manual_seed(i))
        return {"x": x, "labels": x.flip(0)}
class Faults(TrainerCallback):
    def __init__(self):
        self.at = {}
    def on_step_begin(self, args, state, control, **kw):
        self.at[state.global_step] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
faults = Faults()
args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8,
    max_steps=15, save_strategy="no", use_cpu=True, report_to="none", disable_tqdm=True,
    enable_jit_checkpoint=False, logging_steps=1000)
Trainer(model=Model(), args=args, train_dataset=Data(), callbacks=[faults]).train()
per_step = [faults.at[s + 1] - faults.at[s] for s in range(5, 14)]
print(json.dumps({"tuned": host_memory._done, "faults": statistics.median(per_step)}))
"""

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="glibc's allocator (Linux only)"
)


def _probe(width: int = 2236, **env: str) -> dict[str, object]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "PREEMPTIBLE_"))}
    out = subprocess.run(
        [sys.executable, "-P", "-c", PROBE],
        capture_output=True,
        text=True,
        env={**clean, "OMP_NUM_THREADS": "1", "PROBE_WIDTH": str(width), **env},
        check=True,
        timeout=300,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "width",
    [
        2236,  # 20 MiB gradients: below glibc's largest mmap threshold (32 MiB)
        3100,  # 37 MiB gradients: above it, mapped per allocation unless M_MMAP_MAX is 0
    ],
)
def test_cpu_training_steps_reuse_gradient_memory(width: int) -> None:
    tuned = _probe(width)
    if not tuned["tuned"]:
        pytest.skip("not glibc: mallopt unavailable")
    # 80-147 MiB of gradients faulted back in would be 20,000-37,000 faults a step; kept, few.
    assert float(tuned["faults"]) < 500, tuned  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "env",
    [
        {"PREEMPTIBLE_HOST_MALLOC": "0"},
        {"MALLOC_TRIM_THRESHOLD_": "1000000"},
        {"MALLOC_MMAP_THRESHOLD_": "1000000"},
        {"MALLOC_MMAP_MAX_": "65536"},
    ],
)
def test_opt_out_and_the_users_own_settings_win(env: dict[str, str]) -> None:
    assert _probe(**env)["tuned"] is False
