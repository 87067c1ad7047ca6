"""Under FSDP with ``state_dict_type='FULL_STATE_DICT'``, a periodic save that falls due after a
SIGTERM is the JIT save (issue 37, item 4): sharded, no full gather (no ``model.safetensors``),
marked ``save_kind: jit`` in its runtime record, the one save of that step, exit 75 there.

A periodic save of this configuration gathers the whole model on every rank and writes it: the
cost the JIT path exists to avoid inside the grace.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.distributed.conftest import RUN_TIMEOUT, SAVE_STEPS, WORLD_SIZE, toy_args
from tests.distributed.ranks import RankedRun
from trainer_runtime.checkpoint.layout import RUNTIME_STATE_NAME, CheckpointStore
from trainer_runtime.protocol import EXIT_PREEMPTED

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(600)]

FULL = json.dumps({"state_dict_type": "FULL_STATE_DICT"})


def test_a_save_due_after_sigterm_is_sharded_not_gathered(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = [*toy_args(step_sleep=0.5), "--fsdp", "full_shard", "--fsdp-config", FULL]
    with RankedRun(out, tmp_path, world_size=WORLD_SIZE, args=args) as run:
        # the SIGTERM lands in the forward pass of a save step, on one rank
        run.ranks[1].wait_for_event("step_begin", step=SAVE_STEPS, timeout=RUN_TIMEOUT)
        run.send(1, signal.SIGTERM)
        codes = run.wait(RUN_TIMEOUT)
    assert codes == [EXIT_PREEMPTED] * WORLD_SIZE, f"exit codes {codes}\n{run.tails()}"
    msg = run.ranks[0].termination_message()
    assert msg.reason == "preempted" and msg.complete and msg.step == SAVE_STEPS, msg
    store = CheckpointStore(str(out))
    steps = [c.step for c in store.list()]
    assert steps == [SAVE_STEPS], f"one checkpoint, of the due step: {steps}"
    info = store.inspect(f"checkpoint-{SAVE_STEPS}")
    assert info.complete and info.manifest is not None, info
    listed = {f["path"] for f in info.manifest["files"]}
    assert "model.safetensors" not in listed, "the due save gathered the full model"
    assert info.manifest["sharding"]["format"] == "fsdp-shards/1", info.manifest
    record = json.loads((Path(info.path) / RUNTIME_STATE_NAME).read_text())
    assert record["save_kind"] == "jit", record.get("save_kind")
    saves = [e for e in run.ranks[0].events() if e["event"] == "save"]
    assert [e["step"] for e in saves] == [SAVE_STEPS], saves
