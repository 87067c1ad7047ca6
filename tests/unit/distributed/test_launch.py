"""torchrun options from the grace period and the PET_* topology, and how a pod of several
workers ends as one unit (one exit code, one termination message)."""

from __future__ import annotations

import pytest

from trainer_runtime.distributed.launch import (
    AGENT_MODULE,
    WORKER_MODULE,
    WorkerEnd,
    launcher_end_seconds,
    plan_launch,
    pod_end,
    shutdown_timeout_seconds,
    torchrun_options,
)
from trainer_runtime.errors import ConfigurationError
from trainer_runtime.protocol import EXIT_PEER_FAILED, EXIT_PREEMPTED, TerminationMessage


@pytest.mark.parametrize(
    ("grace", "expected"),
    [
        (None, None),  # torchrun's own default
        # the grace less the launcher's margin (a tenth, 2 to 5 s), whole seconds: the pod's
        # termination message is written before the kubelet's SIGKILL
        (30, 27),
        (243, 238),
        (243.2, 238),
        (10, 8),
        (0.5, 1),  # never 0 (torchrun would SIGKILL at once)
        (3, 1),
    ],
)
def test_shutdown_timeout_leaves_the_launcher_a_margin(grace: float | None, expected: int) -> None:
    assert shutdown_timeout_seconds(grace) == expected


@pytest.mark.parametrize(
    ("grace", "end"),
    [(30, 28.5), (243, 240.5), (10, 9.0)],
)
def test_the_launcher_ends_the_pod_before_the_grace(grace: float, end: float) -> None:
    # after torchrun's SIGKILL of its workers, before the kubelet's of the pod
    assert shutdown_timeout_seconds(grace) < launcher_end_seconds(grace) == end < grace


@pytest.mark.parametrize("grace", [0, -1, float("nan"), float("inf")])
def test_invalid_grace_is_refused(grace: float) -> None:
    with pytest.raises(ConfigurationError, match="PREEMPTIBLE_GRACE_SECONDS"):
        shutdown_timeout_seconds(grace)


def test_single_node_is_standalone_with_the_grace_timeout() -> None:
    opts = torchrun_options(grace_seconds=243, nproc_per_node=4)
    assert opts == [
        "--nproc-per-node=4",
        "--standalone",
        "--max-restarts=0",
        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "--shutdown-timeout=238",
    ]


def test_multi_node_uses_static_rendezvous() -> None:
    opts = torchrun_options(
        grace_seconds=None, nnodes=3, node_rank=2, master_addr="j-a1-0.svc", master_port=29500
    )
    assert "--nnodes=3" in opts and "--node-rank=2" in opts and "--rdzv-backend=static" in opts
    assert "--master-addr=j-a1-0.svc" in opts and "--master-port=29500" in opts
    assert not any(o.startswith("--shutdown-timeout") for o in opts)


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"nnodes": 0}, "nnodes=0"),
        ({"nnodes": 2, "node_rank": 2, "master_addr": "a", "master_port": 1}, "node_rank=2"),
        ({"nnodes": 2}, "MASTER_ADDR"),
    ],
)
def test_bad_topology_is_refused(kw: dict, needle: str) -> None:
    with pytest.raises(ConfigurationError, match=needle):
        torchrun_options(grace_seconds=10, **kw)


def test_plan_reads_the_operator_environment() -> None:
    env = {
        "PREEMPTIBLE_GRACE_SECONDS": "90",
        "WORLD_SIZE": "2",
        "NODE_RANK": "1",
        "MASTER_ADDR": "job-a3-0.job.ns.svc",
        "MASTER_PORT": "29400",
    }
    plan = plan_launch(["--", "-m", "pkg.train", "--x", "1"], env, nproc_per_node=8, python="py")
    assert plan.command[:3] == ["py", "-m", AGENT_MODULE]
    assert plan.command[-6:] == ["-m", WORKER_MODULE, "-m", "pkg.train", "--x", "1"]
    assert "--nnodes=2" in plan.command and "--node-rank=1" in plan.command
    assert "--shutdown-timeout=85" in plan.command
    assert plan.env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "85"
    assert plan.shutdown_timeout == 85 and not plan.notes


def test_plan_without_grace_warns_about_torchruns_default() -> None:
    plan = plan_launch(["train.py"], {}, python="py")
    assert "--standalone" in plan.command and plan.shutdown_timeout is None
    assert plan.notes and "30 s" in plan.notes[0]


@pytest.mark.parametrize(
    ("cmd", "env"),
    [([], {}), (["--"], {}), (["-m"], {}), (["t.py"], {"PREEMPTIBLE_GRACE_SECONDS": "x"})],
)
def test_plan_refuses_bad_input(cmd: list[str], env: dict[str, str]) -> None:
    with pytest.raises(ConfigurationError):
        plan_launch(cmd, env, python="py")


@pytest.mark.parametrize(
    "cmd",
    [["--", "python", "train.py", "--lr", "1"], ["train.py", "--lr", "1"]],
)
def test_plan_transformers_runs_the_script_through_the_hf_hook(cmd: list[str]) -> None:
    plan = plan_launch(cmd, {}, python="py", transformers=True)
    assert plan.command[-6:] == ["-m", WORKER_MODULE, "--transformers", "train.py", "--lr", "1"]


def test_plan_transformers_with_a_module() -> None:
    plan = plan_launch(["-m", "pkg.train"], {}, python="py", transformers=True)
    assert plan.command[-5:] == ["-m", WORKER_MODULE, "--transformers", "-m", "pkg.train"]
    plain = plan_launch(["-m", "pkg.train"], {}, python="py")
    assert "--transformers" not in plain.command


def test_launch_cli_accepts_transformers_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from trainer_runtime import cli

    assert cli.main(["launch", "--dry-run", "--transformers", "--", "python", "train.py"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.endswith(f"-m {WORKER_MODULE} --transformers train.py")


@pytest.mark.parametrize(
    ("first", "kept"),
    [("python", False), ("python3", False), ("/usr/bin/python3.11", False), ("python-x.py", True)],
)
def test_plan_drops_only_a_leading_interpreter(first: str, kept: bool) -> None:
    plan = plan_launch([first, "train.py"], {}, python="py")
    assert (first in plan.command) is kept
    assert plan.command[-1] == "train.py"


# ------------------------------------------------------------------------------ topology (PET_*)

PET = {
    "PET_NNODES": "2",
    "PET_NPROC_PER_NODE": "4",
    "PET_NODE_RANK": "1",
    "PET_MASTER_ADDR": "job-a1-0.job.ns.svc",
    "PET_MASTER_PORT": "29400",
}


@pytest.mark.parametrize(
    ("env", "kw", "expected"),
    [
        # What the operator renders for numProcPerNode: torchrun's own PET_* win over the rest
        # (WORLD_SIZE is then nodes x processes, not the node count).
        (
            {**PET, "WORLD_SIZE": "8", "NODE_RANK": "1", "MASTER_ADDR": "x", "MASTER_PORT": "1"},
            {},
            ["--nproc-per-node=4", "--nnodes=2", "--node-rank=1",
             "--master-addr=job-a1-0.job.ns.svc", "--master-port=29400"],
        ),
        # One process per pod (numProcPerNode unset) with the launcher in the command.
        (
            {"WORLD_SIZE": "3", "NODE_RANK": "2", "MASTER_ADDR": "m", "MASTER_PORT": "7"},
            {"nproc_per_node": 2},
            ["--nproc-per-node=2", "--nnodes=3", "--node-rank=2", "--master-addr=m",
             "--master-port=7"],
        ),
        # Options win over the environment.
        (PET, {"nproc_per_node": "gpu", "nnodes": 1, "node_rank": 0}, ["--nproc-per-node=gpu",
                                                                        "--standalone"]),
        # One pod of several processes: no rendezvous address, standalone.
        ({"PET_NNODES": "1", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "0", "WORLD_SIZE": "2"},
         {}, ["--nproc-per-node=2", "--standalone"]),
        ({"PREEMPTIBLE_NPROC_PER_NODE": "3"}, {}, ["--nproc-per-node=3", "--standalone"]),
        ({}, {}, ["--nproc-per-node=1", "--standalone"]),
    ],
)  # fmt: skip
def test_plan_topology(env: dict[str, str], kw: dict, expected: list[str]) -> None:
    plan = plan_launch(["train.py"], env, python="py", **kw)
    for option in expected:
        assert option in plan.command, (option, plan.command)
    # Static rendezvous between pods, or one standalone pod: never both.
    assert ("--standalone" in plan.command) != any(o.startswith("--nnodes") for o in plan.command)


@pytest.mark.parametrize(
    ("cmd", "tail"),
    [
        (["python", "train.py", "--a"], ["-m", WORKER_MODULE, "train.py", "--a"]),
        (["-m", "pkg.train"], ["-m", WORKER_MODULE, "-m", "pkg.train"]),
        (["python3", "-m", "pkg"], ["-m", WORKER_MODULE, "-m", "pkg"]),
        # Anything else is an executable every worker runs as it is (torchrun --no-python).
        (["bash", "-c", "python train.py"], ["--no-python", "bash", "-c", "python train.py"]),
        (["/opt/bin/train", "--a"], ["--no-python", "/opt/bin/train", "--a"]),
    ],
)
def test_plan_runs_python_through_the_worker_runner(cmd: list[str], tail: list[str]) -> None:
    plan = plan_launch(cmd, {}, python="py")
    assert plan.command[-len(tail) :] == tail
    assert plan.command[:3] == ["py", "-m", AGENT_MODULE]


def test_plan_transformers_needs_python() -> None:
    with pytest.raises(ConfigurationError, match="--transformers runs a Python script"):
        plan_launch(["bash", "run.sh"], {}, python="py", transformers=True)


def test_plan_knows_the_number_of_workers_when_it_is_a_number() -> None:
    assert plan_launch(["t.py"], PET, python="py").nproc_per_node == 4
    assert plan_launch(["t.py"], {}, python="py", nproc_per_node="gpu").nproc_per_node is None


# ------------------------------------------------------------------------------- the pod's end


def _m(reason: str = "preempted", step: int = 12, **extra: object) -> TerminationMessage:
    defaults: dict[str, object] = {}
    if reason == "preempted":
        defaults = {"checkpoint": f"/c/checkpoint-{step}", "complete": True}
    return TerminationMessage(reason=reason, step=step, **{**defaults, **extra})  # type: ignore[arg-type]


def _w(local: int, code: int | None, msg: TerminationMessage | None = None) -> WorkerEnd:
    return WorkerEnd(local_rank=local, rank=2 + local, exit_code=code, message=msg)


PREEMPTED = [_w(0, 75, _m()), _w(1, 75, _m())]
PEER = _m("failed", peer_gone=True, failed_rank=0, message="rank 2 stopped: rank 0 is gone")


@pytest.mark.parametrize(
    ("workers", "kw", "code", "reason", "named"),
    [
        ([_w(0, 0, _m("completed")), _w(1, 0)], {}, 0, "completed", None),
        # Every local rank committed its part of the same JIT checkpoint: 75, whatever torchrun
        # itself exited with (1 after its workers exit 75, 143 when signalled).
        (PREEMPTED, {"agent_code": 1}, EXIT_PREEMPTED, "preempted", None),
        (PREEMPTED, {"agent_code": 143, "signalled": True, "ordered": False}, 75, "preempted",
         None),
        ([_w(0, 75, _m(stop="micro_batch")), _w(1, 75, _m(stop="micro_batch"))], {}, 75,
         "preempted", None),
        # ... not when one of them is missing, stopped elsewhere, or wrote an incomplete one.
        ([_w(0, 75, _m())], {"expected_workers": 2, "signalled": True}, 143, "preempted", None),
        ([_w(0, 75, _m()), _w(1, 75, _m(step=13, checkpoint="/c/checkpoint-13"))],
         {"signalled": True}, 143, "preempted", None),
        ([_w(0, 75, _m()), _w(1, 75, _m(complete=False))], {"signalled": True}, 143,
         "preempted", None),
        # The deadline too short for a save, on every worker: 75 with that reason.
        ([_w(0, 75, _m("deadline_too_short", checkpoint=None)),
          _w(1, 75, _m("deadline_too_short", checkpoint=None))], {}, 75, "deadline_too_short",
         None),
        # A local worker's own failure, first by time: its code and its ranks; the others
        # (SIGTERMed by torchrun: stopped, peer gone, or a lost connection) come after it.
        ([_w(1, 1, _m("failed", message="RuntimeError: boom")), _w(0, EXIT_PEER_FAILED, PEER)],
         {"agent_code": 1}, 1, "failed", (1, 3, "RuntimeError: boom")),
        ([_w(1, 139), _w(0, 143)], {"agent_code": 1}, 139, "failed", (1, 3, "exited 139")),
        # It raised (its own message) and torchrun's SIGTERM ended its winding down: exit 1.
        ([_w(0, EXIT_PEER_FAILED, PEER), _w(1, 143, _m("failed", message="RuntimeError: x"))],
         {"agent_code": 1}, 1, "failed", (1, 3, "then stopped by signal 15")),
        # A worker SIGKILLed with nobody asking (the OOM killer of one process): a failure.
        ([_w(1, 137), _w(0, 75, _m())], {"agent_code": 1}, 137, "failed", (1, 3, "exited 137")),
        # Without times (torchrun signalled), a failure that is a lost connection is not the cause.
        ([_w(0, 1, _m("failed", message="RuntimeError: Connection closed by peer")),
          _w(1, 1, _m("failed", message="ValueError: nan loss"))],
         {"ordered": False, "signalled": True}, 1, "failed", (1, 3, "nan loss")),
        # A worker that wrote nothing and whose code torchrun did not tell: exit 1, named.
        ([_w(0, None), _w(1, 75, _m())], {"agent_code": 1}, 1, "failed",
         (0, 2, "exit code unknown")),
        # Only peers gone (another pod's rank failed): 69 naming the rank that is gone.
        ([_w(0, EXIT_PEER_FAILED, PEER), _w(1, 143)], {"agent_code": 1}, EXIT_PEER_FAILED,
         "failed", (0, 2, "rank 0 is gone")),
        ([_w(0, EXIT_PEER_FAILED), _w(1, EXIT_PEER_FAILED)], {"agent_code": 1}, 69, "failed",
         (0, 2, "another rank is gone")),
        # SIGKILLed after the pod's SIGTERM (torchrun's shutdown timeout = the grace): 137.
        ([_w(0, 137), _w(1, 137)], {"signalled": True, "ordered": False}, 137, "preempted",
         None),
        # A script without a SIGTERM handler, stopped by the pod's SIGTERM: 143.
        ([_w(0, 143), _w(1, 143)], {"signalled": True, "ordered": False}, 143, "preempted",
         None),
        # torchrun failed before any worker (rendezvous, a bad option).
        ([], {"agent_code": 1, "agent_error": "RendezvousTimeoutError: x"}, 1, "failed", None),
    ],
)  # fmt: skip
def test_pod_end(
    workers: list[WorkerEnd],
    kw: dict,
    code: int,
    reason: str,
    named: tuple[int, int, str] | None,
) -> None:
    got, msg = pod_end(workers, **kw)
    assert (got, msg.reason) == (code, reason), msg
    assert msg.exit_codes == ([w.exit_code for w in sorted(workers, key=lambda w: w.local_rank)]
                              or None)  # fmt: skip
    if named is not None:
        local, rank, words = named
        assert (msg.local_rank, msg.rank) == (local, rank), msg
        assert words in (msg.message or ""), msg
    if code == EXIT_PEER_FAILED:
        assert msg.peer_gone


def test_pod_end_merges_the_workers_messages() -> None:
    slow = _m(step_seconds={"last": 1.0, "max": 2.5}, save_seconds={"last": 0.5, "max": 3.0})
    fast = _m(step_seconds={"last": 0.9, "max": 1.0}, save_seconds={"last": 0.4, "max": 0.4})
    fast = fast.model_copy(update={"sigterm_to_exit_seconds": 1.2, "attempt": 7})
    code, msg = pod_end([_w(1, 75, slow), _w(0, 75, fast)], sigterm_to_exit=4.25, signalled=True)
    assert code == EXIT_PREEMPTED
    # The launcher's own measure (to the last worker's end) wins over the workers' own.
    assert msg.sigterm_to_exit_seconds == 4.25 and msg.attempt == 7
    # The main worker's timings, with the slowest worker's maxima (the grace rule's inputs).
    assert (msg.step_seconds.last, msg.step_seconds.max) == (0.9, 2.5)
    assert (msg.save_seconds.last, msg.save_seconds.max) == (0.4, 3.0)
    assert (msg.checkpoint, msg.complete, msg.step) == ("/c/checkpoint-12", True, 12)
    assert len(msg.model_dump_json(exclude_none=True)) < 4096
    # Without a signal to this pod (another pod's SIGTERM, agreed at a step boundary): the
    # workers' own measures are all there is.
    _, quiet = pod_end([_w(0, 75, fast), _w(1, 75, _m())])
    assert quiet.sigterm_to_exit_seconds == 1.2


@pytest.mark.parametrize("signalled", [True, False])
def test_pod_end_says_which_checkpoint_the_workers_loaded(signalled: bool) -> None:
    # Every worker loaded checkpoint-4 (they agreed to fall back from a corrupt checkpoint-6):
    # the pod's message says so, whichever worker's message is the base.
    loaded = {"resumed_from": "/c/checkpoint-4", "resumed_from_step": 4}
    _, msg = pod_end([_w(0, 75, _m()), _w(1, 75, _m(**loaded))], signalled=signalled)
    assert (msg.resumed_from, msg.resumed_from_step) == ("/c/checkpoint-4", 4)
    _, fresh = pod_end([_w(0, 75, _m()), _w(1, 75, _m())], signalled=signalled)
    assert fresh.resumed_from is None and fresh.resumed_from_step is None


def test_pod_end_failure_keeps_the_newest_complete_checkpoint() -> None:
    periodic = _m("failed", step=9, checkpoint="/c/checkpoint-8", complete=True, message="boom")
    code, msg = pod_end([_w(0, 1, periodic), _w(1, 143)], agent_code=1)
    assert (code, msg.checkpoint, msg.complete, msg.step) == (1, "/c/checkpoint-8", True, 9)
