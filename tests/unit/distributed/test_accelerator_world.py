"""A run whose ranks would each train their own copy is refused before the first step
(``ddp_args.check_accelerator_world``): torchrun on a machine without a GPU and no ``use_cpu``."""

from __future__ import annotations

import pytest

from trainer_runtime.distributed.ddp_args import check_accelerator_world
from trainer_runtime.errors import ConfigurationError


@pytest.mark.parametrize(
    ("group", "processes", "refused"),
    [
        (1, 1, False),  # one process, no process group
        (2, 2, False),  # accelerate sees the ranks (use_cpu=True, or GPUs)
        (8, 8, False),
        (2, 1, True),  # torchrun's 2 ranks, accelerate runs each alone
        (16, 1, True),
    ],
)
def test_ranks_that_would_train_alone_are_refused(
    group: int, processes: int, refused: bool
) -> None:
    if not refused:
        check_accelerator_world(process_group_size=group, accelerator_processes=processes)
        return
    with pytest.raises(ConfigurationError) as err:
        check_accelerator_world(process_group_size=group, accelerator_processes=processes)
    assert f"{group} ranks" in str(err.value) and "use_cpu=True" in str(err.value)
