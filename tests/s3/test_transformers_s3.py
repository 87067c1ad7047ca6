"""A stock transformers script (tests/runtime/hf_stock_script.py, unmodified, under the runner)
whose output dir is on the real S3 server: transformers saves into a local scratch directory, the
integration uploads and commits each checkpoint on S3 (checksummed as it goes up, manifest last),
SIGTERM gives a complete JIT checkpoint there and exit 75, and the next attempt downloads it and
ends bit-identical to transformers alone, uninterrupted."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest

from tests.cluster.s3 import S3Server
from tests.runtime.test_transformers_callback import (
    SCRIPT,
    Run,
    _argv,
    _assert_same_weights,
    _env,
    _lines,
    _operator_env,
    _transformers_alone,
)
from trainer_runtime.checkpoint.layout import RUNTIME_STATE_NAME, CheckpointStore
from trainer_runtime.protocol import EXIT_PREEMPTED

pytestmark = [pytest.mark.s3, pytest.mark.runtime, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def hf_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stock script, uninterrupted, without the integration: transformers alone."""
    work = tmp_path_factory.mktemp("hf-reference")
    final = work / "final"
    run = Run(work, [str(SCRIPT), "--output-dir", str(work / "out"), "--final-dir", str(final)],
              _env())  # fmt: skip
    assert run.wait() == 0, run.log()
    return final


def test_stock_script_checkpoints_to_s3_and_resumes_bit_identical(
    s3_server: S3Server, s3_bucket: str, s3_env: dict, tmp_path: Path, hf_reference: Path
) -> None:
    url = f"s3://{s3_bucket}/run"
    scratch, final = tmp_path / "scratch", tmp_path / "final"
    extra = ("--step-sleep", "0.4", "--final-dir", str(final))
    first = Run(
        tmp_path / "a1",
        _argv(SCRIPT, tmp_path / "ignored", mode="run", extra=extra),
        _operator_env(url, tmp_path, 1, PREEMPTIBLE_SCRATCH_DIR=str(scratch)),  # type: ignore[arg-type]
    )
    first.wait_for("STEP 5")
    first.signal(signal.SIGTERM)
    assert first.wait() == EXIT_PREEMPTED, first.log()
    msg = first.termination()
    assert msg.reason == "preempted" and msg.complete, msg
    assert msg.checkpoint == f"{url}/checkpoint-{msg.step}", msg

    store = CheckpointStore(url)
    assert [c.step for c in store.list() if c.complete] == [4, msg.step]
    info = store.inspect(f"checkpoint-{msg.step}")
    assert info.manifest is not None and info.manifest["producer"] == "transformers.Trainer"
    files = {f["path"]: f for f in info.manifest["files"]}
    assert {"model.safetensors", "optimizer.pt", "trainer_state.json", RUNTIME_STATE_NAME} <= set(
        files
    )
    # uploaded through the checksum: even the JIT checkpoint lists every file's xxh3_128
    assert all("xxh3_128" in f for f in files.values()), files
    # the local copies went once they were on the store
    assert not list(scratch.rglob("checkpoint-*")), sorted(scratch.rglob("*"))

    second = Run(
        tmp_path / "a2",
        _argv(SCRIPT, tmp_path / "ignored", mode="run", extra=("--final-dir", str(final))),
        _operator_env(url, tmp_path, 2, PREEMPTIBLE_SCRATCH_DIR=str(scratch)),  # type: ignore[arg-type]
    )
    assert second.wait() == 0, second.log()
    # it resumed from the JIT checkpoint, downloaded into the scratch directory (checked
    # against the manifest's checksums on the way); what it saved itself went up and away
    # (a fresh start would have trained and saved step 4 again)
    assert store.inspect("checkpoint-4").attempt == 1
    # once a newer checkpoint was committed, the downloaded copy went too (no best checkpoint)
    assert not list(scratch.rglob("checkpoint-*")), "a local copy stayed in the scratch dir"
    done = second.termination()
    assert done.reason == "completed" and done.step == 12
    _assert_same_weights(final, hf_reference)
    assert store.inspect("checkpoint-12").complete


def test_stock_script_with_a_missing_bucket_fails_before_training(
    s3_server: S3Server, s3_env: dict, tmp_path: Path
) -> None:
    url = "s3://no-such-bucket-29/run"
    run = Run(
        tmp_path / "a1",
        _argv(SCRIPT, tmp_path / "ignored", mode="run"),
        _operator_env(url, tmp_path, 1, PREEMPTIBLE_SCRATCH_DIR=str(tmp_path / "scratch")),  # type: ignore[arg-type]
    )
    assert run.wait() == 1, run.log()
    assert "STEP 1" not in run.log()
    msg = run.termination()
    assert msg.reason == "failed" and msg.message, msg
    assert repr(url) in msg.message and s3_server.endpoint in msg.message, msg.message


# -- load_best_model_at_end with an object store (issue 37) -------------------------------------


def _scratch_copies(scratch: Path) -> list[str]:
    return sorted(p.name for p in scratch.glob("preemptible-scratch/*/checkpoint-*"))


def test_superseded_best_copies_leave_the_scratch_dir(
    s3_server: S3Server, s3_bucket: str, s3_env: dict, tmp_path: Path
) -> None:
    """load_best_model_at_end, an evaluation before every save, the eval loss falling: each
    checkpoint is the best when it is saved. The scratch directory (an emptyDir) keeps only the
    copy of the current best one; superseded best copies go once the new one is committed."""
    url = f"s3://{s3_bucket}/best"
    scratch = tmp_path / "scratch"
    run = Run(
        tmp_path / "a1",
        _argv(SCRIPT, tmp_path / "ignored", mode="run", extra=("--best",)),
        _operator_env(url, tmp_path, 1, PREEMPTIBLE_SCRATCH_DIR=str(scratch)),  # type: ignore[arg-type]
    )
    assert run.wait() == 0, run.log()
    (loaded,) = _lines(run.log(), "LOADING BEST")
    best = Path(loaded.split()[-1])
    assert best.is_dir() and best.parent.parent.name == "preemptible-scratch", loaded
    assert _scratch_copies(scratch) == [best.name], "superseded best copies stayed in scratch"
    assert [c.step for c in CheckpointStore(url).list() if c.complete] == [4, 8, 12]


def test_after_a_resume_the_best_checkpoint_is_loaded_not_the_last(
    s3_server: S3Server, s3_bucket: str, s3_env: dict, tmp_path: Path
) -> None:
    """The best checkpoint is the first one (greater_is_better on eval_loss). A preemption after
    the second save, the next attempt on a new pod (another scratch dir): ``best_model_checkpoint``
    must point to a copy that exists there, so that load_best_model_at_end loads the best
    checkpoint. Side by side: the same flags with transformers alone on a local dir,
    uninterrupted: the same best checkpoint and the same final weights."""
    config = ("--best", "--greater-is-better")
    ref_final, ref_log = _transformers_alone(tmp_path / "ref", *config)
    (ref_loaded,) = _lines(ref_log, "LOADING BEST")
    assert ref_loaded.endswith("checkpoint-4"), ref_loaded
    url = f"s3://{s3_bucket}/best-resume"
    final = tmp_path / "final"
    first = Run(
        tmp_path / "a1",
        _argv(SCRIPT, tmp_path / "ignored", mode="run", extra=(*config, "--step-sleep", "0.4")),
        _operator_env(url, tmp_path, 1, PREEMPTIBLE_SCRATCH_DIR=str(tmp_path / "pod1")),  # type: ignore[arg-type]
    )
    first.wait_for("STEP 9")
    first.signal(signal.SIGTERM)
    assert first.wait() == EXIT_PREEMPTED, first.log()
    msg = first.termination()
    assert msg.reason == "preempted" and msg.complete and 9 <= msg.step < 12, msg
    # only the best checkpoint's copy stayed on the first pod
    assert _scratch_copies(tmp_path / "pod1") == ["checkpoint-4"]
    shutil.rmtree(tmp_path / "pod1")  # the emptyDir goes with the pod

    pod2 = tmp_path / "pod2"
    second = Run(
        tmp_path / "a2",
        _argv(SCRIPT, tmp_path / "ignored", mode="run", extra=(*config, "--final-dir", str(final))),
        _operator_env(url, tmp_path, 2, PREEMPTIBLE_SCRATCH_DIR=str(pod2)),  # type: ignore[arg-type]
    )
    assert second.wait() == 0, second.log()
    loaded = _lines(second.log(), "LOADING BEST")
    assert loaded, "load_best_model_at_end loaded nothing: the final model is the last one"
    best = Path(loaded[0].split()[-1])
    assert best.name == "checkpoint-4" and pod2 in best.parents, loaded
    _assert_same_weights(final, ref_final)
