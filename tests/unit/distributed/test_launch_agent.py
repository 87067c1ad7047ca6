"""The launcher's torchrun agent: how the workers' ends are ordered and written (pure parts), and
that the hook into torchrun still finds what it reads in this torch."""

from __future__ import annotations

from typing import Any

import pytest

from trainer_runtime.distributed.agent import install_recorder, ordered_ends, shell_code


@pytest.mark.parametrize(
    ("returncode", "code"), [(None, None), (0, 0), (1, 1), (75, 75), (-9, 137), (-15, 143)]
)
def test_shell_code(returncode: int | None, code: int | None) -> None:
    assert shell_code(returncode) == code


def _h(local: int, code: int | None) -> dict[str, Any]:
    return {"local_rank": local, "rank": 4 + local, "exit_code": code}


@pytest.mark.parametrize(
    ("handles", "failures", "order"),
    [
        # A worker failure: torchrun's own order (root cause first), then the rest by local rank.
        ({0: _h(0, 143), 1: _h(1, 1), 2: _h(2, 0)}, [(1, 1, 100.0), (0, -15, 100.0)],
         [(1, 1), (0, 143), (2, 0)]),
        # Timestamps decide before the capture order.
        ({0: _h(0, 75), 1: _h(1, 1)}, [(0, 75, 101.0), (1, 1, 100.0)], [(1, 1), (0, 75)]),
        # Signalled: no failures, local-rank order.
        ({1: _h(1, 75), 0: _h(0, 75)}, [], [(0, 75), (1, 75)]),
        # torchrun's failure without a handle (the hook found nothing): still listed.
        ({}, [(1, -11, 5.0)], [(1, 139)]),
    ],
)  # fmt: skip
def test_ordered_ends(
    handles: dict[int, dict[str, Any]],
    failures: list[tuple[int, int | None, float]],
    order: list[tuple[int, int]],
) -> None:
    ends = ordered_ends(handles, failures)
    assert [(e["local_rank"], e["exit_code"]) for e in ends] == order


def test_the_recorder_hooks_into_this_torch() -> None:
    """install_recorder reaches into torchrun's launcher (LocalElasticAgent._shutdown, the
    subprocess handles): fails when a torch upgrade moves them, instead of the launcher quietly
    losing the exit codes of a signalled pod's workers."""
    from torch.distributed.elastic.agent.server import local_elastic_agent
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext
    from torch.distributed.launcher import api as launcher_api

    original = launcher_api.LocalElasticAgent
    try:
        install_recorder()
        agent_cls = launcher_api.LocalElasticAgent
        assert agent_cls is not original and issubclass(agent_cls, original)
        assert original is local_elastic_agent.LocalElasticAgent
        assert "_shutdown" in vars(local_elastic_agent.LocalElasticAgent)
        assert "subprocess_handlers" in SubprocessContext.__init__.__code__.co_names
    finally:
        launcher_api.LocalElasticAgent = original
