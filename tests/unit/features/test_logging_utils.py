from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from trainer_runtime.errors import ConfigurationError
from trainer_runtime.features.logging_utils import (
    TrainLossTracker,
    apply_log_level,
    count_input_tokens,
    log_metrics,
    metrics_format,
    normalize_tokens_seen_mode,
    process_log_level,
    resolve_interval,
    save_metrics,
    should_log_at_epoch_end,
    should_log_at_step,
    speed_metrics,
    validate_interval,
)


@pytest.mark.parametrize(
    ("strategy", "step", "every", "first", "expected"),
    [
        ("steps", 50, 50, False, True),
        ("steps", 51, 50, False, False),
        ("steps", 1, 50, True, True),
        ("steps", 1, 50, False, False),
        ("epoch", 50, 50, False, False),
        ("epoch", 1, 50, True, True),  # logging_first_step applies whatever the strategy
        ("no", 50, 50, False, False),
    ],
)
def test_should_log_at_step(strategy, step, every, first, expected):
    assert should_log_at_step(strategy, step, every, first) is expected


@pytest.mark.parametrize(
    ("strategy", "expected"), [("epoch", True), ("steps", False), ("no", False)]
)
def test_should_log_at_epoch_end(strategy, expected):
    assert should_log_at_epoch_end(strategy) is expected


@pytest.mark.parametrize(
    ("value", "max_steps", "expected"),
    [(50, 1000, 50), (0.1, 1000, 100), (0.1, 15, 2), (0.001, 10, 1)],
)
def test_resolve_interval_int_or_ratio(value, max_steps, expected):
    assert resolve_interval(validate_interval("logging_steps", value), max_steps) == expected


@pytest.mark.parametrize("value", [0, -1, 1.5, math.nan, True, "10"])
def test_validate_interval_rejects(value):
    with pytest.raises(ConfigurationError, match="logging_steps"):
        validate_interval("logging_steps", value)


def test_ratio_interval_needs_max_steps():
    with pytest.raises(ConfigurationError, match="max_steps"):
        resolve_interval(0.5, -1)


def test_loss_tracker_filters_nan_inf_from_logs_only():
    t = TrainLossTracker(nan_inf_filter=True)
    for v in (1.0, float("nan"), 3.0, float("inf")):
        t.add(v)
    assert t.pop_mean() == pytest.approx(2.0)  # mean of the valid recent losses
    assert t.filtered == 2
    t.add(4.0)
    assert t.pop_mean() == 4.0
    assert t.pop_mean() is None
    assert t.run_mean == pytest.approx((2.0 * 4 + 4.0) / 5)

    raw = TrainLossTracker(nan_inf_filter=False)
    raw.add(1.0)
    raw.add(float("nan"))
    assert math.isnan(raw.pop_mean())


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (True, "all"),
        (False, "no"),
        (None, "no"),
        ("all", "all"),
        ("non_padding", "non_padding"),
        ("no", "no"),
    ],
)
def test_tokens_seen_mode(value, expected):
    assert normalize_tokens_seen_mode(value) == expected


def test_tokens_seen_mode_rejects():
    with pytest.raises(ConfigurationError, match="include_num_input_tokens_seen"):
        normalize_tokens_seen_mode("some")


def test_count_input_tokens():
    ids = torch.tensor([[5, 6, 0, 0], [7, 0, 0, 0]])
    mask = (ids != 0).long()
    assert count_input_tokens({"input_ids": ids}, "all") == 8
    assert count_input_tokens({"input_ids": ids, "attention_mask": mask}, "non_padding") == 3
    assert count_input_tokens({"input_ids": ids}, "non_padding", pad_token_id=0) == 3
    assert count_input_tokens({"input_ids": ids}, "no") == 0
    with pytest.raises(ConfigurationError, match="input_ids"):
        count_input_tokens({"x": ids}, "all")


@pytest.mark.parametrize(
    ("main", "replica", "pidx", "lidx", "each_node", "expected"),
    [
        ("info", "warning", 0, 0, True, logging.INFO),
        ("info", "warning", 3, 1, True, logging.WARNING),
        ("info", "error", 4, 0, True, logging.INFO),  # main process of another node
        ("info", "error", 4, 0, False, logging.ERROR),  # only the global main logs at log_level
        ("passive", "warning", 0, 0, True, logging.DEBUG),  # keeps current
        ("debug", "passive", 1, 1, True, logging.DEBUG),
    ],
)
def test_process_log_level(main, replica, pidx, lidx, each_node, expected):
    got = process_log_level(
        main,
        replica,
        process_index=pidx,
        local_process_index=lidx,
        log_on_each_node=each_node,
        current_level=logging.DEBUG,
    )
    assert got == expected


def test_passive_leaves_logging_alone_by_default():
    got = process_log_level(
        "passive", "passive", process_index=0, local_process_index=0, log_on_each_node=True
    )
    assert got is None


def test_process_log_level_rejects_unknown_and_apply():
    with pytest.raises(ConfigurationError, match="log_level_replica"):
        process_log_level(
            "info",
            "loud",
            process_index=0,
            local_process_index=0,
            log_on_each_node=True,
            current_level=0,
        )
    apply_log_level(logging.ERROR, ("trainer_runtime.test_probe",))
    assert logging.getLogger("trainer_runtime.test_probe").level == logging.ERROR


def test_metrics_format_and_log_metrics():
    metrics = {
        "train_runtime": 65.25,
        "train_mem_cpu_alloc_delta": 5 << 20,
        "total_flos": 3 << 30,
        "eval_loss": 0.123456,
        "epoch": 2,
    }
    assert metrics_format(metrics) == {
        "train_runtime": "0:01:05.25",
        "train_mem_cpu_alloc_delta": "5MB",
        "total_flos": "3GF",
        "eval_loss": 0.1235,
        "epoch": 2,
    }
    lines: list[str] = []
    log_metrics("train", metrics, print_fn=lines.append)
    assert lines[0] == "***** train metrics *****"
    assert lines[1].startswith("  epoch ") and lines[1].endswith(" 2")
    assert len({line.index("=") for line in lines[1:]}) == 1  # aligned
    silent: list[str] = []
    log_metrics("train", metrics, is_world_process_zero=False, print_fn=silent.append)
    assert silent == []


def test_save_metrics_split_and_combined(tmp_path):
    out = str(tmp_path / "run")
    save_metrics("train", {"train_loss": 1.5}, out)
    save_metrics("eval", {"eval_loss": 2.0}, out)
    save_metrics("test", {"test_loss": 3.0}, out, combined=False)
    assert json.loads((tmp_path / "run" / "train_results.json").read_text()) == {"train_loss": 1.5}
    assert json.loads((tmp_path / "run" / "all_results.json").read_text()) == {
        "train_loss": 1.5,
        "eval_loss": 2.0,
    }
    assert save_metrics("eval", {"x": 1}, out, is_world_process_zero=False) is None
    # any fsspec URL works (through trainer_runtime.checkpoint.storage)
    save_metrics("eval", {"eval_loss": 2.0}, "memory://g-features/run")
    from trainer_runtime.checkpoint.storage import Storage

    assert Storage("memory://g-features/run").read_json("eval_results.json") == {"eval_loss": 2.0}


def test_speed_metrics():
    clock = iter([12.0])
    got = speed_metrics("eval", 10.0, num_samples=100, num_steps=10, now=lambda: next(clock))
    assert got == {
        "eval_runtime": 2.0,
        "eval_samples_per_second": 50.0,
        "eval_steps_per_second": 5.0,
    }
