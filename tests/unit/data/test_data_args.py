"""DataArguments validation, DataLoader kwargs, iterable datasets and end-to-end resume."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pydantic import BaseModel, ValidationError
from torch.utils.data import Dataset, IterableDataset

from trainer_runtime.data.arguments import (
    DataArguments,
    build_train_dataloader,
    check_train_dataset,
    dataloader_kwargs,
    is_iterable_dataset,
    set_dataset_epoch,
)
from trainer_runtime.data.collators import PaddingCollator
from trainer_runtime.data.length_sampling import (
    BatchRebalanceBatchSampler,
    LengthGroupedBatchSampler,
)
from trainer_runtime.errors import ConfigurationError


class Args(DataArguments):
    """The fields as TrainingArguments will carry them (plus the two the builder reads)."""

    per_device_train_batch_size: int = 4


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dataloader_persistent_workers": True}, "dataloader_persistent_workers=True requires"),
        ({"dataloader_prefetch_factor": 2}, "dataloader_prefetch_factor=2 requires"),
        ({"dataloader_num_workers": -1}, "dataloader_num_workers"),
        ({"dataloader_num_workers": 2, "dataloader_prefetch_factor": 0}, "prefetch_factor"),
        ({"dataloader_multiprocessing_context": "thread"}, "dataloader_multiprocessing_context"),
        ({"train_sampling_strategy": "by_length"}, "train_sampling_strategy"),
        ({"neftune_noise_alpha": 0}, "neftune_noise_alpha"),
        ({"length_column_name": ""}, "length_column_name"),
    ],
)
def test_invalid_arguments_name_the_field(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        Args(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"dataloader_num_workers": 4, "dataloader_persistent_workers": True},
        {"dataloader_num_workers": 4, "dataloader_prefetch_factor": 2},
        {"train_sampling_strategy": "batch_rebalance", "length_column_name": "n"},
        {"neftune_noise_alpha": 5},
    ],
)
def test_valid_arguments(kwargs: dict[str, Any]) -> None:
    Args(**kwargs)


def test_mixes_into_another_pydantic_model() -> None:
    class Merged(DataArguments, BaseModel):
        output_dir: str = "out"

    assert Merged(dataloader_num_workers=2).dataloader_num_workers == 2
    with pytest.raises(ValidationError, match="requires dataloader_num_workers > 0"):
        Merged(dataloader_persistent_workers=True)


def test_dataloader_kwargs() -> None:
    assert dataloader_kwargs(Args()) == {"num_workers": 0, "pin_memory": False}
    kw = dataloader_kwargs(
        Args(
            dataloader_num_workers=2,
            dataloader_persistent_workers=True,
            dataloader_prefetch_factor=3,
            dataloader_multiprocessing_context="spawn",
            dataloader_in_order=False,
        )
    )
    assert kw["num_workers"] == 2 and kw["persistent_workers"] is True
    assert kw["prefetch_factor"] == 3 and kw["multiprocessing_context"] == "spawn"
    assert kw["in_order"] is False and callable(kw["worker_init_fn"])


class Stream(IterableDataset):
    def __init__(self) -> None:
        self.generator = torch.Generator()
        self.epochs: list[int] = []

    def __iter__(self) -> Any:
        order = torch.randperm(10, generator=self.generator).tolist()
        return iter({"input_ids": [i] * (i + 1)} for i in order)


class StreamWithSetEpoch(Stream):
    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


def test_iterable_dataset_needs_max_steps() -> None:
    with pytest.raises(ConfigurationError, match="set max_steps to a positive"):
        check_train_dataset(Stream(), max_steps=-1, train_sampling_strategy="random")
    assert check_train_dataset(Stream(), max_steps=5, train_sampling_strategy="random") is None


def test_length_strategies_ignored_for_iterable_datasets_with_a_warning() -> None:
    with pytest.warns(UserWarning, match="ignored for an iterable dataset"):
        check_train_dataset(Stream(), max_steps=5, train_sampling_strategy="group_by_length")


def test_set_dataset_epoch() -> None:
    with_hook = StreamWithSetEpoch()
    assert set_dataset_epoch(with_hook, 3, seed=1) == "set_epoch"
    assert with_hook.epochs == [3]
    a, b = Stream(), Stream()
    assert set_dataset_epoch(a, 2, seed=7) == "generator"
    set_dataset_epoch(b, 2, seed=7)
    assert list(a) == list(b)  # identical on every rank
    set_dataset_epoch(b, 3, seed=7)
    assert b.generator.initial_seed() == 10  # seed + epoch
    assert set_dataset_epoch([1, 2], 0, seed=0) is None


def test_is_iterable_dataset() -> None:
    assert is_iterable_dataset(Stream())
    assert not is_iterable_dataset([{"input_ids": [1]}])


def test_iterable_dataloader_batches_in_stream_order() -> None:
    stream = Stream()
    set_dataset_epoch(stream, 0, seed=0)
    expected = list(stream)
    set_dataset_epoch(stream, 0, seed=0)
    loader = build_train_dataloader(
        stream, Args(), collate_fn=PaddingCollator(), seed=0, max_steps=3
    )
    got = [row for batch in loader for row in batch["input_ids"][:, 0].tolist()]
    assert got == [e["input_ids"][0] for e in expected]


class CountingDataset(Dataset):
    """Records which items were read, to prove a resume skips without reading."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths
        self.reads: list[int] = []

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        self.reads.append(i)
        return {"input_ids": [i] * self.lengths[i], "length": self.lengths[i]}


LENGTHS = [(i * 37) % 23 + 1 for i in range(60)]


def ids(batch: dict[str, torch.Tensor]) -> list[int]:
    return batch["input_ids"][:, 0].tolist()


@pytest.mark.parametrize("strategy", ["group_by_length", "batch_rebalance"])
def test_dataloader_resume_reads_only_the_remaining_samples(strategy: str) -> None:
    args = Args(train_sampling_strategy=strategy)
    common = {"collate_fn": PaddingCollator(), "seed": 3, "gradient_accumulation_steps": 2}

    full_ds = CountingDataset(LENGTHS)
    full = [ids(b) for b in build_train_dataloader(full_ds, args, **common)]

    ds = CountingDataset(LENGTHS)
    loader = build_train_dataloader(ds, args, **common)
    assert isinstance(loader.batch_sampler, LengthGroupedBatchSampler | BatchRebalanceBatchSampler)
    first = [ids(b) for _, b in zip(range(4), loader, strict=False)]
    loader.batch_sampler.start = 4  # what the training loop records at a checkpoint
    state = loader.batch_sampler.state_dict()

    resumed_ds = CountingDataset(LENGTHS)
    resumed = build_train_dataloader(resumed_ds, args, **common)
    scan = list(resumed_ds.reads)
    resumed_ds.reads.clear()
    resumed.batch_sampler.load_state_dict(state)
    rest = [ids(b) for b in resumed]
    assert first + rest == full
    # One length scan when the sampler is built, then only the samples of the remaining batches.
    assert sorted(scan) == list(range(len(LENGTHS)))
    assert sorted(resumed_ds.reads) == sorted(i for batch in rest for i in batch)


def test_dataloader_with_workers_gives_the_same_batches() -> None:
    args0 = Args(train_sampling_strategy="group_by_length")
    args2 = Args(
        train_sampling_strategy="group_by_length",
        dataloader_num_workers=2,
        dataloader_prefetch_factor=2,
    )
    common = {"collate_fn": PaddingCollator(), "seed": 1}
    serial = [ids(b) for b in build_train_dataloader(CountingDataset(LENGTHS), args0, **common)]
    parallel = [ids(b) for b in build_train_dataloader(CountingDataset(LENGTHS), args2, **common)]
    assert serial == parallel


def test_mixes_into_training_arguments() -> None:
    """How TrainingArguments gets the fields: inheritance; the checks come along."""
    from trainer_runtime.training_args import TrainingArguments

    class Merged(TrainingArguments, DataArguments):
        pass

    args = Merged(output_dir="out", dataloader_num_workers=2, dataloader_prefetch_factor=4)
    assert dataloader_kwargs(args)["prefetch_factor"] == 4
    with pytest.raises(ConfigurationError, match="dataloader_persistent_workers=True requires"):
        Merged(output_dir="out", dataloader_persistent_workers=True)


def test_importing_the_argument_model_does_not_import_torch() -> None:
    """TrainingArguments inherits DataArguments; the arguments must stay cheap to import."""
    import subprocess
    import sys

    code = "import trainer_runtime.data.arguments, sys; assert 'torch' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_skip_batches_shows_progress_and_says_why(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    from trainer_runtime.data.arguments import skip_batches

    it = iter(range(10))
    with caplog.at_level("WARNING"):
        skip_batches(it, 4, disable=False, why="the dataset has no state_dict()")
    assert next(it) == 4
    assert "skipping 4 batches" in caplog.text and "no state_dict()" in caplog.text
    assert "skipping to the data position" in capsys.readouterr().err


def test_iterable_dataset_state_only_without_workers() -> None:
    from trainer_runtime.data.arguments import iterable_dataset_state

    class WithState(Stream):
        def state_dict(self) -> dict[str, int]:
            return {"position": 3}

        def load_state_dict(self, state: dict[str, int]) -> None:
            pass

    assert iterable_dataset_state(WithState(), num_workers=0) == {"position": 3}
    assert iterable_dataset_state(WithState(), num_workers=2) is None
    assert iterable_dataset_state(Stream(), num_workers=0) is None


@pytest.mark.parametrize(
    ("strategy", "ranks", "warned"),
    [("group_by_length", 2, True), ("group_by_length", 1, False), ("random", 2, False)],
)
def test_group_by_length_says_its_order_differs_from_transformers_with_several_ranks(
    strategy: str, ranks: int, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """On one process the order is transformers' (the global RNG); with several ranks it is
    drawn from data_seed (the ranks must agree) and dealt in turn: said at start."""
    with caplog.at_level("WARNING", logger="trainer_runtime.data.arguments"):
        loader = build_train_dataloader(
            CountingDataset([3, 1, 2, 5]),
            Args(train_sampling_strategy=strategy),
            collate_fn=PaddingCollator(),
            seed=7,
            num_replicas=ranks,
        )
    said = "differs from transformers' with the same seed" in caplog.text
    assert said is warned, caplog.text
    global_order = getattr(loader.batch_sampler, "order_from_global_rng", False)
    assert global_order is (strategy == "group_by_length" and ranks == 1)
