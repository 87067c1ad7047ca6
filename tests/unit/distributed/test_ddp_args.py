"""The DDP field group: defaults, validation messages, and what the Trainer builds from it."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from trainer_runtime.distributed.ddp_args import (
    AcceleratorConfig,
    DdpArguments,
    accelerator_kwargs,
    check_backend,
    dispatch_batches,
    even_batches,
    per_rank_batch_size,
)
from trainer_runtime.errors import ConfigurationError


def test_defaults_are_hugging_face_defaults() -> None:
    a = DdpArguments()
    assert a.ddp_backend is None and a.ddp_timeout == 1800
    assert a.ddp_find_unused_parameters is None and a.ddp_bucket_cap_mb is None
    assert a.ddp_broadcast_buffers is None and a.ddp_static_graph is None
    assert a.average_tokens_across_devices is True and a.save_on_each_node is False
    assert a.accelerator_config == AcceleratorConfig()


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("ddp_backend", "hccl", "vendor plugin"),
        ("ddp_backend", "nccl2", "unknown backend"),
        ("ddp_timeout", 0, "greater than or equal to 1"),
        ("ddp_bucket_cap_mb", 0, "greater than 0"),
        ("accelerator_config", {"use_seedable_sampler": False}, "seeded order"),
        ("accelerator_config", {"split_batch": True}, "split_batch"),
        ("accelerator_config", "{not json", "JSON"),
    ],
)
def test_invalid_values_name_the_field(field: str, value: Any, needle: str) -> None:
    with pytest.raises(ValidationError) as err:
        DdpArguments(**{field: value})
    text = str(err.value)
    assert field in text and needle in text, text


def test_backend_is_normalised() -> None:
    assert DdpArguments(ddp_backend="GLOO").ddp_backend == "gloo"
    assert DdpArguments(ddp_backend="").ddp_backend is None


def test_accelerator_config_from_json_string_and_file(tmp_path: Path) -> None:
    a = DdpArguments(accelerator_config='{"split_batches": true}')
    assert a.accelerator_config.split_batches is True
    path = tmp_path / "acc.json"
    path.write_text(json.dumps({"split_batches": True, "non_blocking": True}))
    b = DdpArguments(accelerator_config=str(path))
    assert b.accelerator_config.split_batches and b.accelerator_config.non_blocking


@pytest.mark.parametrize(
    ("dispatch", "iterable", "world", "expected"),
    [
        # None follows accelerate: iterable datasets are dispatched, map-style ones are not
        (None, False, 2, False),
        (None, True, 2, True),
        (True, False, 2, True),
        (False, True, 2, False),
        # a single process never dispatches
        (True, False, 1, False),
        (None, True, 1, False),
    ],
)
def test_dispatch_batches_resolution(
    dispatch: bool | None, iterable: bool, world: int, expected: bool
) -> None:
    args = DdpArguments(accelerator_config={"dispatch_batches": dispatch})
    assert dispatch_batches(args, iterable=iterable, world_size=world) is expected


@pytest.mark.parametrize("value", [True, False])
def test_even_batches_is_accepted_both_ways(value: bool) -> None:
    args = DdpArguments(accelerator_config={"even_batches": value})
    assert even_batches(args) is value
    assert even_batches(object()) is True  # arguments without accelerator_config


@pytest.mark.parametrize(
    ("backend", "cuda", "expected"),
    [(None, False, "gloo"), (None, True, "nccl"), ("gloo", True, "gloo"), ("nccl", True, "nccl")],
)
def test_check_backend(backend: str | None, cuda: bool, expected: str) -> None:
    assert check_backend(backend, cuda=cuda) == expected


def test_nccl_on_cpu_is_refused_clearly() -> None:
    with pytest.raises(ConfigurationError, match="ddp_backend='nccl' needs CUDA"):
        check_backend("nccl", cuda=False)


@pytest.mark.parametrize(
    ("bs", "split", "world", "expected"),
    [(8, False, 2, 8), (8, True, 2, 4), (8, True, 1, 8), (9, False, 3, 9), (9, True, 3, 3)],
)
def test_per_rank_batch_size(bs: int, split: bool, world: int, expected: int) -> None:
    class Args(DdpArguments):
        per_device_train_batch_size: int = bs

    args = Args(accelerator_config={"split_batches": split})
    assert per_rank_batch_size(args, world) == expected


def test_split_batches_must_divide() -> None:
    class Args(DdpArguments):
        per_device_train_batch_size: int = 10

    with pytest.raises(ConfigurationError, match="multiple of 4"):
        per_rank_batch_size(Args(accelerator_config={"split_batches": True}), 4)


def test_accelerator_kwargs_pass_only_what_was_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    kw = accelerator_kwargs(
        DdpArguments(ddp_backend="gloo", ddp_timeout=60, ddp_find_unused_parameters=True)
    )
    init, ddp = kw["kwargs_handlers"]
    assert init.backend == "gloo" and init.timeout == timedelta(seconds=60)
    assert ddp.to_kwargs() == {"find_unused_parameters": True}
    (only_init,) = accelerator_kwargs(DdpArguments())["kwargs_handlers"]
    assert only_init.timeout == timedelta(seconds=1800)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"full_determinism": True}, {"find_unused_parameters": True}),
        # An explicit choice wins (False is accelerate's default: nothing to pass); a static
        # graph rebuilds its buckets anyway.
        (
            {"full_determinism": True, "ddp_find_unused_parameters": False},
            {},
        ),
        ({"full_determinism": True, "ddp_static_graph": True}, {"static_graph": True}),
        ({"full_determinism": False}, None),
    ],
)
def test_full_determinism_keeps_the_initial_bucket_order(
    fields: dict[str, Any], expected: dict[str, Any] | None
) -> None:
    from trainer_runtime.training_args import TrainingArguments

    handlers = accelerator_kwargs(TrainingArguments(output_dir="o", **fields))["kwargs_handlers"]
    ddp = [h.to_kwargs() for h in handlers[1:]]
    assert ddp == ([] if expected is None else [expected])


def test_single_process_does_not_force_a_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    # accelerate would expect a process group that nobody creates.
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    (init,) = accelerator_kwargs(DdpArguments(ddp_backend="gloo"))["kwargs_handlers"]
    assert "backend" not in init.to_kwargs()


def test_trainer_hands_the_ddp_fields_to_accelerate(tmp_path: Path) -> None:
    from tests.unit.runtime.tiny import ClassificationData, TinyClassifier
    from trainer_runtime.trainer import Trainer
    from trainer_runtime.training_args import TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        ddp_timeout=77,
        ddp_bucket_cap_mb=5,
        ddp_static_graph=True,
    )
    trainer = Trainer(model=TinyClassifier(), args=args, train_dataset=ClassificationData())
    assert trainer.accelerator.init_handler.timeout == timedelta(seconds=77)
    assert trainer.accelerator.ddp_handler.to_kwargs() == {"bucket_cap_mb": 5, "static_graph": True}
