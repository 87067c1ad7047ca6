"""The elastic sizing rule: which node counts keep the global batch, the accumulation at each,
and when a grow repays its restart."""

from __future__ import annotations

import pytest

from trainer_runtime.elastic import (
    accumulation_at,
    elastic_accumulation,
    restart_pays,
    sizes_keeping_global_batch,
)
from trainer_runtime.errors import ConfigurationError


@pytest.mark.parametrize(
    ("reference", "accumulation", "low", "high", "sizes"),
    [
        (4, 1, 1, 4, (1, 2, 4)),
        (4, 2, 1, 8, (1, 2, 4, 8)),
        (4, 2, 3, 3, ()),  # 3 nodes cannot split 8 node micro-batches
        (3, 2, 1, 3, (1, 2, 3)),  # the e2e scenario: 3 nodes, minNodes 1
        (3, 1, 2, 3, (3,)),
        (1, 1, 1, 16, (1,)),  # beyond reference x accumulation no size can keep it
        (8, 4, 5, 40, (8, 16, 32)),
    ],
)
def test_sizes_keeping_global_batch(
    reference: int, accumulation: int, low: int, high: int, sizes: tuple[int, ...]
) -> None:
    assert sizes_keeping_global_batch(reference, accumulation, low, high) == sizes


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((4, 1, 3, 2), "min_nodes \\(3\\) must be <= max_nodes \\(2\\)"),
        ((4, 1, 0, 2), "min_nodes must be an integer >= 1, got 0"),
        ((0, 1, 1, 2), "reference_nodes must be an integer >= 1"),
        ((4, True, 1, 2), "accumulation must be an integer >= 1, got True"),
    ],
)
def test_bad_ranges_are_refused_naming_the_field(args: tuple[int, ...], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        sizes_keeping_global_batch(*args)


@pytest.mark.parametrize(
    ("nodes", "reference", "accumulation", "expected"),
    [(4, 4, 2, 2), (2, 4, 2, 4), (1, 4, 2, 8), (8, 4, 2, 1), (2, 3, 2, 3), (3, 3, 2, 2)],
)
def test_accumulation_keeps_the_global_batch(
    nodes: int, reference: int, accumulation: int, expected: int
) -> None:
    got = accumulation_at(nodes, reference, accumulation)
    assert got == expected
    assert nodes * got == reference * accumulation


def test_a_size_that_cannot_keep_it_names_the_sizes_that_can() -> None:
    with pytest.raises(ConfigurationError, match="sizes that can: 1, 2, 4, 8"):
        accumulation_at(3, 4, 2)


@pytest.mark.parametrize(
    ("current", "target", "cooldown", "pause", "pays"),
    [
        (2, 3, 600.0, 200.0, True),  # the break-even: 3 x 400 == 2 x 600
        (2, 3, 600.0, 201.0, False),
        (1, 3, 60.0, 30.0, True),
        (3, 3, 600.0, 0.0, False),  # not a grow
        (3, 2, 600.0, 0.0, False),
        (2, 4, 100.0, 100.0, False),  # the pause eats the whole cooldown
    ],
)
def test_a_grow_happens_only_when_it_repays_its_pause(
    current: int, target: int, cooldown: float, pause: float, pays: bool
) -> None:
    assert restart_pays(current, target, cooldown, pause) is pays


def _env(
    reference: str = "2", accumulation: str = "3", world: str = "3", local: str = "1"
) -> dict[str, str]:
    return {
        "PREEMPTIBLE_ELASTIC_REFERENCE_NODES": reference,
        "PREEMPTIBLE_ELASTIC_ACCUMULATION": accumulation,
        "WORLD_SIZE": world,
        "LOCAL_WORLD_SIZE": local,
    }


def test_outside_an_elastic_attempt_nothing_changes() -> None:
    assert elastic_accumulation(3, {"WORLD_SIZE": "4"}) is None


@pytest.mark.parametrize(
    ("requested", "env", "expected"),
    [
        (3, _env(world="3"), 2),  # 2 reference nodes x 3 -> 3 nodes x 2
        (3, _env(world="1"), 6),
        (3, _env(world="2"), 3),  # the reference size: unchanged
        (2, _env(world="3"), 2),  # arguments rebuilt from an already resolved copy
        (3, _env(world="6", local="2"), 2),  # 3 nodes of 2 processes
    ],
)
def test_the_accumulation_at_the_size_the_attempt_got(
    requested: int, env: dict[str, str], expected: int
) -> None:
    got = elastic_accumulation(requested, env)
    assert got is not None and got[0] == expected
    assert f"gradient_accumulation_steps {requested} -> {expected}" in got[1]


@pytest.mark.parametrize(
    ("requested", "env", "message"),
    [
        (4, _env(world="3"), "gradient_accumulation_steps=4 but the job says"),
        (3, _env(world="4"), "4 nodes cannot keep the global batch.*sizes that can: 1, 2, 3, 6"),
        (3, _env(world="3", local="2"), "not a multiple of LOCAL_WORLD_SIZE=2"),
        (3, _env(accumulation="x"), "PREEMPTIBLE_ELASTIC_ACCUMULATION='x' must be an integer"),
        (3, _env(reference="0"), "PREEMPTIBLE_ELASTIC_REFERENCE_NODES='0'"),
    ],
)
def test_an_attempt_that_cannot_keep_the_global_batch_is_refused(
    requested: int, env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        elastic_accumulation(requested, env)
