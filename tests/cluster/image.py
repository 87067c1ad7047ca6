"""The test tier's "image": this project's virtualenv, with a bin directory that holds what the
Docker image's ``/opt/preemptible/bin`` holds.

The development set-up has two layers (scripts/bootstrap.sh): the shared dependency venv and the
checkout's ``.venv``, which sees the shared one through a ``.pth``. The checkout's bin holds only
our own console scripts (``trainer-runtime``); those of our dependencies (``accelerate``,
``torchrun``, ...) are in the shared layer's bin, with that layer's python in their shebang, which
cannot import this checkout's packages (nor could the workers a launcher starts with its own
``sys.executable``). A Docker image has one venv whose bin holds the console scripts of every
installed distribution, all run by its python. ``write_image_bin`` gives the same: one script per
console-script entry point the image's python sees, run by that python.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterable
from pathlib import Path

__all__ = ["MAX_SHEBANG_BYTES", "console_script", "console_scripts", "write_image_bin"]

# Linux reads at most 256 bytes of a script's first line (BINPRM_BUF_SIZE, kernel 5.1+), and
# cuts a longer interpreter path silently.
MAX_SHEBANG_BYTES = 255

_VALUE = re.compile(
    r"^\s*(?P<module>[\w.]+)\s*:\s*(?P<attr>[\w.]+)\s*(?:\[[^\]]*\])?\s*$", re.ASCII
)

# Lists (name, value) of every console-script entry point, in the interpreter's sys.path order
# (importlib.metadata yields one distribution per name, the first found, as imports would).
_LIST = (
    "import importlib.metadata as m, json; "
    "print(json.dumps([[e.name, e.value] for e in m.entry_points(group='console_scripts')]))"
)


def console_script(python: str, value: str) -> str:
    """The text of the console script for entry point ``value`` (``module:attr[.attr]``, extras
    ignored) run by ``python``: import the object, call it, exit with what it returns."""
    match = _VALUE.match(value)
    if match is None:
        raise ValueError(f"console-script entry point {value!r}: expected 'module:attr'")
    shebang = f"#!{python}"
    if len(shebang.encode()) > MAX_SHEBANG_BYTES:
        raise ValueError(
            f"interpreter path of {len(shebang.encode())} bytes: Linux reads at most "
            f"{MAX_SHEBANG_BYTES} of a script's first line"
        )
    module, attr = match.group("module"), match.group("attr")
    return (
        f"{shebang}\n"
        "import sys\n"
        f"from {module} import {attr.split('.')[0]}\n"
        "\n"
        'if __name__ == "__main__":\n'
        f"    sys.exit({attr}())\n"
    )


def console_scripts(python: Path) -> dict[str, str]:
    """Name -> entry point value of every console script ``python``'s distributions declare
    (the first distribution wins a name, as on its sys.path)."""
    out = subprocess.run(
        [str(python), "-P", "-c", _LIST], check=True, capture_output=True, text=True, timeout=120
    )
    scripts: dict[str, str] = {}
    for name, value in json.loads(out.stdout):
        scripts.setdefault(name, value)
    return scripts


def write_image_bin(python: Path, directory: Path, *, skip: Iterable[str] = ()) -> list[str]:
    """Write into ``directory`` one executable script per console script ``python`` sees (less
    the names in ``skip``, e.g. those its own bin directory already has); returns their names.
    Entry points that are not ``module:attr`` are left out."""
    # Absolute, not resolved: a venv's python finds its pyvenv.cfg from the path it is run by.
    python = python.absolute()
    directory.mkdir(parents=True, exist_ok=True)
    skipped = set(skip)
    written = []
    for name, value in sorted(console_scripts(python).items()):
        if name in skipped or "/" in name or name.startswith("."):
            continue
        try:
            text = console_script(str(python), value)
        except ValueError:
            continue
        path = directory / name
        path.write_text(text)
        path.chmod(0o755)
        written.append(name)
    return written
