"""The defaults the operator's environment decides (output_dir, enable_jit_checkpoint,
jit_stop_policy) are the same however the arguments are built: directly, by transformers'
``HfArgumentParser`` from a command line, a JSON or YAML file or a dict, or from a saved
``training_args.json``; a value given explicitly (``--enable_jit_checkpoint false``) wins.

transformers' parser gives a ``bool`` field whose default comes from a ``default_factory`` the
default False: before the fix, every script that parses its arguments got no JIT checkpoint under
the operator (issue 37, item 0).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="the parser is transformers' HfArgumentParser")
yaml = pytest.importorskip("yaml")

from transformers import HfArgumentParser  # noqa: E402

import trainer_runtime  # noqa: E402
from trainer_runtime import protocol  # noqa: E402
from trainer_runtime.protocol import ENV_OUTPUT_DIR, ENV_STOP_POLICY  # noqa: E402
from trainer_runtime.training_args import (  # noqa: E402
    ENV_DEFAULTS,
    TrainingArguments,
    TrainingArgumentsSchema,
)
from trainer_runtime.training_args_seq2seq import Seq2SeqTrainingArguments  # noqa: E402

ENV_FIELDS = ("output_dir", "enable_jit_checkpoint", "jit_stop_policy")

# name -> the operator's environment (PREEMPTIBLE_* variables) of that case
ENVIRONMENTS: dict[str, dict[str, str]] = {
    "local": {},
    "operator": {ENV_OUTPUT_DIR: "/ckpt/job"},
    "operator with a stop policy": {ENV_OUTPUT_DIR: "/ckpt/job", ENV_STOP_POLICY: "micro_batch"},
}
# name -> the values a script gives explicitly
EXPLICIT: dict[str, dict[str, Any]] = {
    "nothing": {},
    "jit off": {"enable_jit_checkpoint": False},
    "jit on": {"enable_jit_checkpoint": True},
    "policy": {"jit_stop_policy": "finish_step"},
    "output dir": {"output_dir": "/mine"},
}
LOCAL_OUTPUT_DIR = "/local"  # without the operator output_dir is required


def _expected(env: dict[str, str], explicit: dict[str, Any]) -> dict[str, Any]:
    """Written out here (not taken from the code under test)."""
    operator = ENV_OUTPUT_DIR in env
    return {
        "output_dir": explicit.get("output_dir", env.get(ENV_OUTPUT_DIR, LOCAL_OUTPUT_DIR)),
        "enable_jit_checkpoint": explicit.get("enable_jit_checkpoint", operator),
        "jit_stop_policy": explicit.get("jit_stop_policy", env.get(ENV_STOP_POLICY, "finish_step")),
    }


def _given(env: dict[str, str], explicit: dict[str, Any]) -> dict[str, Any]:
    if ENV_OUTPUT_DIR in env or "output_dir" in explicit:
        return dict(explicit)
    return {"output_dir": LOCAL_OUTPUT_DIR, **explicit}


def _argv(values: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for name, value in values.items():
        out += [f"--{name}", str(value).lower() if isinstance(value, bool) else str(value)]
    return out


def _direct(cls: type, values: dict[str, Any], tmp: Path) -> Any:
    return cls(**values)


def _command_line(cls: type, values: dict[str, Any], tmp: Path) -> Any:
    (args,) = HfArgumentParser(cls).parse_args_into_dataclasses(args=_argv(values))
    return args


def _command_line_bare_flag(cls: type, values: dict[str, Any], tmp: Path) -> Any:
    """``--enable_jit_checkpoint`` without a value means True (argparse ``const``)."""
    argv = [
        *(["--enable_jit_checkpoint"] if values.get("enable_jit_checkpoint") is True else []),
        *_argv({k: v for k, v in values.items() if k != "enable_jit_checkpoint" or v is False}),
    ]
    (args,) = HfArgumentParser(cls).parse_args_into_dataclasses(args=argv)
    return args


def _json_file(cls: type, values: dict[str, Any], tmp: Path) -> Any:
    path = tmp / "args.json"
    path.write_text(json.dumps(values))
    (args,) = HfArgumentParser(cls).parse_json_file(str(path))
    return args


def _yaml_file(cls: type, values: dict[str, Any], tmp: Path) -> Any:
    path = tmp / "args.yaml"
    path.write_text(yaml.safe_dump(values))
    (args,) = HfArgumentParser(cls).parse_yaml_file(str(path))
    return args


def _dict(cls: type, values: dict[str, Any], tmp: Path) -> Any:
    (args,) = HfArgumentParser(cls).parse_dict(values)
    return args


def _saved_training_args_json(cls: type, values: dict[str, Any], tmp: Path) -> Any:
    """A checkpoint's training_args.json (``to_dict()``) read back, in the same environment."""
    path = tmp / "training_args.json"
    path.write_text(json.dumps(cls(**values).to_dict()))
    return cls(**json.loads(path.read_text()))


def _saved_training_args_json_parsed(cls: type, values: dict[str, Any], tmp: Path) -> Any:
    path = tmp / "training_args.json"
    path.write_text(json.dumps(cls(**values).to_dict()))
    (args,) = HfArgumentParser(cls).parse_json_file(str(path))
    return args


WAYS: dict[str, Callable[[type, dict[str, Any], Path], Any]] = {
    "direct": _direct,
    "command line": _command_line,
    "command line, bare flag": _command_line_bare_flag,
    "json file": _json_file,
    "yaml file": _yaml_file,
    "dict": _dict,
    "saved training_args.json": _saved_training_args_json,
    "saved training_args.json, parsed": _saved_training_args_json_parsed,
}


def _set_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for name in (ENV_OUTPUT_DIR, ENV_STOP_POLICY):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("cls", [TrainingArguments, Seq2SeqTrainingArguments])
@pytest.mark.parametrize("explicit", list(EXPLICIT))
@pytest.mark.parametrize("env_name", list(ENVIRONMENTS))
@pytest.mark.parametrize("way", list(WAYS))
def test_environment_defaults_are_the_same_every_way(
    way: str,
    env_name: str,
    explicit: str,
    cls: type,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    env = ENVIRONMENTS[env_name]
    _set_env(monkeypatch, env)
    args = WAYS[way](cls, _given(env, EXPLICIT[explicit]), tmp_path)
    assert type(args) is cls
    got = {name: getattr(args, name) for name in ENV_FIELDS}
    assert got == _expected(env, EXPLICIT[explicit])
    # resolved, never the marker: code reading the attribute sees a plain value
    assert type(args.enable_jit_checkpoint) is bool


def test_the_parser_is_transformers_own() -> None:
    # Scripts import HfArgumentParser from transformers: we do not export one of our own.
    assert "HfArgumentParser" not in trainer_runtime.__all__


def test_parser_is_made_before_the_environment_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default is read when the arguments are built, not when the parser is made."""
    _set_env(monkeypatch, {})
    parser = HfArgumentParser(TrainingArguments)
    _set_env(monkeypatch, {ENV_OUTPUT_DIR: "/ckpt/late", ENV_STOP_POLICY: "micro_batch"})
    (args,) = parser.parse_args_into_dataclasses(args=[])
    assert (args.output_dir, args.enable_jit_checkpoint, args.jit_stop_policy) == (
        "/ckpt/late",
        True,
        "micro_batch",
    )


@pytest.mark.parametrize(
    ("env", "shown"),
    [
        (
            {},
            {
                "output_dir": "(default: $PREEMPTIBLE_OUTPUT_DIR, else required; here None)",
                "enable_jit_checkpoint": "(default: True when $PREEMPTIBLE_OUTPUT_DIR is set, "
                "else False; here False)",
                "jit_stop_policy": "(default: $PREEMPTIBLE_STOP_POLICY, else 'finish_step'; "
                "here 'finish_step')",
            },
        ),
        (
            {ENV_OUTPUT_DIR: "/ckpt/job", ENV_STOP_POLICY: "micro_batch"},
            {
                "output_dir": "here '/ckpt/job')",
                "enable_jit_checkpoint": "here True)",
                "jit_stop_policy": "here 'micro_batch')",
            },
        ),
    ],
)
def test_help_shows_how_the_default_is_decided(
    env: dict[str, str], shown: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _set_env(monkeypatch, env)
    text = HfArgumentParser(TrainingArguments).format_help()
    for name, expected in shown.items():
        entry = " ".join(text.split(f"\n  --{name} ", 1)[1].split("\n  --", 1)[0].split())
        assert expected in entry, entry
        # before the fix: "(default: False)" for a True default under the operator
        assert "(default: False)" not in entry, entry


def test_every_default_that_reads_the_environment_is_decided_at_build_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No other field's default changes with the operator's environment (a new one that does
    must be listed in ENV_DEFAULTS, or HfArgumentParser would freeze or lose it)."""

    def defaults() -> dict[str, Any]:
        out = {}
        for name, info in TrainingArgumentsSchema.model_fields.items():
            if info.default_factory is not None:
                value = info.default_factory()  # type: ignore[call-arg]
                out[name] = value.model_dump() if hasattr(value, "model_dump") else value
        return out

    _set_env(monkeypatch, {})
    for name in list(os.environ):
        if name.startswith("PREEMPTIBLE_"):
            monkeypatch.delenv(name)
    unset = defaults()
    for name in protocol.__all__:
        if name.startswith("ENV_"):
            var = getattr(protocol, name)
            monkeypatch.setenv(var, "micro_batch" if var == ENV_STOP_POLICY else "7")
    changed = {name for name, value in defaults().items() if unset[name] != value}
    assert changed == set(ENV_DEFAULTS) == set(ENV_FIELDS)
    fields = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    for name in ENV_DEFAULTS:
        assert fields[name].default is ENV_DEFAULTS[name]
        assert fields[name].default_factory is dataclasses.MISSING
