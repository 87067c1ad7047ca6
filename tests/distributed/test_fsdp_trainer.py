"""The Trainer with ``fsdp`` on 2 gloo ranks (real processes): SIGTERM to one rank stops both at the
same step with a complete sharded JIT checkpoint and exit 75, the resumed run ends bit-identical
to an uninterrupted FSDP run, a sharded checkpoint with the sentinel is refused, and evaluate(),
predict(), save_model() and load_best_model_at_end work on the sharded model."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.distributed.conftest import MAX_STEPS, RUN_TIMEOUT, SAVE_STEPS, WORLD_SIZE, toy_args
from tests.distributed.ranks import RankedRun, free_port
from trainer_runtime.checkpoint.layout import SENTINEL_NAME, CheckpointStore
from trainer_runtime.cli import main as cli_main
from trainer_runtime.protocol import EXIT_PREEMPTED
from trainer_runtime.testing import weights_identical
from trainer_runtime.toy import FEATURES, HIDDEN

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(600)]

STEP_SLEEP = 0.3
# Gradient accumulation and clipping (max_grad_norm=1.0, the default) are part of every run.
FSDP_ARGS = ("--fsdp", "full_shard", "--gradient-accumulation-steps", "2")


def fsdp_args(*, step_sleep: float = 0.0) -> list[str]:
    return [*toy_args(step_sleep=step_sleep), *FSDP_ARGS]


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 2-rank FSDP run of MAX_STEPS steps; its output dir."""
    root = tmp_path_factory.mktemp("fsdp-reference")
    with RankedRun(root / "out", root, world_size=WORLD_SIZE, args=fsdp_args()) as run:
        codes = run.wait(RUN_TIMEOUT)
    assert codes == [0] * WORLD_SIZE, f"reference run exited {codes}\n{run.tails()}"
    info = CheckpointStore(str(root / "out")).inspect(f"checkpoint-{MAX_STEPS}")
    assert info.complete, info
    return root / "out"


def _moment() -> tuple[int, int, float]:
    seed = int(os.environ.get("PREEMPTIBLE_TEST_SEED") or random.SystemRandom().randrange(10**6))
    rng = random.Random(seed)
    rank, step, delay = rng.randrange(WORLD_SIZE), rng.randint(2, MAX_STEPS - 3), rng.random()
    delay *= STEP_SLEEP
    print(f"PREEMPTIBLE_TEST_SEED={seed}: SIGTERM to rank {rank}, {delay:.2f} s into step {step}")
    return rank, step, delay


def test_sigterm_to_one_fsdp_rank_then_resume_is_bit_identical(
    tmp_path: Path, fsdp_reference: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target, step, delay = _moment()
    out = tmp_path / "out"
    with RankedRun(
        out, tmp_path, world_size=WORLD_SIZE, args=fsdp_args(step_sleep=STEP_SLEEP)
    ) as run:
        run.ranks[target].wait_for_event("step_begin", step=step, timeout=RUN_TIMEOUT)
        time.sleep(delay)  # inside the step's (slow) forward pass
        run.send(target, signal.SIGTERM)
        codes = run.wait(RUN_TIMEOUT)
    assert codes == [EXIT_PREEMPTED] * WORLD_SIZE, f"exit codes {codes}\n{run.tails()}"

    msg = run.ranks[0].termination_message()
    assert msg.reason == "preempted" and msg.complete, msg
    assert step <= msg.step < MAX_STEPS, msg
    for rank in range(WORLD_SIZE):
        ended, begun = run.steps_ended(rank), run.steps_begun(rank)
        assert ended and ended[-1] == msg.step, f"rank {rank} ended at {ended[-1:]}, not {msg.step}"
        assert begun[-1] == msg.step, f"rank {rank} began step {begun[-1]} after the stop step"

    # The JIT checkpoint: complete, committed by the manifest, every rank's shards listed.
    info = CheckpointStore(str(out)).inspect(f"checkpoint-{msg.step}")
    assert info.complete, info.reason
    manifest = info.manifest
    assert manifest is not None and manifest["world_size"] == WORLD_SIZE
    shards = [f"fsdp-state-0000{r + 1}-of-00002.safetensors" for r in range(WORLD_SIZE)]
    assert manifest["sharding"] == {
        "format": "fsdp-shards/1",
        "world_size": WORLD_SIZE,
        "files": shards,
        "optimizer": True,
    }
    listed = {f["path"] for f in manifest["files"]}
    rngs = {f"rng_state_{r}.safetensors" for r in range(WORLD_SIZE)}
    assert {"trainer_state.json", *shards, *rngs} <= listed
    # the optimizer state is in the shards; a JIT save never gathers the full model
    assert "optimizer.safetensors" not in listed and "model.safetensors" not in listed
    # every rank wrote its own pieces (half of each layer's rows), nothing gathered
    for shard in shards:
        pieces = load_file(str(Path(info.path) / shard))
        assert pieces["model.net.0.weight"].shape == (HIDDEN // WORLD_SIZE, FEATURES), shard
    assert not (Path(info.path) / SENTINEL_NAME).exists()
    # trainer-runtime inspect describes it as sharded.
    assert cli_main(["inspect", str(out)]) == 0
    shown = capsys.readouterr().out
    assert f"newest complete: checkpoint-{msg.step}" in shown, shown
    assert "sharded: fsdp-shards/1 (FSDP model and optimizer shards of 2 ranks" in shown, shown

    # The next attempt resumes from the newest complete checkpoint and trains to the end.
    with RankedRun(
        out, tmp_path, world_size=WORLD_SIZE, args=fsdp_args(), attempt=2, resume_from="latest"
    ) as resumed:
        codes = resumed.wait(RUN_TIMEOUT)
    assert codes == [0] * WORLD_SIZE, f"resumed run exited {codes}\n{resumed.tails()}"
    for rank in range(WORLD_SIZE):
        begun = resumed.steps_begun(rank)
        assert begun and begun[0] == msg.step + 1, f"rank {rank} resumed at {begun[:1]}"
    same, detail = weights_identical(
        out / f"checkpoint-{MAX_STEPS}", fsdp_reference / f"checkpoint-{MAX_STEPS}"
    )
    assert same, f"resumed FSDP run differs from the uninterrupted one: {detail}"


def test_fsdp_checkpoint_with_sentinel_is_refused(tmp_path: Path, fsdp_reference: Path) -> None:
    out = tmp_path / "out"
    source = fsdp_reference / "checkpoint-4"
    target = out / "checkpoint-4"
    target.mkdir(parents=True)
    for item in source.iterdir():
        (target / item.name).write_bytes(item.read_bytes())
    # A rewrite of this step was interrupted: the sentinel is back.
    (target / SENTINEL_NAME).write_text("{}")
    with RankedRun(
        out, tmp_path, world_size=WORLD_SIZE, args=fsdp_args(), resume_from=str(target)
    ) as run:
        codes = run.wait(RUN_TIMEOUT)
    assert all(code not in (0, EXIT_PREEMPTED) for code in codes), f"{codes}\n{run.tails()}"
    msg = run.ranks[0].termination_message()
    assert msg.reason == "failed", msg
    assert "ResumeError" in (msg.message or "") and "cannot resume" in (msg.message or ""), msg
    assert not run.steps_begun(0), "training started from an incomplete checkpoint"
    assert [c.name for c in CheckpointStore(str(out)).list()] == ["checkpoint-4"]


def test_evaluate_predict_save_model_and_best_model_under_fsdp(tmp_path: Path) -> None:
    port = free_port()
    procs = []
    for rank in range(WORLD_SIZE):
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTIBLE_")}
        env.update(
            {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "WORLD_SIZE": str(WORLD_SIZE),
                "RANK": str(rank),
                "LOCAL_RANK": "0",
                "OMP_NUM_THREADS": "1",
            }
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.distributed.fsdp_trainer_worker", str(tmp_path)],
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
        assert p.returncode == 0, text[-4000:]
    results = {
        r["rank"]: r
        for r in (
            json.loads(line.removeprefix("RESULT "))
            for text in outputs
            for line in text.splitlines()
            if line.startswith("RESULT ")
        )
    }
    assert sorted(results) == list(range(WORLD_SIZE)), outputs
    zero, one = results[0], results[1]
    # Both linear layers are units of their own (SIZE_BASED_WRAP, min_num_params=100), plus root.
    assert len(zero["units"]) == 3, zero["units"]
    assert zero["checkpointed"] == 2  # fsdp_config.activation_checkpointing: one per unit
    # Ranks built different weights (seeded by rank): rank 0's were broadcast before sharding.
    assert zero["synced_from_rank0"]
    assert zero["global_step"] == one["global_step"] == 6
    # Every rank computed the same global metrics, grad norms and predictions (all 40 samples).
    assert zero["eval_loss"] == one["eval_loss"]
    assert zero["grad_norms"] == one["grad_norms"] and len(zero["grad_norms"]) == 6
    assert zero["pred_shape"] == one["pred_shape"] == [40, 4]
    assert zero["pred_sum"] == one["pred_sum"]
    # load_best_model_at_end loaded the best checkpoint's shards: the final evaluation is the
    # best evaluation seen during training.
    assert zero["best"] and zero["best"].endswith(f"checkpoint-{zero['best_step']}")
    assert zero["eval_loss"] == pytest.approx(zero["best_metric"], rel=1e-6)
    # save_model wrote the full (unsharded) weights on rank 0 only; as a plain module they give
    # the same loss and predictions as the sharded model.
    assert zero["saved"] and one["saved"] is None
    assert (tmp_path / "final" / "model.safetensors").is_file()
    assert zero["plain_eval_loss"] == pytest.approx(zero["eval_loss"], rel=1e-5)
    assert zero["plain_pred_sum"] == pytest.approx(zero["pred_sum"], rel=1e-5, abs=1e-5)
    # SHARDED_STATE_DICT: checkpoints hold only the shards, no gathered model.safetensors.
    manifest = json.loads(Path(zero["best"], "manifest.json").read_text())
    assert "model.safetensors" not in {f["path"] for f in manifest["files"]}


def test_fsdp_background_saves_jit_supersedes_and_resume_is_bit_identical(
    tmp_path: Path, fsdp_reference: Path
) -> None:
    """save_async with FSDP: each rank snapshots its own shards and writes them on its writer
    thread; a SIGTERM while a write is in flight ends in a complete sharded JIT checkpoint (the
    write in flight superseded), and the resumed run ends bit-identical."""
    out = tmp_path / "out"
    args = [*fsdp_args(step_sleep=0.05), "--save-sleep", "1.5", "--save-async", "true"]
    with RankedRun(out, tmp_path, world_size=WORLD_SIZE, args=args) as run:
        run.ranks[0].wait_for_event("save_begin", step=SAVE_STEPS, timeout=RUN_TIMEOUT)
        for rank in range(WORLD_SIZE):  # both ranks train on while checkpoint-4 is written
            run.ranks[rank].wait_for_event("step_begin", step=SAVE_STEPS + 1, timeout=RUN_TIMEOUT)
        run.send(1, signal.SIGTERM)
        codes = run.wait(RUN_TIMEOUT)
    assert codes == [EXIT_PREEMPTED] * WORLD_SIZE, f"exit codes {codes}\n{run.tails()}"
    msg = run.ranks[0].termination_message()
    assert msg.reason == "preempted" and msg.complete and msg.step > SAVE_STEPS, msg
    assert not (out / f"checkpoint-{SAVE_STEPS}").exists()
    jit = CheckpointStore(str(out)).inspect(f"checkpoint-{msg.step}")
    assert jit.complete and jit.manifest is not None
    assert jit.manifest["sharding"]["format"] == "fsdp-shards/1"
    with RankedRun(
        out,
        tmp_path,
        world_size=WORLD_SIZE,
        args=[*fsdp_args(), "--save-async", "true"],
        attempt=2,
        resume_from="latest",
    ) as resumed:
        codes = resumed.wait(RUN_TIMEOUT)
    assert codes == [0] * WORLD_SIZE, f"resumed run exited {codes}\n{resumed.tails()}"
    same, detail = weights_identical(
        out / f"checkpoint-{MAX_STEPS}", fsdp_reference / f"checkpoint-{MAX_STEPS}"
    )
    assert same, f"resumed FSDP run differs from the uninterrupted one: {detail}"
