"""The toy (``python -m trainer_runtime.toy``), with one rank that hangs in a collective during
the JIT save: a test program, run by tests/distributed/test_hung_rank.py under the launcher.

``$HANG_RANK``'s JIT save, once every rank passed the checkpoint's first barrier, waits in a
point-to-point receive that no rank ever sends (a real gloo collective, the process alive, its
heartbeat thread beating): the others go on to the commit's barrier and wait there for it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from trainer_runtime import testing, toy
from trainer_runtime.distributed import collectives


def main() -> int:
    hang_rank = int(os.environ["HANG_RANK"])
    args = toy.parse_args(sys.argv[1:])
    trainer = toy.build_trainer(args)
    entries = trainer._checkpoint_entries

    def hanging_entries(main: bool, jit: bool, **kw: Any) -> Any:
        rank = collectives.rank()
        if jit and rank == hang_rank:
            testing.append_event(args.events_file, "hang", step=trainer.state.global_step)
            peer = (rank + 1) % collectives.world_size()
            dist.recv(torch.zeros(1), src=peer)  # never sent: stuck here for good
        return entries(main, jit, **kw)

    trainer._checkpoint_entries = hanging_entries
    trainer.train(resume_from_checkpoint=args.resume_from)
    return 0


if __name__ == "__main__":
    sys.exit(main())
