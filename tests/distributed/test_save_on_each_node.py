"""save_on_each_node across two "nodes" without shared storage.

Each node is one ``trainer-runtime launch`` (a torchrun agent, static rendezvous on localhost, as
the operator's pods run it) started in its own working directory with the relative output dir
``out``: the two nodes write to different directories, as nodes with their own disks would.

- 2 nodes x 1 process: SIGTERM to node 1's worker -> every rank stops at the same step, both
  launchers exit 75, both nodes hold a complete copy of that step; resuming from the two
  directories ends bit-identical (torch.equal) to the uninterrupted 2-rank run of the shared
  ``reference`` fixture (one copy on shared storage: the same training). The same copies with
  node 1's copy of the stop step left incomplete (sentinel, no manifest): both nodes resume from
  the newest step complete on both, node 0's newer copy is set aside, and the end is still
  bit-identical.
- 2 nodes x 2 processes: SIGTERM to a worker that is not its node's writer (local rank 1 of
  node 1) -> both copies hold all four ranks' RNG states (gathered to each node's writer), and
  the run resumes from them at the next step on every rank; the two nodes end with identical
  weights. (Four gloo ranks are not compared with an uninterrupted run bit for bit: see
  docs/distributed.md, "save_on_each_node".)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed.conftest import MAX_STEPS, SAVE_STEPS, Reference, toy_args
from tests.distributed.ranks import RankedRun, free_port
from trainer_runtime.checkpoint.layout import SENTINEL_NAME, CheckpointStore
from trainer_runtime.protocol import (
    ENV_ATTEMPT,
    ENV_GRACE_SECONDS,
    ENV_KILL_WAIT_SECONDS,
    ENV_OUTPUT_DIR,
    ENV_RESUME_FROM,
    ENV_TERMINATION_LOG,
    EXIT_PREEMPTED,
)
from trainer_runtime.testing import read_events, read_termination_message, weights_identical

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(900)]

NODES = 2
TIMEOUT = 300.0
TOY = [*toy_args(), "--save-on-each-node"]
LIMIT = ("--save-total-limit", "2")


class Nodes:
    """The two node launchers of one attempt, each in its own directory under ``root``."""

    def __init__(
        self,
        root: Path,
        *,
        per_node: int,
        attempt: int,
        resume: bool = False,
        step_sleep: float = 0.0,
        extra: tuple[str, ...] = (),
    ) -> None:
        self.per_node = per_node
        self.dirs = [root / f"node{n}" for n in range(NODES)]
        port = free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        toy = ["-m", "trainer_runtime.toy", *TOY, *extra]
        if step_sleep:
            toy += ["--step-sleep", str(step_sleep)]
        for node, work in enumerate(self.dirs):
            work.mkdir(parents=True, exist_ok=True)
            env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTIBLE_")}
            env.update(
                {
                    ENV_OUTPUT_DIR: "out",  # relative: each node's own directory
                    ENV_ATTEMPT: str(attempt),
                    ENV_RESUME_FROM: "latest" if resume else "",
                    ENV_GRACE_SECONDS: "120",
                    ENV_KILL_WAIT_SECONDS: "0.2",
                    ENV_TERMINATION_LOG: str(work / f"term-a{attempt}.json"),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "WORLD_SIZE": str(NODES),
                    "NODE_RANK": str(node),
                    "OMP_NUM_THREADS": "1",
                    "PYTHONUNBUFFERED": "1",
                }
            )
            events = work / f"events-a{attempt}.jsonl"
            cmd = [sys.executable, "-P", "-m", "trainer_runtime.cli", "launch"]
            cmd += ["--nproc-per-node", str(per_node), "--", *toy, "--events-file", str(events)]
            with open(work / f"launcher-a{attempt}.log", "wb") as log:
                proc = subprocess.Popen(
                    cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT
                )
            self.procs.append(proc)
        self.attempt = attempt

    def out(self, node: int) -> Path:
        return self.dirs[node] / "out"

    def events(self, node: int) -> list[dict]:
        return read_events(self.dirs[node] / f"events-a{self.attempt}.jsonl")

    def wait(self) -> list[int]:
        try:
            return [p.wait(timeout=TIMEOUT) for p in self.procs]
        finally:
            self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def logs(self) -> str:
        parts = []
        for work in self.dirs:
            text = (work / f"launcher-a{self.attempt}.log").read_text(errors="replace")
            parts.append(f"--- {work.name}\n{text[-3000:]}")
        return "\n".join(parts)


def _local_rank(pid: int) -> int | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    env = dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    value = env.get(b"LOCAL_RANK")
    return int(value) if value is not None else None


def _final_copies_match(nodes: Nodes, reference: Path) -> None:
    for node in range(NODES):
        final = nodes.out(node) / f"checkpoint-{MAX_STEPS}"
        same, detail = weights_identical(final, reference)
        assert same, f"node {node}'s final weights differ from {reference}: {detail}"


def _first_steps(nodes: Nodes) -> set[int]:
    firsts = set()
    for node in range(NODES):
        by_pid: dict[int, list[int]] = {}
        for e in nodes.events(node):
            if e["event"] == "step_begin":
                by_pid.setdefault(e["pid"], []).append(e["step"])
        assert len(by_pid) == nodes.per_node, f"node {node}: step events from {sorted(by_pid)}"
        firsts |= {steps[0] for steps in by_pid.values()}
    return firsts


def _interrupt(
    root: Path, *, per_node: int, local_rank: int, extra: tuple[str, ...] = ()
) -> tuple[Nodes, int]:
    """Start both nodes with slow steps; SIGTERM the worker of node 1 with ``local_rank`` once it
    began step 5. Returns the finished run and the step every rank stopped at."""
    run = Nodes(root, per_node=per_node, attempt=1, step_sleep=0.3, extra=extra)
    try:
        deadline = time.monotonic() + TIMEOUT
        target = None
        while target is None:
            assert all(p.poll() is None for p in run.procs), f"a node exited early\n{run.logs()}"
            assert time.monotonic() < deadline, f"no step 5 on node 1 in time\n{run.logs()}"
            begun = [e for e in run.events(1) if e["event"] == "step_begin" and e["step"] >= 5]
            pids = {e["pid"] for e in begun}
            target = next((pid for pid in pids if _local_rank(pid) == local_rank), None)
            time.sleep(0.05)
        os.kill(target, signal.SIGTERM)  # one worker only; its launcher is not signalled
    except BaseException:
        run.kill()
        raise
    codes = run.wait()
    assert codes == [EXIT_PREEMPTED] * NODES, f"launcher exit codes {codes}\n{run.logs()}"

    steps = set()
    for node in range(NODES):
        msg = read_termination_message((run.dirs[node] / "term-a1.json").read_text())
        assert msg is not None and msg.reason == "preempted" and msg.complete, msg
        steps.add(msg.step)
        ended: dict[int, int] = {}
        for e in run.events(node):
            if e["event"] == "step_end":
                ended[e["pid"]] = e["step"]
        assert set(ended.values()) == {msg.step}, f"node {node}: last steps {ended}"
    (stop,) = steps
    assert 5 <= stop < MAX_STEPS

    # Both nodes hold a complete, self-contained copy of the stop step.
    world = NODES * per_node
    for node in range(NODES):
        info = CheckpointStore(str(run.out(node))).inspect(f"checkpoint-{stop}")
        assert info.complete, f"node {node}: {info.reason}"
        assert info.manifest is not None and info.manifest["world_size"] == world
        assert info.manifest["node_copy"] == {
            "node": str(node),
            "nodes": ["0", "1"],
            "writer_rank": node * per_node,
        }
        listed = {f["path"] for f in info.manifest["files"]}
        assert {f"rng_state_{r}.safetensors" for r in range(world)} <= listed, listed
        assert {"model.safetensors", "optimizer.safetensors", "trainer_state.json"} <= listed
    same, detail = weights_identical(
        run.out(0) / f"checkpoint-{stop}", run.out(1) / f"checkpoint-{stop}"
    )
    assert same, detail
    return run, stop


def test_sigterm_to_one_node_then_resume_from_each_nodes_copy(
    tmp_path: Path, reference: Reference
) -> None:
    run, stop = _interrupt(tmp_path / "run", per_node=1, local_rank=0, extra=LIMIT)
    # save_total_limit applies on every node: each keeps its two newest complete copies.
    kept = sorted({*range(SAVE_STEPS, stop + 1, SAVE_STEPS), stop})[-2:]
    for node in range(NODES):
        steps = [i.step for i in CheckpointStore(str(run.out(node))).list()]
        assert steps == kept, f"node {node} holds {steps}, expected {kept}"

    # What `trainer-runtime inspect` says of a node's copy.
    shown = subprocess.run(
        [sys.executable, "-P", "-m", "trainer_runtime.cli", "inspect", "--json", "out"],
        cwd=run.dirs[1],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    doc = json.loads(shown.stdout)
    row = next(c for c in doc["checkpoints"] if c["step"] == stop)
    assert row["complete"] and row["node_copy"]["node"] == "1", row

    # A second pair of node directories, to damage below.
    damaged = tmp_path / "damaged"
    for node in range(NODES):
        shutil.copytree(run.out(node), damaged / f"node{node}" / "out")

    resumed = Nodes(tmp_path / "run", per_node=1, attempt=2, resume=True, extra=LIMIT)
    codes = resumed.wait()
    assert codes == [0] * NODES, f"resumed run exited {codes}\n{resumed.logs()}"
    assert _first_steps(resumed) == {stop + 1}, resumed.logs()
    _final_copies_match(resumed, reference.final_checkpoint)

    # Node 1's copy of the stop step is incomplete (as if killed between the nodes' commits).
    lost = damaged / "node1" / "out" / f"checkpoint-{stop}"
    (lost / "manifest.json").unlink()
    (lost / SENTINEL_NAME).write_text("{}")
    common = max(
        i.step for i in CheckpointStore(str(damaged / "node1" / "out")).list() if i.complete
    )
    assert common < stop
    after = Nodes(damaged, per_node=1, attempt=2, resume=True, extra=LIMIT)
    codes = after.wait()
    assert codes == [0] * NODES, f"resume with an incomplete copy exited {codes}\n{after.logs()}"
    assert _first_steps(after) == {common + 1}, after.logs()
    assert "is not complete on every node" in after.logs()
    _final_copies_match(after, reference.final_checkpoint)
    # node 0's newer copy was set aside (made incomplete) before anyone loaded; rotation then
    # removed it (or the new run wrote that step again): both nodes end with the same two steps.
    assert "set aside" in after.logs(), after.logs()
    for node in range(NODES):
        infos = CheckpointStore(str(after.out(node))).list()
        assert [i.step for i in infos] == [MAX_STEPS - SAVE_STEPS, MAX_STEPS], infos
        assert all(i.complete for i in infos) and infos[-1].attempt == 2, infos


def test_two_processes_per_node_gather_every_ranks_records(tmp_path: Path) -> None:
    _, stop = _interrupt(tmp_path, per_node=2, local_rank=1)
    resumed = Nodes(tmp_path, per_node=2, attempt=2, resume=True)
    codes = resumed.wait()
    assert codes == [0] * NODES, f"resumed run exited {codes}\n{resumed.logs()}"
    assert _first_steps(resumed) == {stop + 1}, resumed.logs()
    assert "RNG state not restored" not in resumed.logs()
    same, detail = weights_identical(
        resumed.out(0) / f"checkpoint-{MAX_STEPS}", resumed.out(1) / f"checkpoint-{MAX_STEPS}"
    )
    assert same, f"the two nodes' final copies differ: {detail}"


def test_nodes_sharing_storage_are_refused_before_training(tmp_path: Path) -> None:
    # One process per "pod" (the operator's layout): both are their node's main process and
    # both write to the same output dir, which save_on_each_node must not be used with.
    out = tmp_path / "shared"
    with RankedRun(out, tmp_path, world_size=NODES, args=TOY) as run:
        codes = run.wait(TIMEOUT)
    assert all(c not in (0, EXIT_PREEMPTED) for c in codes), f"exit codes {codes}\n{run.tails()}"
    for rank in range(NODES):
        msg = run.ranks[rank].termination_message()
        assert msg.reason == "failed" and msg.message, msg
        assert "save_on_each_node=True" in msg.message and "share" in msg.message, msg.message
        assert not run.steps_begun(rank), "a step ran before the shared storage was refused"
    assert CheckpointStore(str(out)).names() == []
