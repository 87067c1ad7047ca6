"""fsdp / fsdp_config: accepted values, refusals naming field, value and fix, and the FsdpConfig
settings the Trainer derives from them."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from trainer_runtime.distributed.fsdp_args import check_fsdp_runtime, fsdp_settings
from trainer_runtime.errors import ConfigurationError
from trainer_runtime.training_args import TrainingArguments


def _args(**kw: Any) -> TrainingArguments:
    return TrainingArguments(output_dir="/tmp/fsdp-args-test", **kw)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, []),
        (False, []),
        ("", []),
        (True, ["full_shard"]),
        ("full_shard", ["full_shard"]),
        ("full_shard auto_wrap", ["full_shard", "auto_wrap"]),
        ("  SHARD_GRAD_OP   offload ", ["shard_grad_op", "offload"]),
        (["full_shard", "auto_wrap", "full_shard"], ["full_shard", "auto_wrap"]),
        ("auto_wrap", ["auto_wrap"]),
    ],
)
def test_fsdp_accepted_values(value: Any, expected: list[str]) -> None:
    assert _args(fsdp=value).fsdp == expected


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("hybrid_shard", "2-D device mesh"),
        ("hybrid_shard_zero2 auto_wrap", "2-D device mesh"),
        ("no_shard", "leave fsdp unset to train with DDP"),
        ("full_shard shard_grad_op", "exclusive sharding strategies"),
        ("full_sharding", "unknown option 'full_sharding'; use any of full_shard"),
        (3, "space-separated string"),
    ],
)
def test_fsdp_refused_values_name_field_value_and_fix(value: Any, needle: str) -> None:
    with pytest.raises(ConfigurationError) as err:
        _args(fsdp=value)
    text = str(err.value)
    assert f"fsdp={value!r}" in text, text
    assert needle in text, text


@pytest.mark.parametrize(
    ("config", "key", "value"),
    [
        ({"min_num_params": 1000}, "min_num_params", 1000),
        ({"fsdp_min_num_params": 1000}, "min_num_params", 1000),
        (
            {"transformer_layer_cls_to_wrap": "Block, Layer"},
            "transformer_layer_cls_to_wrap",
            ["Block", "Layer"],
        ),
        ({"transformer_layer_cls_to_wrap": ["Block"]}, "transformer_layer_cls_to_wrap", ["Block"]),
        ({"backward_prefetch": "BACKWARD_PRE"}, "backward_prefetch", "backward_pre"),
        ({"use_orig_params": True, "limit_all_gathers": True}, "use_orig_params", True),
        ({"state_dict_type": "SHARDED_STATE_DICT"}, "state_dict_type", "SHARDED_STATE_DICT"),
        ({"cpu_ram_efficient_loading": True}, "cpu_ram_efficient_loading", True),
        ({"version": 2, "reshard_after_forward": False}, "reshard_after_forward", False),
        ({"auto_wrap_policy": "NO_WRAP"}, "auto_wrap_policy", "NO_WRAP"),
    ],
)
def test_fsdp_config_accepted_keys(config: dict[str, Any], key: str, value: Any) -> None:
    args = _args(
        fsdp="shard_grad_op" if key == "reshard_after_forward" else True, fsdp_config=config
    )
    assert getattr(args.fsdp_config, key) == value


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        (
            {"min_num_param": 10},
            "fsdp_config.min_num_param: unknown key; did you mean 'min_num_params'?",
        ),
        ({"bogus": 1}, "fsdp_config.bogus: unknown key; remove it"),
        ({"version": 1}, "only FSDP2 (fully_shard) is supported; use version=2"),
        ({"use_orig_params": False}, "FSDP2 always keeps the original parameters"),
        ({"forward_prefetch": True}, "forward_prefetch=True is not supported"),
        ({"backward_prefetch": "BACKWARD_POST"}, "use 'backward_pre' or leave it unset"),
        ({"limit_all_gathers": False}, "limit_all_gathers=False"),
        ({"xla": True}, "PyTorch/XLA"),
        ({"state_dict_type": "LOCAL_STATE_DICT"}, "fsdp_config.state_dict_type"),
        ({"auto_wrap_policy": "SIZE_BASED_WRAP"}, "needs min_num_params > 0"),
        ({"auto_wrap_policy": "NO_WRAP", "activation_checkpointing": True}, "wraps none"),
        (
            {"cpu_ram_efficient_loading": True, "sync_module_states": False},
            "needs sync_module_states=True",
        ),
        ({"min_num_params": 5, "fsdp_min_num_params": 6}, "given twice"),
        ({"min_num_params": -1}, "fsdp_config.min_num_params"),
        ({"reshard_after_forward": False}, "fsdp='full_shard' means reshard_after_forward=True"),
        ("{not json", "not valid JSON"),
        ("/no/such/fsdp_config.json", "neither a JSON object nor the path"),
    ],
)
def test_fsdp_config_refusals(config: Any, needle: str) -> None:
    with pytest.raises(ConfigurationError) as err:
        _args(fsdp="full_shard", fsdp_config=config)
    assert "fsdp_config" in str(err.value)
    assert needle in str(err.value), str(err.value)


def test_fsdp_config_from_json_file_and_string(tmp_path: Path) -> None:
    path = tmp_path / "fsdp_config.json"
    path.write_text(
        json.dumps({"fsdp_min_num_params": 64, "state_dict_type": "SHARDED_STATE_DICT"})
    )
    from_file = _args(fsdp="full_shard auto_wrap", fsdp_config=str(path)).fsdp_config
    from_text = _args(fsdp="full_shard auto_wrap", fsdp_config=path.read_text()).fsdp_config
    assert from_file == from_text
    assert from_file is not None and from_file.min_num_params == 64


def test_fsdp_config_without_fsdp_warns_and_is_ignored() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = _args(fsdp_config={"min_num_params": 10})
    assert any("fsdp_config is set but fsdp is not" in str(w.message) for w in caught)
    assert fsdp_settings(args) is None


def test_arguments_round_trip_through_json() -> None:
    args = _args(fsdp="shard_grad_op auto_wrap", fsdp_config={"min_num_params": 10})
    again = TrainingArguments(**json.loads(args.to_json_string()))
    assert again.fsdp == args.fsdp and again.fsdp_config == args.fsdp_config


_BASE = {
    "reshard_after_forward": True,
    "cpu_offload": False,
    "wrap": "none",
    "layer_classes": (),
    "min_num_params": 0,
    "sync_module_states": True,
    "activation_checkpointing": False,
}


@pytest.mark.parametrize(
    ("fsdp", "config", "changes"),
    [
        ("", None, None),
        ("full_shard", None, {}),
        (True, None, {}),
        ("shard_grad_op", None, {"reshard_after_forward": False}),
        ("auto_wrap", None, {"wrap": "transformer"}),
        ("full_shard auto_wrap", {"min_num_params": 100}, {"wrap": "size", "min_num_params": 100}),
        (
            "full_shard auto_wrap",
            {"transformer_layer_cls_to_wrap": ["Block"]},
            {"wrap": "transformer", "layer_classes": ("Block",)},
        ),
        (
            "full_shard",
            {"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 5},
            {"wrap": "size", "min_num_params": 5},
        ),
        ("full_shard auto_wrap", {"auto_wrap_policy": "NO_WRAP"}, {}),
        ("full_shard offload", None, {"cpu_offload": True}),
        ("full_shard", {"cpu_offload": True}, {"cpu_offload": True}),
        ("full_shard", {"sync_module_states": False}, {"sync_module_states": False}),
        (
            "full_shard auto_wrap",
            {"min_num_params": 10, "activation_checkpointing": True},
            {"wrap": "size", "min_num_params": 10, "activation_checkpointing": True},
        ),
        (
            "auto_wrap",
            {"reshard_after_forward": False, "min_num_params": 1},
            {"reshard_after_forward": False, "wrap": "size", "min_num_params": 1},
        ),
    ],
)
def test_fsdp_settings_table(fsdp: Any, config: Any, changes: dict[str, Any] | None) -> None:
    settings = fsdp_settings(_args(fsdp=fsdp, fsdp_config=config))
    assert settings == (None if changes is None else {**_BASE, **changes})


def test_activation_checkpointing_without_wrapping_is_refused() -> None:
    args = _args(fsdp="full_shard", fsdp_config={"activation_checkpointing": True})
    with pytest.raises(ConfigurationError, match="add 'auto_wrap' to fsdp"):
        fsdp_settings(args)


@pytest.mark.parametrize(
    ("kw", "runtime", "needle"),
    [
        ({}, {"world_size": 1}, "sharding needs at least 2 ranks"),
        ({"fsdp": "full_shard offload"}, {}, "fsdp='... offload' needs CUDA devices"),
        ({"fsdp_config": {"cpu_offload": True}}, {}, "fsdp_config.cpu_offload=True needs CUDA"),
        ({"ddp_backend": "nccl"}, {}, "use ddp_backend='gloo'"),
        ({"bf16": True, "use_cpu": True}, {}, "bf16=False, fp16=False"),
        ({"torch_compile": True}, {}, "torch_compile=False"),
        ({}, {"user_optimizer": True}, "let the Trainer build it"),
    ],
)
def test_runtime_refusals_on_cpu(kw: dict[str, Any], runtime: dict[str, Any], needle: str) -> None:
    args = _args(**{"fsdp": "full_shard", **kw})
    with pytest.raises(ConfigurationError) as err:
        check_fsdp_runtime(args, **{"world_size": 2, "cuda": False, **runtime})
    assert needle in str(err.value), str(err.value)
    assert "fsdp" in str(err.value)


@pytest.mark.parametrize(
    ("kw", "cuda"),
    [
        ({"fsdp": ""}, False),  # FSDP off: nothing to check
        ({"fsdp": "full_shard auto_wrap"}, False),
        ({"fsdp": "shard_grad_op offload", "ddp_backend": "nccl"}, True),
        ({"fsdp": "full_shard", "fsdp_config": {"cpu_offload": True}}, True),
    ],
)
def test_runtime_accepts(kw: dict[str, Any], cuda: bool) -> None:
    check_fsdp_runtime(_args(**kw), world_size=2, cuda=cuda)


def test_fsdp_args_module_is_torch_free() -> None:
    code = "import trainer_runtime.distributed.fsdp_args, sys; assert 'torch' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
