"""The test tier's image bin directory (no cluster needed): the console scripts of every
distribution the image's python sees, each run by that python."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .image import MAX_SHEBANG_BYTES, console_script, write_image_bin

PY = "/opt/venv/bin/python"


@pytest.mark.parametrize(
    ("value", "imports", "call"),
    [
        ("accelerate.commands.accelerate_cli:main", "from accelerate.commands.accelerate_cli "
         "import main", "main()"),
        ("torch.distributed.run:main", "from torch.distributed.run import main", "main()"),
        ("pkg.cli:App.run", "from pkg.cli import App", "App.run()"),
        ("pkg:main [extra1, extra2]", "from pkg import main", "main()"),
        (" pkg.mod : main ", "from pkg.mod import main", "main()"),
    ],
)  # fmt: skip
def test_console_script_imports_the_object_and_exits_with_its_result(
    value: str, imports: str, call: str
) -> None:
    text = console_script(PY, value)
    assert text.splitlines()[0] == f"#!{PY}"
    assert imports in text.splitlines()
    assert f"    sys.exit({call})" in text.splitlines()


@pytest.mark.parametrize("value", ["pkg.mod", "pkg:", ":main", "pkg:main; rm -rf /", "a b:c"])
def test_console_script_refuses_what_is_not_module_attr(value: str) -> None:
    with pytest.raises(ValueError, match="module:attr"):
        console_script(PY, value)


def test_console_script_refuses_an_interpreter_path_linux_would_cut() -> None:
    with pytest.raises(ValueError, match="at most 255"):
        console_script("/" + "x" * MAX_SHEBANG_BYTES, "pkg:main")


def test_the_image_bin_holds_the_dependencies_launchers_run_by_the_image_python(
    tmp_path: Path,
) -> None:
    image_bin = Path(sys.executable).parent
    written = write_image_bin(Path(sys.executable), tmp_path, skip=["trainer-runtime"])
    assert {"accelerate", "torchrun", "transformers"} <= set(written), written
    assert "trainer-runtime" not in written and not (tmp_path / "trainer-runtime").exists()
    for name in ("accelerate", "torchrun"):
        script = tmp_path / name
        assert os.access(script, os.X_OK), script
        # The image's python by the path it is run by (not resolved: the venv's own python), so
        # the launcher's workers (its sys.executable) import this checkout's packages.
        assert script.read_text().splitlines()[0] == f"#!{image_bin.absolute() / 'python'}"
    out = subprocess.run(
        [str(tmp_path / "torchrun"), "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.startswith("usage: torchrun"), out.stderr
