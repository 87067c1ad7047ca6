"""torchrun options from the grace period, and the launcher's exit-code mapping."""

from __future__ import annotations

import pytest

from trainer_runtime.distributed.launch import (
    launch_exit_code,
    plan_launch,
    shutdown_timeout_seconds,
    torchrun_options,
)
from trainer_runtime.errors import ConfigurationError
from trainer_runtime.protocol import EXIT_PEER_FAILED, EXIT_PREEMPTED, TerminationMessage


@pytest.mark.parametrize(
    ("grace", "expected"), [(None, None), (30, 30), (243, 243), (243.2, 244), (0.5, 1)]
)
def test_shutdown_timeout_is_the_grace_rounded_up(grace: float | None, expected: int) -> None:
    assert shutdown_timeout_seconds(grace) == expected


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
        "--shutdown-timeout=243",
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
    assert plan.command[:3] == ["py", "-m", "torch.distributed.run"]
    assert plan.command[-4:] == ["-m", "pkg.train", "--x", "1"]
    assert "--nnodes=2" in plan.command and "--node-rank=1" in plan.command
    assert "--shutdown-timeout=90" in plan.command
    assert plan.env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "90"
    assert plan.shutdown_timeout == 90 and not plan.notes


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


def _msg(reason: str, **extra: object) -> str:
    msg = TerminationMessage(reason=reason, step=3, complete=reason == "preempted", **extra)  # type: ignore[arg-type]
    return msg.model_dump_json()


@pytest.mark.parametrize(
    ("rc", "text", "expected"),
    [
        (0, None, 0),
        (0, _msg("preempted"), 0),
        (1, _msg("preempted"), EXIT_PREEMPTED),
        (1, _msg("failed"), 1),
        (1, _msg("failed", peer_gone=True, failed_rank=5), EXIT_PEER_FAILED),
        (1, _msg("failed", peer_gone=True), EXIT_PEER_FAILED),
        (1, None, 1),
        (1, "Traceback ...", 1),
        (-9, None, 137),
        (-15, _msg("preempted"), EXIT_PREEMPTED),
    ],
)
def test_exit_code_mapping(rc: int, text: str | None, expected: int) -> None:
    assert launch_exit_code(rc, text) == expected


@pytest.mark.parametrize(
    "cmd",
    [["--", "python", "train.py", "--lr", "1"], ["train.py", "--lr", "1"]],
)
def test_plan_transformers_runs_the_script_through_the_hf_runner(cmd: list[str]) -> None:
    plan = plan_launch(cmd, {}, python="py", transformers=True)
    assert plan.command[-5:] == ["-m", "trainer_runtime.hf.run", "train.py", "--lr", "1"]


def test_plan_transformers_with_a_module() -> None:
    plan = plan_launch(["-m", "pkg.train"], {}, python="py", transformers=True)
    assert plan.command[-4:] == ["-m", "trainer_runtime.hf.run", "-m", "pkg.train"]
    plain = plan_launch(["-m", "pkg.train"], {}, python="py")
    assert "trainer_runtime.hf.run" not in plain.command


def test_launch_cli_accepts_transformers_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from trainer_runtime import cli

    assert cli.main(["launch", "--dry-run", "--transformers", "--", "python", "train.py"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.endswith("-m trainer_runtime.hf.run train.py")


@pytest.mark.parametrize(
    ("first", "kept"),
    [("python", False), ("python3", False), ("/usr/bin/python3.11", False), ("python-x.py", True)],
)
def test_plan_drops_only_a_leading_interpreter(first: str, kept: bool) -> None:
    plan = plan_launch([first, "train.py"], {}, python="py")
    assert (first in plan.command) is kept
    assert plan.command[-1] == "train.py"
