"""The preemptible-operator command: argument handling, JSON logs, crd/rbac subcommands."""

from __future__ import annotations

import json
import logging

import pytest
import yaml

from preemptible_operator import cli, rbac


def test_run_arguments() -> None:
    args = cli.build_parser().parse_args(
        [
            "run",
            "-n",
            "a",
            "-n",
            "b",
            "--kubeconfig",
            "/k",
            "--checkpoint-path-map",
            "/c=/d",
            "--poll-interval",
            "2",
        ]
    )
    assert (args.namespace, args.kubeconfig, args.checkpoint_path_map, args.poll_interval) == (
        ["a", "b"],
        "/k",
        ["/c=/d"],
        2.0,
    )
    assert args.peering is None and args.liveness.endswith("/healthz")
    assert args.max_grace_seconds is None and not args.no_kueue
    capped = cli.build_parser().parse_args(["run", "--max-grace-seconds", "600", "--no-kueue"])
    assert (capped.max_grace_seconds, capped.no_kueue) == (600, True)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["run", "--kubeconfig", "/nonexistent/kubeconfig"], "no such file"),
        (["run", "--checkpoint-path-map", "nomapping"], "POD_PREFIX=OPERATOR_PREFIX"),
        (["run", "--checkpoint-storage-options", "[1]"], "JSON object"),
        (["run", "--max-scrapes-per-second", "-1"], "--max-scrapes-per-second -1.0: must be >= 0"),
        (["run", "--max-progress-writes-per-second", "-2"], "must be >= 0 (0: no budget)"),
    ],
)
def test_run_rejects_bad_flags_before_starting(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 2
    assert words in capsys.readouterr().err


def test_json_log_lines_carry_extra_fields() -> None:
    record = logging.LogRecord(
        "preemptible_operator", logging.INFO, "f", 1, "reconcile %s", ("ns/x",), None
    )
    record.tj, record.phase = "ns/x", "Running"
    data = json.loads(cli.JsonFormatter().format(record))
    assert data["message"] == "reconcile ns/x"
    assert (data["tj"], data["phase"], data["level"]) == ("ns/x", "Running", "INFO")


def test_crd_check_and_rbac_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["crd", "--check"]) == 0
    capsys.readouterr()
    assert cli.main(["rbac"]) == 0
    role = yaml.safe_load(capsys.readouterr().out)
    assert role["kind"] == "ClusterRole"
    assert role["rules"] == [*rbac.NAMESPACED_RULES, *rbac.CLUSTER_RULES]


def test_the_operator_never_imports_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, preemptible_operator.handlers, preemptible_operator.cli;"
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
