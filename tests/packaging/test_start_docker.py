"""scripts/start_docker.sh on a fresh machine (no cache directory yet): it must get as far as
installing Docker instead of failing on its own install log. apt-get and id are stand-ins on PATH
(nothing is installed); dockerd and debootstrap are hidden so the install path is taken."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.packaging.tools import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "start_docker.sh"


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def test_fresh_cache_reaches_the_install(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "apt-get-ran"
    _stub(bin_dir, "id", "echo 0")
    # The install "fails" after running: the script must then say so and exit 1 (no dockerd).
    _stub(bin_dir, "apt-get", f'echo "apt-get $*" >> {marker}; exit 1')
    for tool in ("mkdir", "seq", "sleep", "cat", "printf"):
        found = subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True, text=True)
        if found.stdout.strip().startswith("/"):
            os.symlink(found.stdout.strip(), bin_dir / tool)
    cache = tmp_path / "fresh" / "cache"  # nothing of it exists yet
    proc = subprocess.run(
        ["/bin/bash", str(SCRIPT)],
        env={"PATH": str(bin_dir), "PREEMPTIBLE_CACHE": str(cache), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    assert marker.exists(), proc.stderr  # the install ran: the log's directory was there
    assert "apt-get update" in marker.read_text()
    assert (cache / "docker-install.log").exists()
    assert f"see {cache}/docker-install.log" in proc.stderr
