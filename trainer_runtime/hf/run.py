"""``python -m trainer_runtime.hf.run [-m module | script.py] [args...]``: run an unmodified
transformers (or TRL) training script with the operator contract attached to every
``transformers.Trainer`` it builds (see :mod:`trainer_runtime.hf.hook`).

The script runs as ``__main__`` with its own ``sys.argv`` and its directory first on
``sys.path``, as ``python script.py`` would run it.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

from trainer_runtime.hf.hook import install

USAGE = "usage: python -m trainer_runtime.hf.run [-m module | script.py] [args...]"


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--":
        args = args[1:]
    if not args or (args[0] == "-m" and len(args) < 2):
        raise SystemExit(USAGE)
    install()
    if args[0] == "-m":
        module, rest = args[1], args[2:]
        sys.argv = [module, *rest]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script, rest = args[0], args[1:]
    if not os.path.isfile(script):
        raise SystemExit(f"{script}: no such file ({USAGE})")
    sys.argv = [script, *rest]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
