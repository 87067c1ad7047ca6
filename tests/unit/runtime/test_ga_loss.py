"""Gradient accumulation is exact: GA=4 x bs=2 gives the gradients and loss of GA=1 x bs=8."""

from __future__ import annotations

import pytest
import torch

from trainer_runtime.trainer import Trainer
from trainer_runtime.training_args import TrainingArguments

from .tiny import TokenData, TokenModelKwargs, TokenModelMean


class GradCapture:
    """Records grads and the step loss right before the first optimizer step, then stops."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def attach(self, trainer: Trainer) -> None:
        from trainer_runtime.callbacks import TrainerCallback

        capture = self

        class _Cb(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, model=None, **kw):  # type: ignore[no-untyped-def]
                capture.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}

        trainer.add_callback(_Cb())


def run_one_step(model_cls: type, tmp_path, ga: int, bs: int) -> tuple[dict, float]:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = model_cls()
    args = TrainingArguments(
        output_dir=str(tmp_path / f"ga{ga}"),
        per_device_train_batch_size=bs,
        gradient_accumulation_steps=ga,
        max_steps=1,
        save_strategy="no",
        train_sampling_strategy="sequential",
        max_grad_norm=0.0,
        use_cpu=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=TokenData(n=8))
    capture = GradCapture()
    capture.attach(trainer)
    out = trainer.train()
    return capture.grads, out.training_loss


@pytest.mark.parametrize("model_cls", [TokenModelKwargs, TokenModelMean])
def test_accumulated_step_equals_one_big_batch(model_cls: type, tmp_path) -> None:  # type: ignore[no-untyped-def]
    data = TokenData(n=8)
    counts = [(data.labels[i : i + 2] != -100).sum().item() for i in range(0, 8, 2)]
    assert len(set(counts)) > 1, "the micro-batches must have uneven label counts"

    grads_ga, loss_ga = run_one_step(model_cls, tmp_path, ga=4, bs=2)
    grads_one, loss_one = run_one_step(model_cls, tmp_path, ga=1, bs=8)
    assert grads_ga.keys() == grads_one.keys()
    for name in grads_one:
        assert torch.allclose(grads_ga[name], grads_one[name], atol=1e-6, rtol=1e-5), name
    assert loss_ga == pytest.approx(loss_one, rel=1e-5)

    # The naive rule (mean of per-micro-batch means) differs on this data: the test can fail.
    torch.manual_seed(0)
    model = model_cls()
    naive = (
        sum(
            model(data.ids[i : i + 2], data.labels[i : i + 2])[
                0 if model_cls is TokenModelMean else "loss"
            ].item()
            for i in range(0, 8, 2)
        )
        / 4
    )
    assert naive != pytest.approx(loss_one, rel=1e-3)


def test_compute_loss_func_gets_step_token_count(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torch.nn.functional as F

    seen: list[int] = []

    def loss_fn(outputs, labels, num_items_in_batch):  # type: ignore[no-untyped-def]
        seen.append(int(num_items_in_batch))
        logits = outputs["logits"]
        total = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum"
        )
        return total / num_items_in_batch

    results = []
    for ga, bs in ((4, 2), (1, 8)):
        torch.manual_seed(0)
        args = TrainingArguments(
            output_dir=str(tmp_path / f"f{ga}"),
            per_device_train_batch_size=bs,
            gradient_accumulation_steps=ga,
            max_steps=1,
            save_strategy="no",
            train_sampling_strategy="sequential",
            use_cpu=True,
        )
        trainer = Trainer(
            model=TokenModelKwargs(),
            args=args,
            train_dataset=TokenData(n=8),
            compute_loss_func=loss_fn,
        )
        results.append((trainer.train().training_loss, dict(trainer.model.named_parameters())))
    expected = int((TokenData(n=8).labels != -100).sum())
    assert seen == [expected] * 5  # 4 micro-batches, then 1 big batch: the step's count each time
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-5)
    for name, param in results[0][1].items():
        assert torch.allclose(param, results[1][1][name], atol=1e-6), name
