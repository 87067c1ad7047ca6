"""The operator image installs pyproject's `operator` extra and the package with --no-deps (see the
Dockerfile's operator-build stage). These tests keep that extra exact: everything the operator's
modules import (and the torch-free runtime modules they pull in) is in it, torch is not, and
each entry is also a base dependency with the same version bound."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.packaging.tools import REPO_ROOT

# Runs in a fresh interpreter: the test session has torch and the runtime loaded already.
_PROBE = """
import importlib, json, pkgutil, sys
import preemptible_operator as p
for m in pkgutil.iter_modules(p.__path__):
    importlib.import_module(f"preemptible_operator.{m.name}")
ours = sorted(
    getattr(mod, "__file__", None) or ""
    for name, mod in sys.modules.items()
    if name.split(".")[0] in ("preemptible_operator", "trainer_runtime")
)
print(json.dumps({"files": [f for f in ours if f], "torch": "torch" in sys.modules}))
"""


def _requirement_name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


@pytest.fixture(scope="module")
def project() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]


@pytest.fixture(scope="module")
def probe() -> dict:
    proc = subprocess.run(
        [sys.executable, "-P", "-c", _PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _imported_top_level(path: Path) -> set[str]:
    """Top-level module names of every import in a file (module level and inside functions)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_importing_every_operator_module_loads_no_torch(probe: dict) -> None:
    assert probe["torch"] is False
    loaded = {Path(f).relative_to(REPO_ROOT).as_posix() for f in probe["files"]}
    # the shared torch-free modules are part of what the image must carry
    assert "trainer_runtime/grace.py" in loaded and "operator/handlers.py" in loaded


def test_operator_extra_is_exactly_what_the_operator_imports(probe: dict, project: dict) -> None:
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    ours = {"preemptible_operator", "trainer_runtime"}
    modules: dict[str, list[str]] = {}
    for file in probe["files"]:
        for name in _imported_top_level(Path(file)) - stdlib - ours:
            modules.setdefault(name, []).append(Path(file).relative_to(REPO_ROOT).as_posix())
    by_module = importlib.metadata.packages_distributions()
    needed = {}
    for name, files in modules.items():
        assert name in by_module, f"{name} (imported by {files}) belongs to no installed package"
        needed[by_module[name][0].lower().replace("_", "-")] = files
    declared = {_requirement_name(r) for r in project["optional-dependencies"]["operator"]}
    assert "torch" not in declared
    missing = set(needed) - declared
    assert not missing, {m: needed[m] for m in missing}
    unused = declared - set(needed)
    assert not unused, f"the operator extra lists packages no operator module imports: {unused}"


def test_operator_extra_matches_the_base_dependencies(project: dict) -> None:
    """`pip install preemptible` (the runtime image) must satisfy the operator with the same
    bounds the operator image is built with."""
    base = {_requirement_name(r): r for r in project["dependencies"]}
    for requirement in project["optional-dependencies"]["operator"]:
        assert base.get(_requirement_name(requirement)) == requirement, requirement
