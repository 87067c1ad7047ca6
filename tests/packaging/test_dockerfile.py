"""The Dockerfile, parsed: two images (operator without torch, runtime with it) from shared
stages, non-root, entry points that exist, a build context that holds what the COPY lines need.
The opt-in test at the end builds and runs both for real (tests/packaging/docker_smoke.sh)."""

from __future__ import annotations

import fnmatch
import os
import re
import time
import tomllib
from pathlib import Path

import pytest

from tests.packaging.dockerfile import Instruction, parse_dockerfile, parse_instructions
from tests.packaging.tools import REPO_ROOT, run_tool

DOCKERFILE = REPO_ROOT / "Dockerfile"


@pytest.fixture(scope="module")
def parsed():
    return parse_dockerfile(DOCKERFILE)


def _console_scripts() -> set[str]:
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    return set(pyproject["project"]["scripts"])


def _dockerignore() -> list[str]:
    lines = (REPO_ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _ignored(path: str, patterns: list[str]) -> bool:
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        parts = Path(path).parts
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(
            fnmatch.fnmatch(p, pattern) or fnmatch.fnmatch(p, pattern.replace("**/", ""))
            for p in prefixes
        ):
            ignored = not negate
    return ignored


# ------------------------------------------------------------------------------- the parser


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("FROM a AS b\nRUN x \\\n  y\n", [("FROM", "a AS b", 1), ("RUN", "x y", 2)]),
        ("# c\nRUN a \\\n# inside\n  b\n", [("RUN", "a b", 2)]),
        ('CMD ["x", "y"]\n', [("CMD", '["x", "y"]', 1)]),
        ("run lower\n", [("RUN", "lower", 1)]),
    ],
    ids=["continuation", "comment-in-continuation", "exec-form", "case"],
)
def test_parser(text: str, expected: list[tuple[str, str, int]]) -> None:
    assert [(i.keyword, i.value, i.line) for i in parse_instructions(text)] == expected


def test_parser_rejects_dangling_continuation() -> None:
    with pytest.raises(ValueError, match="continuation"):
        parse_instructions("RUN a \\\n")


def test_exec_form() -> None:
    assert Instruction("CMD", '["a", "b"]', 1).exec_form() == ["a", "b"]
    assert Instruction("CMD", "a b", 1).exec_form() is None


# ---------------------------------------------------------------------------- the Dockerfile


def _stage(stages, name: str):
    (stage,) = [s for s in stages if s.name == name]
    return stage


def test_multi_stage_from_one_base(parsed) -> None:
    args, stages = parsed
    assert [s.name for s in stages] == [
        "venv",
        "operator-build",
        "base",
        "operator",
        "build",
        "runtime",
    ]
    assert args["BASE_IMAGE"].startswith("python:3.")
    bases = {s.name: s.base for s in stages}
    assert bases["venv"] == bases["base"] == args["BASE_IMAGE"]
    assert bases["operator-build"] == bases["build"] == "venv"
    assert bases["operator"] == bases["runtime"] == "base"
    # The runtime image is the last stage: a plain `docker build .` still builds it. The torch
    # stage comes after the operator image, which Docker's classic builder (every stage up to
    # --target, in order) then builds without installing torch.
    names = [s.name for s in stages]
    assert stages[-1].name == "runtime"
    assert names.index("build") > names.index("operator")
    # Each final image copies only the virtual environment out of its own build stage.
    for final, build in (("operator", "operator-build"), ("runtime", "build")):
        copies = _stage(stages, final).all("COPY")
        assert [c.flags().get("from") for c in copies] == [build], final
        assert copies[0].words()[-2:] == ["/opt/preemptible", "/opt/preemptible"]


def test_torch_build_arguments(parsed) -> None:
    _, stages = parsed
    build = _stage(stages, "build")
    build_args = {i.value.partition("=")[0]: i.value.partition("=")[2] for i in build.all("ARG")}
    assert build_args["TORCH_INDEX_URL"] == ""  # empty: pip's default index
    assert build_args["TORCH_SPEC"] == "torch"
    torch_install = next(i for i in build.all("RUN") if "TORCH_SPEC" in i.value)
    assert '--index-url "$TORCH_INDEX_URL"' in torch_install.value


def test_operator_image_installs_only_the_operator_extra(parsed) -> None:
    """No torch in the operator image: its build installs pyproject's `operator` extra (kept
    exact by test_operator_dependencies.py) and the package with --no-deps, then fails when an
    operator module does not import or torch is importable."""
    _, stages = parsed
    stage = _stage(stages, "operator-build")
    assert not stage.all("ARG"), "the operator build takes no torch arguments"
    (run,) = stage.all("RUN")
    text = run.value
    assert '["optional-dependencies"]' in text and 'extras["operator"]' in text
    # the operator reads checkpoints on s3:// too: the `s3` extra, checked to load
    assert 'extras["operator"] + extras["s3"]' in text
    assert 'fsspec.filesystem("s3", anon=True)' in text
    assert "pip install -r /tmp/operator-requirements.txt" in text
    assert "pip install --no-deps ." in text
    assert "TORCH" not in text and "pip install torch" not in text
    assert "iter_modules(p.__path__)" in text and '"torch" not in sys.modules' in text
    assert "python3 -P -c 'import torch'" in text and "exit 1" in text
    assert "preemptible-operator --help" in text
    # -P everywhere: the build directory's operator/ would shadow the standard library's module
    assert "python3 -c" not in text


def test_runtime_image_installs_the_s3_extra(parsed) -> None:
    """s3:// checkpoint dirs work in the runtime image: the `s3` extra, checked to load."""
    _, stages = parsed
    install = next(i for i in _stage(stages, "build").all("RUN") if "pip install" in i.value
                   and "TORCH_SPEC" not in i.value)  # fmt: skip
    assert install.value.startswith('pip install ".[s3]"'), install.value
    assert 'fsspec.filesystem("s3", anon=True)' in install.value


def test_final_stages_run_as_non_root(parsed) -> None:
    _, stages = parsed
    base = _stage(stages, "base")
    for name in ("operator", "runtime"):
        final = _stage(stages, name)
        user = final.last("USER")
        assert user is not None, f"stage {name} must set USER"
        uid, _, gid = user.value.partition(":")
        assert uid.isdigit() and int(uid) > 0, "numeric non-root uid (runAsNonRoot checks it)"
        assert gid.isdigit() and int(gid) > 0
        # The user is created in the shared base stage with that uid.
        assert any(f"--uid {uid}" in r.value for r in base.all("RUN"))
        # Nothing after USER switches back to root.
        index = final.instructions.index(user)
        assert not [i for i in final.instructions[index:] if i.keyword == "RUN"]


def test_entry_points_are_console_scripts(parsed) -> None:
    _, stages = parsed
    scripts = _console_scripts()
    for name in ("operator", "runtime"):
        final = _stage(stages, name)
        commands = [i.exec_form() for i in (final.last("ENTRYPOINT"), final.last("CMD")) if i]
        assert commands, f"the {name} image needs a default command"
        for command in commands:
            assert command is not None, "use the exec form so signals reach the process"
            assert command[0] in scripts
    assert _stage(stages, "operator").last("CMD").exec_form()[0] == "preemptible-operator"
    # The entry points are smoke-tested at build time.
    build_runs = " ".join(r.value for r in _stage(stages, "build").all("RUN"))
    for script in ("preemptible-operator", "trainer-runtime"):
        assert script in scripts
        assert f"{script} --help" in build_runs
    operator_runs = " ".join(r.value for r in _stage(stages, "operator-build").all("RUN"))
    assert "preemptible-operator --help" in operator_runs


def test_copy_sources_are_in_the_build_context(parsed) -> None:
    _, stages = parsed
    patterns = _dockerignore()
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    package_dirs = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    for stage in stages:
        context_copies = [i for i in stage.all("COPY") if "from" not in i.flags()]
        for inst in context_copies:
            sources = [w for w in inst.words() if not w.startswith("--")][:-1]
            for source in sources:
                assert (REPO_ROOT / source).exists(), f"line {inst.line}: {source} does not exist"
                assert not _ignored(source.rstrip("/"), patterns), f"{source} is in .dockerignore"
        if stage.name in ("operator-build", "build"):
            # The packages the image installs are exactly the ones pyproject declares.
            copied = {w.rstrip("/") for i in context_copies for w in i.words()[:-1]}
            assert package_dirs <= copied, stage.name


def test_pyproject_lists_every_runtime_subpackage() -> None:
    """`pip install .` (the image) installs only the packages pyproject names: a sub-package missing
    there imports in an editable checkout but not in the image."""
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    declared = set(pyproject["tool"]["setuptools"]["packages"])
    on_disk = {
        ".".join(init.parent.relative_to(REPO_ROOT).parts)
        for init in (REPO_ROOT / "trainer_runtime").rglob("__init__.py")
    }
    assert on_disk <= declared, sorted(on_disk - declared)


def test_dockerignore_keeps_local_state_out() -> None:
    patterns = _dockerignore()
    for path in (".git", "tests/unit", "trainer_runtime/__pycache__", "preemptible.egg-info"):
        assert _ignored(path, patterns), path
    for path in (
        "pyproject.toml",
        "README.md",
        "trainer_runtime/trainer.py",
        "operator/handlers.py",
    ):
        assert not _ignored(path, patterns), path


def test_no_hostnames_in_dockerfile() -> None:
    """Registries and indexes come from build arguments and pip/Docker defaults only."""
    text = DOCKERFILE.read_text()
    assert not re.search(r"https?://", text)


@pytest.mark.slow
# Two images, torch download included: longer than the suite's default 600 s on a loaded machine.
@pytest.mark.timeout(3600)
def test_image_builds_and_runs() -> None:
    """Opt-in: builds both images for real and runs them (tests/packaging/docker_smoke.sh). Needs
    a Docker daemon and downloads torch (several GB); `.ci/run` turns it on when it can start
    Docker."""
    if os.environ.get("PREEMPTIBLE_DOCKER_SMOKE") != "1":
        pytest.skip(
            "set PREEMPTIBLE_DOCKER_SMOKE=1 (a running Docker daemon; add "
            "PREEMPTIBLE_DOCKER_SMOKE_ARGS=--local-base where images cannot be pulled) to build "
            "and run the image"
        )
    result = os.environ.get("PREEMPTIBLE_DOCKER_SMOKE_RESULT")
    if result:
        # `.ci/run` started the script in the background when the run began: wait for its status.
        rc = _wait_for_result(Path(result), timeout=3600)
        log = Path(os.environ.get("PREEMPTIBLE_DOCKER_SMOKE_LOG", result + ".log"))
        text = log.read_text(errors="replace") if log.exists() else "(no log)"
        assert rc == 0, f"tests/packaging/docker_smoke.sh exited {rc}; its log:\n{text[-20000:]}"
        print(text[-2000:])
        return
    args = os.environ.get("PREEMPTIBLE_DOCKER_SMOKE_ARGS", "").split()
    run_tool("bash", str(REPO_ROOT / "tests/packaging/docker_smoke.sh"), *args, timeout=3600)


def _wait_for_result(path: Path, timeout: float) -> int:
    """The exit status a background run wrote into ``path`` (written whole, by rename)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"no result in {path} after {timeout:.0f} s"
        time.sleep(2)
    return int(path.read_text().strip())


@pytest.mark.parametrize(("content", "expected"), [("0\n", 0), ("1\n", 1), ("137", 137)])
def test_a_background_result_is_read_whole(tmp_path: Path, content: str, expected: int) -> None:
    (tmp_path / "rc").write_text(content)
    assert _wait_for_result(tmp_path / "rc", timeout=1) == expected


def test_a_missing_background_result_times_out(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="no result"):
        _wait_for_result(tmp_path / "rc", timeout=0.1)
