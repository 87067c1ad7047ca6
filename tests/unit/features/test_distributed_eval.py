"""Evaluation with two gloo ranks: batches are sharded over the ranks and gathered back, with the
padding duplicates of an uneven last batch dropped, so predictions match one process."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.multiprocessing as mp

from tests.unit.features.test_trainer_features import EVAL, WiredTrainer, args
from tests.unit.features.tiny_lm import TinyCausalLM

SAMPLES = EVAL + EVAL[:1]  # 7 samples: the last batch of the second rank is padded


def _predict(out: Path) -> Any:
    trainer = WiredTrainer(
        model=TinyCausalLM(),
        args=args(out, per_device_eval_batch_size=2, use_cpu=True),
        eval_dataset=SAMPLES,
    )
    return trainer.predict(SAMPLES)


def _worker(rank: int, port: int, out: str, results: dict) -> None:  # type: ignore[type-arg]
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
        OMP_NUM_THREADS="1",
    )
    import torch

    from trainer_runtime.distributed import collectives

    torch.set_num_threads(1)
    pred = _predict(Path(out) / f"rank{rank}")
    assert collectives.is_distributed()
    results[rank] = (
        pred.predictions,
        pred.label_ids,
        pred.metrics["test_loss"],
        pred.metrics["test_samples_per_second"] / pred.metrics["test_steps_per_second"],
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_rank_predictions_match_one_process(tmp_path: Path) -> None:
    single = _predict(tmp_path / "single")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(port, str(tmp_path), results), nprocs=2, join=True)
        results = dict(results)
    for rank in (0, 1):
        preds, labels, loss, samples_per_step = results[rank]
        assert preds.shape == single.predictions.shape == (7, 6, 11)
        np.testing.assert_allclose(preds, single.predictions, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(labels, single.label_ids)
        assert np.isfinite(loss)
        # every rank counts the gathered samples (7), not its own share: 7 samples / 2 steps
        assert samples_per_step == pytest.approx(7 / 2, rel=1e-2)
