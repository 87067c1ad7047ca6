"""The staging blocks of local checkpoint writes (opt-in O_DIRECT) are ready before the first
save; nothing is staged or warmed when O_DIRECT is not asked for (the default)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from trainer_runtime.checkpoint import direct_io
from trainer_runtime.checkpoint import io as ckpt_io
from trainer_runtime.checkpoint import storage as storage_module
from trainer_runtime.checkpoint.direct_io import DirectFile
from trainer_runtime.trainer import Trainer
from trainer_runtime.training_args import TrainingArguments

from ..runtime.tiny import TokenData, TokenModelMean

pytestmark = pytest.mark.skipif(not direct_io.direct_io_supported(), reason="no O_DIRECT here")


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PREEMPTIBLE_DIRECT_IO", raising=False)
    monkeypatch.setattr(storage_module, "_direct_io_asked", False)
    monkeypatch.setattr(direct_io, "_refusing_devices", set())


@pytest.fixture
def empty_pool(monkeypatch: pytest.MonkeyPatch) -> direct_io._StagingPool:
    pool = direct_io._StagingPool()
    monkeypatch.setattr(direct_io, "staging_pool", pool)
    monkeypatch.setattr(ckpt_io, "staging_pool", pool)
    monkeypatch.setattr(direct_io, "BLOCK_BYTES", 1 << 20)
    return pool


def test_local_writes_find_their_blocks_warm(
    tmp_path: Path, empty_pool: direct_io._StagingPool
) -> None:
    storage_module.configure_direct_io(True)
    thread = ckpt_io.warm_local_writes(str(tmp_path))
    assert thread is not None
    thread.join(timeout=30)
    warm = list(empty_pool._free)
    assert len(warm) == ckpt_io._PARALLEL_FILES * direct_io.DEPTH
    assert all(len(b) == direct_io.BLOCK_BYTES for b in warm)
    # a file written afterwards stages through those blocks, not fresh ones
    f = DirectFile(str(tmp_path / "f.bin"))
    f.write(bytes(5 * direct_io.BLOCK_BYTES))
    taken = {id(b) for b in f._blocks}
    f.close()
    assert taken and taken <= {id(b) for b in warm}


@pytest.mark.parametrize(
    ("uri", "env"),
    [("memory://bucket/run", "1"), ("{tmp}", "0"), ("{tmp}", None)],
    ids=["remote storage", "PREEMPTIBLE_DIRECT_IO=0", "not asked for"],
)
def test_nothing_is_warmed_where_writes_do_not_stage(
    tmp_path: Path,
    empty_pool: direct_io._StagingPool,
    monkeypatch: pytest.MonkeyPatch,
    uri: str,
    env: str | None,
) -> None:
    if env is not None:
        monkeypatch.setenv("PREEMPTIBLE_DIRECT_IO", env)
    assert ckpt_io.warm_local_writes(uri.format(tmp=tmp_path)) is None
    assert empty_pool._free == []


@pytest.mark.parametrize(
    ("save_strategy", "jit", "direct", "warmed"),
    [
        ("no", False, True, False),
        ("steps", False, True, True),
        ("no", True, True, True),
        ("steps", True, False, False),  # the default: no O_DIRECT, nothing staged
    ],
)
def test_train_warms_only_when_it_may_save_with_direct_io(
    tmp_path: Path,
    empty_pool: direct_io._StagingPool,
    save_strategy: str,
    jit: bool,
    direct: bool,
    warmed: bool,
) -> None:
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        max_steps=1,
        save_strategy=save_strategy,
        save_steps=100,
        enable_jit_checkpoint=jit,
        checkpoint_direct_io=direct,
        use_cpu=True,
    )
    Trainer(model=TokenModelMean(), args=args, train_dataset=TokenData(n=4)).train()
    for thread in threading.enumerate():
        if thread.name == "ckpt-staging-warm":
            thread.join(timeout=30)
    assert bool(empty_pool._free) is warmed
