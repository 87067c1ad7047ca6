from __future__ import annotations

import warnings

import pytest
import torch

from tests.unit.features.tiny_lm import TinyCausalLM, TinyClassifier, make_batches
from trainer_runtime.errors import ConfigurationError
from trainer_runtime.features.precision import (
    autocast_context,
    empty_device_cache,
    enable_activation_checkpointing,
    eval_dtype,
    maybe_compile,
    resolve_activation_checkpointing,
    set_tf32,
    should_empty_cache,
    validate_precision,
)

HAS_CUDA = torch.cuda.is_available()


@pytest.mark.parametrize(
    ("bf16", "fp16", "device", "match"),
    [
        (True, True, "cpu", "exclusive"),
        (False, True, "cpu", "fp16=True needs a CUDA device"),
        (False, True, "mps", "fp16=True needs a CUDA device"),
    ],
)
def test_precision_needing_missing_hardware_fails_clearly(bf16, fp16, device, match):
    with pytest.raises(ConfigurationError, match=match):
        validate_precision(bf16=bf16, fp16=fp16, device=device)


def test_bf16_autocast_on_cpu_trains():
    model = TinyCausalLM()
    batch = make_batches(1, 2, lengths=[5, 4])[0]
    with autocast_context(bf16=True, fp16=False, device="cpu"):
        out = model(**batch)
    assert out["logits"].dtype == torch.bfloat16  # the Linear ran in bfloat16
    out["loss"].float().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    with autocast_context(bf16=False, fp16=False, device="cpu"):
        assert model(**batch)["logits"].dtype == torch.float32


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_fp16_and_bf16_autocast_on_cuda():
    model = TinyCausalLM().cuda()
    batch = {k: v.cuda() for k, v in make_batches(1, 2, lengths=[5, 4])[0].items()}
    with autocast_context(bf16=False, fp16=True, device="cuda"):
        assert model(**batch)["logits"].dtype == torch.float16
    with autocast_context(bf16=True, fp16=False, device="cuda"):
        assert model(**batch)["logits"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("bf16", "fp16", "expected"),
    [(False, False, None), (True, False, torch.bfloat16), (False, True, torch.float16)],
)
def test_eval_dtype(bf16, fp16, expected):
    assert eval_dtype(bf16_full_eval=bf16, fp16_full_eval=fp16) == expected


def test_eval_dtype_exclusive():
    with pytest.raises(ConfigurationError, match="exclusive"):
        eval_dtype(bf16_full_eval=True, fp16_full_eval=True)


def test_tf32():
    set_tf32(None)  # leaves PyTorch's default
    set_tf32(False)
    assert torch.backends.cuda.matmul.allow_tf32 is False
    if not HAS_CUDA:
        with pytest.raises(ConfigurationError, match="tf32=True needs"):
            set_tf32(True)
    elif torch.cuda.get_device_capability()[0] >= 8:
        set_tf32(True)
        assert torch.backends.cuda.matmul.allow_tf32 is True
        set_tf32(False)


def test_gradient_checkpointing_alias_warns_and_maps():
    with pytest.warns(FutureWarning, match="deprecated"):
        enabled, kwargs = resolve_activation_checkpointing(
            None, None, True, {"use_reentrant": False}
        )
    assert enabled is True and kwargs == {"use_reentrant": False}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_activation_checkpointing(True, None, None, None) == (True, None)
        assert resolve_activation_checkpointing(None, None, None, None) == (False, None)
    with pytest.raises(ConfigurationError, match="contradicts"), pytest.warns(FutureWarning):
        resolve_activation_checkpointing(True, None, False, None)


def test_activation_checkpointing_recomputes_and_keeps_gradients():
    batch = make_batches(1, 3, lengths=[6, 2, 4])[0]

    def run(checkpointed: bool) -> tuple[list[torch.Tensor], int]:
        model = TinyCausalLM(layers=3)
        if checkpointed:
            assert enable_activation_checkpointing(model, {}) == "gradient_checkpointing_enable"
        model.train()
        model(**batch)["loss"].backward()
        return [p.grad.clone() for p in model.parameters()], sum(b.calls for b in model.blocks)

    plain_grads, plain_calls = run(False)
    ckpt_grads, ckpt_calls = run(True)
    assert plain_calls == 3
    assert ckpt_calls == 6  # each block's forward ran again during backward
    for a, b in zip(plain_grads, ckpt_grads, strict=True):
        torch.testing.assert_close(a, b)


def test_activation_checkpointing_without_model_support_is_an_error():
    with pytest.raises(ConfigurationError, match="gradient_checkpointing_enable"):
        enable_activation_checkpointing(TinyClassifier())


def test_torch_compile_options():
    model = TinyClassifier()
    assert maybe_compile(model, torch_compile=False) is model
    compiled = maybe_compile(model, torch_compile=False, backend="eager")  # backend implies compile
    assert compiled is not model
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(compiled(ids)["logits"], model(ids)["logits"])
    with pytest.raises(ConfigurationError, match="torch_compile_backend='nope'"):
        maybe_compile(model, torch_compile=True, backend="nope")
    with pytest.raises(ConfigurationError, match="torch_compile_mode='fastest'"):
        maybe_compile(model, torch_compile=True, mode="fastest")


@pytest.mark.parametrize(
    ("step", "every", "expected"), [(10, 5, True), (11, 5, False), (10, None, False), (3, 1, True)]
)
def test_should_empty_cache(step, every, expected):
    assert should_empty_cache(step, every) is expected


def test_empty_device_cache():
    assert empty_device_cache("cpu") is False
    if HAS_CUDA:
        assert empty_device_cache("cuda") is True


class _Recorder(torch.nn.Module):
    """Records the keyword arguments its checkpointing method received."""

    calls: list[tuple[str, dict[str, object]]]

    def __init__(self) -> None:
        super().__init__()
        self.calls = []


class _TransformersStyle(_Recorder):
    # transformers 5.x PreTrainedModel.activation_checkpointing_enable
    def activation_checkpointing_enable(
        self,
        activation_checkpointing_kwargs: dict[str, object] | None = None,
        every_n_layers: int = 1,
        offload: bool = False,
    ) -> None:
        self.calls.append(
            (
                "activation_checkpointing_enable",
                {
                    "activation_checkpointing_kwargs": activation_checkpointing_kwargs,
                    "every_n_layers": every_n_layers,
                    "offload": offload,
                },
            )
        )

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: object = None) -> None:
        raise AssertionError("the deprecated method must not be called when the new one exists")


class _OwnStyle(_Recorder):
    # A plain module with its own method taking the older keyword.
    def activation_checkpointing_enable(self, gradient_checkpointing_kwargs: object = None) -> None:
        self.calls.append(("own", {"gradient_checkpointing_kwargs": gradient_checkpointing_kwargs}))


def test_transformers_models_get_activation_checkpointing_kwargs_and_options():
    model = _TransformersStyle()
    name = enable_activation_checkpointing(
        model, {"use_reentrant": False, "every_n_layers": 2, "offload": True}
    )
    assert name == "activation_checkpointing_enable"
    assert model.calls == [
        (
            "activation_checkpointing_enable",
            {
                "activation_checkpointing_kwargs": {"use_reentrant": False},
                "every_n_layers": 2,
                "offload": True,
            },
        )
    ]
    model = _TransformersStyle()
    enable_activation_checkpointing(model, None)
    assert model.calls[0][1]["activation_checkpointing_kwargs"] is None  # as transformers


def test_plain_modules_keep_their_own_keyword():
    model = _OwnStyle()
    enable_activation_checkpointing(model, {"use_reentrant": True})
    assert model.calls == [("own", {"gradient_checkpointing_kwargs": {"use_reentrant": True}})]
    with pytest.raises(ConfigurationError, match="every_n_layers"):
        enable_activation_checkpointing(_OwnStyle(), {"every_n_layers": 2})
