"""Seq2SeqTrainer: the Trainer whose evaluate/predict can run ``model.generate``.

Behaviour of transformers 5.x's ``Seq2SeqTrainer`` (same names, signatures and results):

* ``evaluate`` / ``predict`` take ``**gen_kwargs`` for ``generate``; ``max_length`` comes from
  ``args.generation_max_length`` unless ``max_length`` or ``max_new_tokens`` is passed, and
  ``num_beams`` from ``args.generation_num_beams`` unless passed. The resolved kwargs are used by
  every ``prediction_step`` of that call, including the periodic evaluations during training.
* With ``args.predict_with_generate`` (and not ``prediction_loss_only``) ``prediction_step``
  returns the generated token ids as predictions, right-padded with the pad token to the
  generation config's ``max_length`` (or ``max_new_tokens + 1``), and the labels padded the same
  way; the loss is still computed by a forward pass when the batch has labels. Batches whose
  predictions still differ in length are joined by the evaluation loop with -100 padding.
* ``args.generation_config`` (a GenerationConfig, a directory, a JSON file or a model id)
  replaces ``model.generation_config`` when the trainer is created (``load_generation_config``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from copy import deepcopy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer_runtime.distributed import collectives
from trainer_runtime.errors import ConfigurationError
from trainer_runtime.trainer import Trainer
from trainer_runtime.trainer_utils import PredictionOutput
from trainer_runtime.training_args_seq2seq import Seq2SeqTrainingArguments, is_generation_config

__all__ = ["Seq2SeqTrainer", "Seq2SeqTrainingArguments"]

logger = logging.getLogger(__name__)

# generate()'s max_length when neither the model's generation config nor the call sets one.
_DEFAULT_MAX_LENGTH = 20


class Seq2SeqTrainer(Trainer):
    """A :class:`~trainer_runtime.Trainer` for encoder-decoder (and other generative) models:
    with ``Seq2SeqTrainingArguments(predict_with_generate=True)`` evaluation and prediction
    generate, so ``compute_metrics`` receives generated token ids. Takes the Trainer's
    arguments."""

    # transformers' Seq2SeqTrainer gathers each batch's loss repeated eval_batch_size times with
    # no trimming, so a short last batch weighs as a full one: eval_loss is the mean of the
    # batch losses. Same here, so eval_loss (and metric_for_best_model="loss") agree.
    _eval_loss_weighting = "batch"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if getattr(self.args, "sortish_sampler", False):
            logger.warning(
                "sortish_sampler=True has no effect (as in transformers 5.x); set "
                "group_by_length=True for batches of similar lengths"
            )
        # Priority: args.generation_config > the model's own > generate()'s defaults.
        gen_config = getattr(self.args, "generation_config", None)
        if gen_config is not None:
            self.model.generation_config = self.load_generation_config(gen_config)

    @staticmethod
    def load_generation_config(gen_config_arg: Any) -> Any:
        """A ``GenerationConfig`` from ``Seq2SeqTrainingArguments.generation_config``: a copy of a
        given one, else loaded from a JSON file, a directory or a model id; checked strictly
        now, since saving it at the end of training would fail on the same problems."""
        from transformers import GenerationConfig

        if is_generation_config(gen_config_arg):
            config = deepcopy(gen_config_arg)
        else:
            path = Path(gen_config_arg)
            if path.is_file():
                config = GenerationConfig.from_pretrained(path.parent, path.name)
            elif path.is_dir():
                config = GenerationConfig.from_pretrained(path)
            else:  # a model id (or URL): resolved by transformers / the Hub cache
                config = GenerationConfig.from_pretrained(str(gen_config_arg))
        try:
            config.validate(strict=True)
        except ValueError as exc:
            raise ConfigurationError(
                f"generation_config={gen_config_arg!r} is invalid: {exc}\n\nFix these issues "
                "to train your model."
            ) from None
        return config

    # -- evaluate / predict ------------------------------------------------------------------------
    def _resolve_gen_kwargs(self, gen_kwargs: dict[str, Any]) -> dict[str, Any]:
        """``gen_kwargs`` with max_length / num_beams from the arguments where not given."""
        resolved = dict(gen_kwargs)
        max_length = getattr(self.args, "generation_max_length", None)
        if (
            resolved.get("max_length") is None
            and resolved.get("max_new_tokens") is None
            and max_length is not None
        ):
            resolved["max_length"] = max_length
        num_beams = getattr(self.args, "generation_num_beams", None)
        if resolved.get("num_beams") is None and num_beams is not None:
            resolved["num_beams"] = num_beams
        return resolved

    def evaluate(
        self,
        eval_dataset: Any = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
        **gen_kwargs: Any,
    ) -> dict[str, float]:
        """Evaluate (see Trainer.evaluate); ``gen_kwargs`` (``max_length``, ``num_beams``, any
        ``generate`` option) apply when ``predict_with_generate`` is set."""
        self._gen_kwargs = self._resolve_gen_kwargs(gen_kwargs)
        return super().evaluate(
            eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix
        )

    def predict(
        self,
        test_dataset: Any,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "test",
        **gen_kwargs: Any,
    ) -> PredictionOutput:
        """Predict (see Trainer.predict); with ``predict_with_generate`` the predictions are
        generated token ids, right-padded (pad token within a batch, -100 across batches)."""
        self._gen_kwargs = self._resolve_gen_kwargs(gen_kwargs)
        return super().predict(
            test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix
        )

    # -- one batch ---------------------------------------------------------------------------------
    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
        **gen_kwargs: Any,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """(loss, generated ids, padded labels) with ``predict_with_generate``; otherwise the
        Trainer's step (loss, logits, labels)."""
        if not getattr(self.args, "predict_with_generate", False) or prediction_loss_only:
            return super().prediction_step(
                model, inputs, prediction_loss_only=prediction_loss_only, ignore_keys=ignore_keys
            )
        has_labels = "labels" in inputs
        inputs = self._prepare_inputs(inputs)
        # Explicit gen_kwargs win; else those evaluate()/predict() resolved.
        if not gen_kwargs:
            gen_kwargs = dict(getattr(self, "_gen_kwargs", {}))
        gen_kwargs = {
            k: v
            for k, v in gen_kwargs.items()
            if not (k in ("num_beams", "max_length") and v is None)
        }
        # Sharded (FSDP) ranks must step through generate together until all are done.
        gen_kwargs.setdefault(
            "synced_gpus",
            bool(getattr(self, "is_fsdp_enabled", False)) and collectives.is_distributed(),
        )
        generated = self._generate(self._generation_inputs(inputs), gen_kwargs)
        max_length, max_new_tokens = self._padding_lengths()
        generated = self._pad_to_generation_length(generated, max_length, max_new_tokens)

        loss = None
        if has_labels:
            with torch.no_grad(), self.autocast_smart_context_manager():
                outputs = model(**inputs)
            if self.label_smoother is not None:
                loss = self.label_smoother(outputs, inputs["labels"]).detach().mean()
            else:
                first = outputs["loss"] if isinstance(outputs, Mapping) else outputs[0]
                loss = first.detach().mean()
        if self.args.prediction_loss_only:
            return loss, None, None
        labels = None
        if has_labels:
            labels = self._pad_to_generation_length(inputs["labels"], max_length, max_new_tokens)
        return loss, generated, labels

    @staticmethod
    def _generation_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
        """The inputs of ``generate``: without decoder inputs a collator derived from the labels
        (same shape), which would make generate continue the reference instead of starting
        from scratch."""
        labels = inputs.get("labels")
        decoder_ids = inputs.get("decoder_input_ids")
        if (
            isinstance(labels, torch.Tensor)
            and isinstance(decoder_ids, torch.Tensor)
            and labels.shape == decoder_ids.shape
        ):
            return {
                k: v
                for k, v in inputs.items()
                if k not in ("decoder_input_ids", "decoder_attention_mask")
            }
        return dict(inputs)

    def _generate(self, inputs: dict[str, Any], gen_kwargs: dict[str, Any]) -> torch.Tensor:
        generate = getattr(self.model, "generate", None)
        if not callable(generate):
            raise ConfigurationError(
                f"predict_with_generate=True needs a model with a generate() method; "
                f"{type(self.model).__name__} has none (set predict_with_generate=False)"
            )
        with torch.no_grad():
            generated = generate(**inputs, **gen_kwargs)
        config = getattr(self.model, "generation_config", None)
        # generate() re-derives a generation config from the model config on every call while
        # this flag is set (transformers clears it the same way after the first batch).
        if config is not None and getattr(config, "_from_model_config", False):
            config._from_model_config = False
        return generated

    def _padding_lengths(self) -> tuple[int, int | None]:
        """(max_length, max_new_tokens) of the model's generation config, after filling in
        generate()'s defaults for unset values (as transformers does, on the config itself)."""
        config = getattr(self.model, "generation_config", None)
        if config is None:
            return _DEFAULT_MAX_LENGTH, None
        defaults_fn = getattr(config, "_get_default_generation_params", None)
        if callable(defaults_fn):
            config.update(**defaults_fn(), defaults_only=True)
        max_length = config.max_length if config.max_length is not None else _DEFAULT_MAX_LENGTH
        return int(max_length), getattr(config, "max_new_tokens", None)

    def _pad_to_generation_length(
        self, tensor: torch.Tensor, max_length: int, max_new_tokens: int | None
    ) -> torch.Tensor:
        if tensor.shape[-1] < max_length:
            return self._pad_tensors_to_max_len(tensor, max_length)
        if max_new_tokens is not None and tensor.shape[-1] < max_new_tokens + 1:
            return self._pad_tensors_to_max_len(tensor, max_new_tokens + 1)
        return tensor

    def _pad_tensors_to_max_len(self, tensor: torch.Tensor, max_length: int) -> torch.Tensor:
        """``tensor`` right-padded to ``max_length`` columns with the pad token (the processing
        class's, else its eos token, else the model config's pad_token_id)."""
        pad_token_id = self._pad_token_id()
        padded = torch.full(
            (tensor.shape[0], max_length), pad_token_id, dtype=tensor.dtype, device=tensor.device
        )
        padded[:, : tensor.shape[-1]] = tensor
        return padded

    def _pad_token_id(self) -> int:
        tokenizer = self.processing_class
        if tokenizer is not None and hasattr(tokenizer, "pad_token_id"):
            if tokenizer.pad_token_id is not None:
                return int(tokenizer.pad_token_id)
            return int(tokenizer.eos_token_id)
        pad = getattr(getattr(self.model, "config", None), "pad_token_id", None)
        if pad is None:
            raise ConfigurationError(
                "predict_with_generate pads generated tokens with the pad token, but neither "
                "processing_class nor model.config has a pad_token_id: pass the tokenizer as "
                "processing_class or set model.config.pad_token_id"
            )
        return int(pad)
