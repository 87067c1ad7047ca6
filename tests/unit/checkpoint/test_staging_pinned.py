"""Pinned staging of background saves (checkpoint/pinned.py): the sizing rule, when to pin
ahead, the stall limit, the host memory read, reuse of kept buffers, the JIT give-back."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from trainer_runtime.checkpoint import staging
from trainer_runtime.checkpoint.background import SnapshotBuffers
from trainer_runtime.checkpoint.pinned import (
    AT_SAVE,
    KEEP,
    PIN_AHEAD,
    HostMemory,
    PinnedStaging,
    local_ranks_from_env,
    pin_ahead_due,
    read_host_memory,
    staging_mode,
    stall_too_long,
)

GIB = 1 << 30


@pytest.mark.parametrize(
    ("available", "limit", "used", "ranks", "state", "held", "mode"),
    [
        # one GPU, 1 TiB free: a 7B full fine-tune's 67 GB snapshot is kept
        (1024 * GIB, None, None, 1, 67 * GIB, 0, KEEP),
        # 8 ranks on a 2 TiB node, 8.4 GB each (DDP share): kept (128 GiB per rank)
        (2048 * GIB, None, None, 8, 9 * GIB, 0, KEEP),
        # the cgroup is what is left: 200 GiB limit, 100 used -> 12.5 GiB a rank of 8
        (2048 * GIB, 200 * GIB, 100 * GIB, 8, 6 * GIB, 0, KEEP),
        (2048 * GIB, 200 * GIB, 100 * GIB, 8, 9 * GIB, 0, PIN_AHEAD),
        (2048 * GIB, 200 * GIB, 100 * GIB, 8, 11 * GIB, 0, AT_SAVE),
        # MemAvailable below the cgroup's room
        (40 * GIB, 200 * GIB, 0, 1, 25 * GIB, 0, PIN_AHEAD),
        (40 * GIB, 200 * GIB, 0, 1, 33 * GIB, 0, AT_SAVE),
        # the bytes a rank holds already count as free (its kept buffers)
        (20 * GIB, None, None, 1, 20 * GIB, 20 * GIB, KEEP),
        # exactly at the shares
        (100 * GIB, None, None, 2, 25 * GIB, 0, KEEP),
        (100 * GIB, None, None, 2, 40 * GIB, 0, PIN_AHEAD),
        # a cgroup already over its limit; nothing to pin
        (100 * GIB, 10 * GIB, 12 * GIB, 1, 1, 0, AT_SAVE),
        (100 * GIB, None, None, 1, 0, 0, AT_SAVE),
        # ranks 0 (unknown) counts as one
        (100 * GIB, None, None, 0, 50 * GIB, 0, KEEP),
    ],
)
def test_staging_mode(
    available: int,
    limit: int | None,
    used: int | None,
    ranks: int,
    state: int,
    held: int,
    mode: str,
) -> None:
    assert staging_mode(HostMemory(available, limit, used), ranks, state, held=held) == mode


@pytest.mark.parametrize(
    ("step", "save_steps", "step_seconds", "pin_seconds", "due"),
    [
        (99, 100, 1.0, 0.5, True),  # one step left, pinning takes half of it
        (98, 100, 1.0, 0.5, True),  # two left: one to spare
        (97, 100, 1.0, 0.5, False),
        (94, 100, 0.2, 0.9, True),  # 0.9 s: 5 steps of 0.2 s, and 1 to spare
        (93, 100, 0.2, 0.9, False),
        (100, 100, 1.0, 0.5, False),  # the save's own step: the snapshot pins
        (0, 100, 1.0, 0.5, False),
        (199, 100, None, 30.0, True),  # no step time measured yet: the step before
        (198, 100, None, 30.0, False),
        (5, 0, 1.0, 0.5, False),  # no periodic saves by steps
    ],
)
def test_pin_ahead_due(
    step: int, save_steps: int, step_seconds: float | None, pin_seconds: float, due: bool
) -> None:
    assert pin_ahead_due(step, save_steps, step_seconds, pin_seconds) is due


@pytest.mark.parametrize(
    ("stall", "write", "too_long"),
    [(0.078, 9.0, False), (1.8, 9.0, True), (0.9, 9.0, False), (0.91, 9.0, True), (1, 0, False)],
)
def test_stall_limit_is_a_tenth_of_the_write(stall: float, write: float, too_long: bool) -> None:
    assert stall_too_long(stall, write) is too_long


@pytest.mark.parametrize(
    ("max_text", "current", "limit", "used"),
    [
        ("max\n", "123\n", None, None),
        ("1073741824\n", "536870912\n", GIB, GIB // 2),
        (None, None, None, None),
    ],
)
def test_read_host_memory(
    tmp_path: Path, max_text: str | None, current: str | None, limit: int | None, used: int | None
) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  1000 kB\nMemFree: 10 kB\nMemAvailable:    2048 kB\n")
    cgroup = tmp_path / "cg"
    cgroup.mkdir()
    if max_text is not None:
        (cgroup / "memory.max").write_text(max_text)
    if current is not None:
        (cgroup / "memory.current").write_text(current)
    assert read_host_memory(meminfo, cgroup) == HostMemory(2048 * 1024, limit, used)


def test_read_host_memory_of_this_machine() -> None:
    assert read_host_memory().usable > 0


@pytest.mark.parametrize(
    ("env", "ranks"), [({}, 1), ({"LOCAL_WORLD_SIZE": "8"}, 8), ({"LOCAL_WORLD_SIZE": "x"}, 1)]
)
def test_local_ranks_from_env(env: dict[str, str], ranks: int) -> None:
    assert local_ranks_from_env(env) == ranks


def test_kept_buffers_are_reused_by_the_next_snapshot() -> None:
    buffers = SnapshotBuffers(keep=True)
    state = {"w": torch.randn(300, 257), "b": torch.randn(257).bfloat16()}
    first = buffers.snapshot("model.safetensors", state)
    state["w"].add_(1.0)
    second = buffers.snapshot("model.safetensors", state)
    assert second["w"] is first["w"] and second["b"] is first["b"]  # the same buffers
    assert torch.equal(second["w"], state["w"])
    assert (buffers.allocated, buffers.reused) == (1, 1)
    # a changed layout allocates again
    buffers.snapshot("model.safetensors", {"w": torch.randn(3, 3)})
    assert (buffers.allocated, buffers.reused) == (2, 1)


def test_given_back_buffers_are_allocated_at_every_snapshot() -> None:
    buffers = SnapshotBuffers(keep=False)
    state = {"w": torch.randn(300, 257)}
    first = buffers.snapshot("model.safetensors", state)["w"]
    second = buffers.snapshot("model.safetensors", state)["w"]
    assert second is not first
    assert (buffers.allocated, buffers.reused) == (2, 0)


def _with_cuda_layout(staged: PinnedStaging, nbytes: int) -> None:
    """What a snapshot of CUDA tensors leaves in the buffers: their layout and device."""
    layout = (("w", torch.uint8, (nbytes,)),)
    staged.buffers._layouts[("model.safetensors", True)] = (layout, torch.device("cuda", 0))


@pytest.mark.parametrize(
    ("setting", "available", "mode", "kept"),
    [
        (None, 100 * GIB, KEEP, True),
        (None, 3 * GIB, PIN_AHEAD, False),
        (None, GIB, AT_SAVE, False),
        (True, GIB, KEEP, True),  # forced
        (False, 100 * GIB, PIN_AHEAD, False),  # forced
    ],
)
def test_the_mode_is_decided_at_the_first_snapshot_and_reported(
    setting: bool | None,
    available: int,
    mode: str,
    kept: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    staged = PinnedStaging(setting, local_ranks=2, read_memory=lambda: HostMemory(available))
    _with_cuda_layout(staged, GIB)
    with caplog.at_level(logging.INFO, "trainer_runtime.checkpoint.pinned"):
        staged.after_snapshot(0.05)
    assert staged.mode == mode and staged.buffers.keep is kept
    assert f"pinned staging: {mode}" in caplog.text
    metrics = staged.metrics()
    assert metrics["pinned_staging_kept"] == (1.0 if kept else 0.0)
    assert metrics["snapshot_stall_seconds_last"] == 0.05


def test_a_state_without_cuda_tensors_pins_nothing() -> None:
    staged = PinnedStaging(None, read_memory=lambda: HostMemory(100 * GIB))
    staged.buffers.snapshot("model.safetensors", {"w": torch.randn(10)})
    staged.after_snapshot(0.01)
    assert staged.mode == AT_SAVE and not staged.buffers.keep
    assert staged.maybe_pin_ahead(99, 100, 1.0, writing=False) is None


def test_pin_ahead_waits_for_the_write_and_for_the_save_to_be_near(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(staging, "_can_pin", lambda: False)  # plain mappings on the CPU
    staged = PinnedStaging(False)
    _with_cuda_layout(staged, 1 << 20)
    staged.after_snapshot(0.01)
    assert staged.maybe_pin_ahead(50, 100, 1.0, writing=False) is None  # not near
    assert staged.maybe_pin_ahead(99, 100, 1.0, writing=True) is None  # the last one is held
    thread = staged.maybe_pin_ahead(99, 100, 1.0, writing=False)
    assert thread is not None
    staged.before_snapshot()  # the snapshot waits for it
    assert staged.buffers.held_bytes == 1 << 20
    assert staged.maybe_pin_ahead(99, 100, 1.0, writing=False) is not None  # nothing left
    staged.before_snapshot()
    assert staged.buffers.held_bytes == 1 << 20  # prepared once, not twice


def test_a_stall_over_a_tenth_of_the_write_is_a_warning_with_both_figures(
    caplog: pytest.LogCaptureFixture,
) -> None:
    staged = PinnedStaging(None, read_memory=lambda: HostMemory(100 * GIB))
    staged.after_snapshot(2.5)  # the first save (it pins in every mode)
    staged.after_write(9.0)
    staged.after_snapshot(1.8)
    with caplog.at_level(logging.WARNING, "trainer_runtime.checkpoint.pinned"):
        assert staged.after_write(9.0) is True
    assert "1.800 s" in caplog.text and "9.000 s" in caplog.text
    staged.after_snapshot(0.078)
    assert staged.after_write(9.0) is False
    assert staged.warnings == 1


@pytest.mark.parametrize(("available", "given_back"), [(100 * GIB, False), (256 << 10, True)])
def test_kept_memory_is_given_back_at_a_jit_stop_when_memory_is_short(
    available: int, given_back: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(staging, "_can_pin", lambda: False)
    memory = [HostMemory(100 * GIB)]
    staged = PinnedStaging(None, read_memory=lambda: memory[0])
    _with_cuda_layout(staged, 1 << 20)
    staged.after_snapshot(0.01)
    assert staged.mode == KEEP
    staged.buffers.prepare()  # stands for the kept snapshot memory
    assert staged.buffers.held_bytes == 1 << 20
    memory[0] = HostMemory(available)
    assert staged.on_stop() is given_back
    assert (staged.buffers.held_bytes == 0) is given_back


@pytest.mark.parametrize(("keep", "kept"), [(None, 0.0), (True, 1.0)])
def test_the_trainer_reports_pinned_staging_on_metrics(
    tmp_path: Path, keep: bool | None, kept: float
) -> None:
    from tests.unit.runtime.test_resume import make_trainer
    from trainer_runtime.callbacks import TrainerCallback
    from trainer_runtime.metrics import RUNTIME_METRIC_NAMES, TrainingMetrics

    trainer = make_trainer(tmp_path / "run", save_async=True, save_async_keep_snapshot=keep)
    metrics = TrainingMetrics()
    trainer.metrics = metrics
    seen: list[dict[str, float | None]] = []

    class AtSave(TrainerCallback):
        def on_save(self, args: object, state: object, control: object, **kw: object) -> None:
            trainer._publish_metrics()
            seen.append(
                {k: metrics.registry.get_sample_value(n) for k, n in RUNTIME_METRIC_NAMES.items()}
            )

    trainer.add_callback(AtSave())
    trainer.train()
    assert len(seen) >= 2
    for values in seen:
        assert values["pinned_staging_kept"] == kept
        held = values["pinned_staging_bytes"] or 0
        assert held > 0 if keep else held == 0  # kept; or given back once written
        assert (values["snapshot_stall_seconds_last"] or 0) > 0
    assert trainer._pinned_staging.buffers.reused >= (1 if keep else 0)


def test_the_first_saves_stall_is_no_warning_and_later_ones_warn_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    staged = PinnedStaging(None, read_memory=lambda: HostMemory(100 * GIB))
    with caplog.at_level(logging.INFO, "trainer_runtime.checkpoint.pinned"):
        staged.after_snapshot(1.8)
        assert staged.after_write(9.0) is False  # the first save pins in every mode
        assert "the first save of the run pins its memory" in caplog.text
        staged.after_snapshot(1.8)
        assert staged.after_write(9.0) is True
        staged.after_snapshot(1.7)
        assert staged.after_write(9.0) is True
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and staged.warnings == 2


def test_a_jit_stop_stops_pinning_ahead_without_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging, "_can_pin", lambda: False)
    staged = PinnedStaging(False)
    _with_cuda_layout(staged, 1 << 20)
    staged.buffers._layouts[("optimizer.safetensors", True)] = (
        (("m", torch.uint8, (1 << 20,)),),
        torch.device("cuda", 0),
    )
    staged.after_snapshot(0.01)
    original = staged.buffers._pinned_views
    calls: list[int] = []

    def pin(layout: object, device: torch.device) -> list[torch.Tensor]:
        calls.append(1)
        staged.on_stop()  # the JIT stop arrives while this group is being pinned
        return original(layout, device)  # type: ignore[arg-type]

    monkeypatch.setattr(staged.buffers, "_pinned_views", pin)
    staged.buffers.prepare()
    assert calls == [1]  # the second group was not pinned
    assert staged.buffers.held_bytes == 0  # and the first was not kept
