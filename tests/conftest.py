# The real control plane's fixtures (control_plane, node_agent, kueue, namespace, kueue_namespace)
# are available to every test directory.
from __future__ import annotations

from collections import defaultdict

import pytest

pytest_plugins = ["tests.cluster.fixtures"]

# Seconds per tier (tests/<tier>) and per file, set-up and teardown included (shared cluster
# fixtures land on the first test that uses them): where CI's 90 minutes go, for trimming.
_SECONDS: dict[str, defaultdict[str, float]] = {
    "tier": defaultdict(float),
    "file": defaultdict(float),
}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::", 1)[0]
    parts = path.split("/")
    _SECONDS["file"][path] += report.duration
    _SECONDS["tier"][parts[1] if len(parts) > 2 else path] += report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    tiers, files = _SECONDS["tier"], _SECONDS["file"]
    if len(tiers) < 2:
        return
    total = sum(tiers.values())
    terminalreporter.write_sep("=", f"seconds per tier ({total / 60:.1f} min of tests)")
    for tier, seconds in sorted(tiers.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f} s {100 * seconds / total:5.1f} %  {tier}")
    terminalreporter.write_sep("=", "the 25 slowest files")
    for path, seconds in sorted(files.items(), key=lambda kv: -kv[1])[:25]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {path}")
