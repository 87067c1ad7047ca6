"""The process-group guard of `trainer-runtime launch`'s workers: a script that builds a process
group of another shape than the launch's is refused at once, naming what is wrong."""

from __future__ import annotations

from typing import Any

import pytest

from trainer_runtime.distributed.worker import process_group_problem

ENV = {"WORLD_SIZE": "4", "RANK": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({}, None),
        ({"init_method": "env://"}, None),
        ({"init_method": "env://?use_libuv=1"}, None),
        ({"world_size": 4, "rank": 3}, None),  # the launch's own shape, passed explicitly
        ({"world_size": -1, "rank": -1}, None),  # torch's defaults
        ({"world_size": 8}, "world_size=8"),  # would wait 30 min for ranks 4-7
        ({"world_size": 1, "rank": 0}, "world_size=1"),  # 4 unrelated copies side by side
        ({"rank": 0}, "rank=0"),
        ({"store": True, "world_size": 4, "rank": 3}, "store=..."),
        ({"init_method": "tcp://10.0.0.1:23456"}, "init_method='tcp://10.0.0.1:23456'"),
        ({"init_method": "file:///tmp/x"}, "init_method='file:///tmp/x'"),
    ],
)
def test_process_group_problem(kw: dict[str, Any], words: str | None) -> None:
    problem = process_group_problem(ENV, **kw)
    if words is None:
        assert problem is None
    else:
        assert problem is not None and words in problem
        assert "WORLD_SIZE=4" in problem and "RANK=3" in problem
        assert "init_process_group(backend)" in problem  # the fix


def test_outside_torchrun_nothing_is_compared() -> None:
    assert process_group_problem({}, world_size=8, rank=5) is None
