"""``python -m trainer_runtime.hf.run [-m module | script.py] [args...]``: run an unmodified
transformers (or TRL) training script with the operator contract attached to every
``transformers.Trainer`` it builds (see :mod:`trainer_runtime.hf.hook`).

The script runs as ``__main__`` with its own ``sys.argv`` and its directory first on
``sys.path``, as ``python script.py`` would run it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from trainer_runtime.distributed.worker import run_python_command
from trainer_runtime.hf.hook import install

USAGE = "usage: python -m trainer_runtime.hf.run [-m module | script.py] [args...]"


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--":
        args = args[1:]
    if not args or (args[0] == "-m" and len(args) < 2):
        raise SystemExit(USAGE)
    install()
    run_python_command(args, USAGE)


if __name__ == "__main__":
    main()
