"""The runtime stand-ins of the operator benchmarks (benchmarks/stub_runtime.py and its C twin
stub_runtime.c) keep the operator contract alike: the runtime's /metrics series with an advancing
step, a stop on SIGTERM or on the control file, the termination message and exit 75."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import ModuleType

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.unit.benchmark_modules import BENCHMARKS, load_benchmark
from trainer_runtime.protocol import METRIC_NAMES

STUB = BENCHMARKS / "stub_runtime.py"


def _module() -> ModuleType:
    return load_benchmark("stub_runtime.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _command(kind: str, tmp_path: Path) -> list[str]:
    if kind == "python":
        return [sys.executable, "-P", str(STUB)]
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    return [str(_module().build_c_stub(tmp_path / "cache"))]


def _scrape(port: int, deadline: float) -> dict[str, float]:
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                text = r.read().decode()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    return {
        s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
    }  # fmt: skip


@pytest.mark.parametrize("kind", ["python", "c"])
@pytest.mark.parametrize("stop", ["control-file", "sigterm"])
def test_a_stub_serves_the_runtime_series_and_stops_like_the_runtime(
    kind: str, stop: str, tmp_path: Path
) -> None:
    port, control = _free_port(), tmp_path / "control"
    control.mkdir()
    env = {
        **os.environ,
        "STUB_METRICS_TEMPLATE": _module().metrics_template(METRIC_NAMES),
        "STUB_CONTROL_DIR": str(control),
        "STUB_STEP_SECONDS": "1",
        "HOSTNAME": "tj-a1-0",
        "PREEMPTIBLE_METRICS_HOST": "127.0.0.1",
        "PREEMPTIBLE_METRICS_PORT": str(port),
        "PREEMPTIBLE_TERMINATION_LOG": str(tmp_path / "termination-log"),
    }
    proc = subprocess.Popen(_command(kind, tmp_path), env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 20
        first = _scrape(port, deadline)
        assert first[METRIC_NAMES["max_steps"]] == 1_000_000
        assert first[METRIC_NAMES["step_seconds_ema"]] == 1.0
        while _scrape(port, deadline)[METRIC_NAMES["step"]] < first[METRIC_NAMES["step"]] + 1:
            assert time.monotonic() < deadline, "the step does not advance"
            time.sleep(0.2)
        if stop == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:
            (control / "tj-a1-0.exit").touch()
        assert proc.wait(timeout=10) == 75
    finally:
        proc.kill()
        proc.wait()
    message = json.loads((tmp_path / "termination-log").read_text())
    assert message["reason"] == "preempted" and message["complete"] is False
    assert message["step"] >= 1
    assert abs(float((control / "tj-a1-0.exited").read_text()) - time.time()) < 30
