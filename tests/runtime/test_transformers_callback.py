"""A stock transformers.Trainer (and TRL SFTTrainer) job under the operator contract, with real
processes and real signals (tier 2).

The script (``hf_stock_script.py``) imports only transformers. It runs either unmodified under
``python -m trainer_runtime.hf.run`` (no line changed) or with ``--attach`` (the one-line
integration). Every interrupted run is resumed in a new process and its final weights are compared
tensor by tensor with an uninterrupted run of the same script.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the integration needs transformers (dev extra)")

from tests.distributed.ranks import free_port
from trainer_runtime import cli
from trainer_runtime.checkpoint.layout import (
    MANIFEST_NAME,
    RUNTIME_STATE_NAME,
    SENTINEL_NAME,
    CheckpointStore,
)
from trainer_runtime.protocol import EXIT_PREEMPTED, REASON_DEADLINE_TOO_SHORT, TerminationMessage

HERE = Path(__file__).parent
SCRIPT = HERE / "hf_stock_script.py"
TRL_SCRIPT = HERE / "hf_trl_script.py"
ROOT = HERE.parent.parent
TIMEOUT = 240.0


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTIBLE_")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(key, None)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
    )
    env.update(extra)
    return env


class Run:
    """One training process (``python -P ...``) with its log in ``workdir``."""

    def __init__(
        self, workdir: Path, argv: list[str], env: dict[str, str], cwd: Path = ROOT
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / "log.txt"
        self.term_path = Path(env.get("PREEMPTIBLE_TERMINATION_LOG", workdir / "term"))
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(
            [sys.executable, "-P", *argv], cwd=cwd, env=env, stdout=self._log, stderr=self._log
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, marker: str, timeout: float = TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while marker not in self.log():
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise AssertionError(f"exited {code} before {marker!r}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"no {marker!r} within {timeout} s:\n{self.log()}")
            time.sleep(0.05)

    def signal(self, signum: int) -> None:
        os.kill(self.proc.pid, signum)

    def wait(self, timeout: float = TIMEOUT) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"still running after {timeout} s:\n{self.log()}") from None
        finally:
            self._log.close()
        return code

    def termination(self) -> TerminationMessage:
        return TerminationMessage.model_validate_json(self.term_path.read_text())


def _argv(script: Path, out: Path, *, mode: str, extra: tuple[str, ...] = ()) -> list[str]:
    args = [str(script), "--output-dir", str(out), *extra]
    if mode == "attach":
        return [*args, "--attach"]
    return ["-m", "trainer_runtime.hf.run", *args]


def _operator_env(out: Path, workdir: Path, attempt: int, **extra: str) -> dict[str, str]:
    return _env(
        PREEMPTIBLE_OUTPUT_DIR=str(out),
        PREEMPTIBLE_ATTEMPT=str(attempt),
        PREEMPTIBLE_RESUME_FROM="latest",
        PREEMPTIBLE_KILL_WAIT_SECONDS="0",
        PREEMPTIBLE_TERMINATION_LOG=str(workdir / f"term-a{attempt}"),
        **extra,
    )


def _weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _assert_same_weights(a: Path, b: Path) -> None:
    import torch

    wa, wb = _weights(a), _weights(b)
    assert sorted(wa) == sorted(wb)
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, f"tensors differ from the uninterrupted run: {different[:5]}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stock script, uninterrupted, without the integration: transformers alone."""
    work = tmp_path_factory.mktemp("hf-reference")
    final = work / "final"
    argv = [str(SCRIPT), "--output-dir", str(work / "out"), "--final-dir", str(final)]
    run = Run(work, argv, _env())
    assert run.wait() == 0, run.log()
    return final


def _preempt_and_resume(
    tmp_path: Path, reference: Path, *, mode: str, metrics: bool = False
) -> tuple[Path, Run]:
    out, final = tmp_path / "ignored-by-operator", tmp_path / "final"
    out_env = tmp_path / "out"  # $PREEMPTIBLE_OUTPUT_DIR wins over the script's output_dir
    extra = {"PREEMPTIBLE_METRICS_PORT": str(free_port())} if metrics else {}
    first = Run(
        tmp_path / "a1",
        _argv(SCRIPT, out, mode=mode, extra=("--step-sleep", "0.4", "--final-dir", str(final))),
        _operator_env(out_env, tmp_path, 1, **extra),
    )
    first.wait_for("STEP 5")
    if metrics:
        port = extra["PREEMPTIBLE_METRICS_PORT"]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        body = text.decode()
        gauges = {
            ln.split()[0]: float(ln.split()[1])
            for ln in body.splitlines()
            if ln.startswith("preemptible_")
        }
        assert gauges.get("preemptible_step_seconds_max", 0) >= 0.4, body
        assert gauges.get("preemptible_save_seconds_max", 0) > 0, body  # checkpoint-4 was saved
        assert gauges.get("preemptible_last_complete_checkpoint_step") == 4, body
    sent = time.monotonic()
    first.signal(signal.SIGTERM)
    code = first.wait()
    assert code == EXIT_PREEMPTED, first.log()
    assert time.monotonic() - sent < 60
    msg = first.termination()
    assert msg.reason == "preempted" and msg.complete, msg
    assert msg.step >= 5 and msg.checkpoint and msg.checkpoint.endswith(f"checkpoint-{msg.step}")
    assert msg.step_seconds.max is not None and msg.save_seconds.max is not None
    assert not final.exists(), "the script went on after train() although it was preempted"
    assert not list(out.glob("checkpoint-*")), "checkpoints must go to $PREEMPTIBLE_OUTPUT_DIR"
    info = CheckpointStore(str(out_env)).inspect(f"checkpoint-{msg.step}")
    assert info.complete, info
    assert info.manifest and info.manifest["producer"] == "transformers.Trainer"
    listed = {f["path"] for f in info.manifest["files"]}
    assert {"model.safetensors", "optimizer.pt", "trainer_state.json", RUNTIME_STATE_NAME} <= listed
    assert info.attempt == 1
    # the JIT save read nothing back (sizes only); the periodic checkpoint-4 is hashed
    entries = {f["path"]: f for f in info.manifest["files"]}
    assert "xxh3_128" not in entries["optimizer.pt"], entries["optimizer.pt"]
    assert info.manifest["checksums"].startswith("sizes only"), info.manifest
    periodic = CheckpointStore(str(out_env)).inspect("checkpoint-4")
    assert all("xxh3_128" in f for f in (periodic.manifest or {})["files"]), periodic.manifest

    second = Run(
        tmp_path / "a2",
        _argv(SCRIPT, out, mode=mode, extra=("--final-dir", str(final))),
        _operator_env(out_env, tmp_path, 2),
    )
    assert second.wait() == 0, second.log()
    done = second.termination()
    assert done.reason == "completed" and done.step == 12
    _assert_same_weights(final, reference)
    return out_env, first


def test_unmodified_script_sigterm_jit_checkpoint_exit_75_and_resume(
    tmp_path: Path, reference: Path
) -> None:
    _preempt_and_resume(tmp_path, reference, mode="run", metrics=True)


def test_one_line_attach_and_cli_inspect_grace_on_its_checkpoints(
    tmp_path: Path, reference: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, _ = _preempt_and_resume(tmp_path, reference, mode="attach")
    assert cli.main(["inspect", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["latest_complete"].endswith("checkpoint-12")
    assert all(c["complete"] for c in doc["checkpoints"]), doc
    assert cli.main(["grace", str(out), "--json"]) == 0
    grace = json.loads(capsys.readouterr().out)
    # the SIGTERM-to-exit time of attempt 1 and the step/save times are carried over
    assert grace["inputs"]["sigterm_to_exit_seconds"], grace
    assert grace["inputs"]["step_max"] >= 0.4, grace
    assert grace["terminationGracePeriodSeconds"] >= 1


def test_jit_stop_skips_transformers_end_of_training(tmp_path: Path) -> None:
    """save_total_limit=1 + load_best_model_at_end: transformers' _finalize_training would load
    the best checkpoint and delete every other one, the JIT checkpoint included, before the exit.
    After a JIT stop none of it runs: the JIT checkpoint stays complete, exit 75 right away."""
    out = tmp_path / "out"
    extra = ("--step-sleep", "0.4", "--save-total-limit", "1", "--best")
    run = Run(
        tmp_path / "a1",
        _argv(SCRIPT, out, mode="run", extra=extra),
        _operator_env(out, tmp_path, 1),
    )
    run.wait_for("STEP 5")  # checkpoint-4 saved after the evaluation of step 4: the best one
    run.signal(signal.SIGTERM)
    code = run.wait()
    log = run.log()
    assert code == EXIT_PREEMPTED, log
    msg = run.termination()
    assert msg.reason == "preempted" and msg.complete and msg.step >= 5, msg
    assert msg.checkpoint and msg.checkpoint.endswith(f"checkpoint-{msg.step}")
    jit = CheckpointStore(str(out)).inspect(f"checkpoint-{msg.step}")
    assert jit.complete, (jit, log)
    listed = {f["path"] for f in jit.manifest["files"]}
    assert {"model.safetensors", "optimizer.pt", "trainer_state.json"} <= listed
    assert (out / "checkpoint-4").is_dir(), "the best checkpoint is kept by our rotation"
    assert "LOADING BEST" not in log, log
    assert "TRAIN END" not in log, log
    assert CheckpointStore(str(out)).latest_complete().step == msg.step


def test_sigkill_during_save_leaves_an_incomplete_checkpoint_that_resume_skips(
    tmp_path: Path, reference: Path
) -> None:
    out, final = tmp_path / "out", tmp_path / "final"
    first = Run(
        tmp_path / "a1",
        _argv(SCRIPT, out, mode="run", extra=("--save-sleep", "30")),
        _operator_env(out, tmp_path, 1),
    )
    first.wait_for("SAVING")  # checkpoint-4: weights on disk, the rest not yet
    first.signal(signal.SIGKILL)
    assert first.wait() == -signal.SIGKILL
    store = CheckpointStore(str(out))
    (info,) = store.list()
    assert info.name == "checkpoint-4" and not info.complete, info
    assert (out / "checkpoint-4" / SENTINEL_NAME).exists()
    assert (out / "checkpoint-4" / "model.safetensors").exists()
    assert not (out / "checkpoint-4" / MANIFEST_NAME).exists()

    second = Run(
        tmp_path / "a2",
        _argv(SCRIPT, out, mode="run", extra=("--final-dir", str(final))),
        _operator_env(out, tmp_path, 2),
    )
    assert second.wait() == 0, second.log()
    assert "skipping incomplete checkpoint" in second.log()
    _assert_same_weights(final, reference)
    # the step-4 directory was rewritten by attempt 2 and committed
    again = store.inspect("checkpoint-4")
    assert again.complete and again.attempt == 2, again


def test_sigterm_to_one_of_two_ranks_stops_both_at_the_same_step(tmp_path: Path) -> None:
    out = tmp_path / "out"
    port = str(free_port())
    runs = []
    for rank in range(2):
        env = _operator_env(
            out,
            tmp_path / f"rank{rank}",
            1,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            WORLD_SIZE="2",
            RANK=str(rank),
            NODE_RANK=str(rank),
            LOCAL_RANK="0",
        )
        (tmp_path / f"rank{rank}").mkdir()
        runs.append(
            Run(
                tmp_path / f"rank{rank}",
                _argv(SCRIPT, out, mode="run", extra=("--step-sleep", "0.4", "--save-steps", "99")),
                env,
            )
        )
    runs[1].wait_for("STEP 2")
    runs[1].signal(signal.SIGTERM)  # only rank 1 is signalled
    codes = [r.wait(timeout=120) for r in runs]
    assert codes == [EXIT_PREEMPTED, EXIT_PREEMPTED], [r.log()[-3000:] for r in runs]
    msgs = [r.termination() for r in runs]
    assert msgs[0].step == msgs[1].step, msgs
    assert msgs[1].sigterm_to_exit_seconds is not None and msgs[0].sigterm_to_exit_seconds is None
    info = CheckpointStore(str(out)).inspect(f"checkpoint-{msgs[0].step}")
    assert info.complete and info.manifest["world_size"] == 2, info
    listed = {f["path"] for f in info.manifest["files"]}
    assert {"rng_state_0.pth", "rng_state_1.pth", "model.safetensors"} <= listed


def test_a_save_failing_on_one_rank_fails_every_rank_promptly(tmp_path: Path) -> None:
    """Rank 1's part of a save raises and its process stays alive (a script's cleanup, or NCCL,
    which does not notice a peer's failure): rank 0 must not wait for it in a barrier until the
    collective timeout. Every rank reaches the same agreement point, rank 0 fails with rank 1's
    error named, while rank 1 is still alive."""
    out = tmp_path / "out"
    port = str(free_port())
    runs = []
    for rank in range(2):
        env = _operator_env(
            out,
            tmp_path / f"rank{rank}",
            1,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            WORLD_SIZE="2",
            RANK=str(rank),
            NODE_RANK=str(rank),
            LOCAL_RANK="0",
        )
        (tmp_path / f"rank{rank}").mkdir()
        extra = ("--save-steps", "2", "--fail-save-rank", "1", "--linger", "300")
        runs.append(Run(tmp_path / f"rank{rank}", _argv(SCRIPT, out, mode="run", extra=extra), env))
    try:
        runs[1].wait_for("LINGERING")
        code = runs[0].wait(timeout=120)  # well under the collective timeout (30 min)
        assert runs[1].proc.poll() is None, "rank 0 waited for rank 1 to end"
        log = runs[0].log()
        assert code not in (0, EXIT_PREEMPTED), log
        assert "rank 1: RuntimeError: disk full on purpose" in log, log[-3000:]
        msg = runs[0].termination()
        assert msg.reason == "failed" and "rank 1" in (msg.message or ""), msg
        assert not CheckpointStore(str(out)).inspect("checkpoint-2").complete
    finally:
        for run in runs:
            if run.proc.poll() is None:
                run.proc.kill()
            run.wait()


def test_launch_transformers_torchrun_two_workers_unmodified_script(tmp_path: Path) -> None:
    """`trainer-runtime launch --transformers -- python train.py`: torchrun starts two workers that
    run the unmodified script through the runner; SIGTERM to the launcher -> exit 75."""
    out = tmp_path / "out"
    argv = ["-m", "trainer_runtime.cli", "launch", "--nproc-per-node", "2", "--transformers"]
    argv += ["--", "python", str(SCRIPT), "--output-dir", "x", "--step-sleep", "0.4"]
    argv += ["--save-steps", "99"]
    env = _operator_env(out, tmp_path, 1, PREEMPTIBLE_GRACE_SECONDS="120")
    # cwd outside the repository: torchrun puts the cwd on sys.path, and the repository's
    # operator/ folder would shadow the stdlib module there (an artefact of this checkout)
    run = Run(tmp_path / "launch", argv, env, cwd=tmp_path)
    run.wait_for("STEP 2")
    run.signal(signal.SIGTERM)
    assert run.wait() == EXIT_PREEMPTED, run.log()[-4000:]
    msg = run.termination()
    assert msg.reason == "preempted" and msg.complete, msg
    info = CheckpointStore(str(out)).inspect(f"checkpoint-{msg.step}")
    assert info.complete and info.manifest["world_size"] == 2, info


def test_trl_sft_trainer_unmodified_sigterm_and_resume(tmp_path: Path) -> None:
    pytest.importorskip("trl", reason="TRL is an optional dependency (pip install trl)")
    work = tmp_path / "ref"
    ref = Run(
        work,
        [str(TRL_SCRIPT), "--output-dir", str(work / "out"), "--final-dir", str(work / "final")],
        _env(),
    )
    assert ref.wait() == 0, ref.log()
    out, final = tmp_path / "out", tmp_path / "final"
    first = Run(
        tmp_path / "a1",
        _argv(TRL_SCRIPT, out, mode="run", extra=("--step-sleep", "0.4")),
        _operator_env(out, tmp_path, 1),
    )
    first.wait_for("STEP 6")
    first.signal(signal.SIGTERM)
    assert first.wait() == EXIT_PREEMPTED, first.log()
    msg = first.termination()
    assert msg.reason == "preempted" and msg.complete
    second = Run(
        tmp_path / "a2",
        _argv(TRL_SCRIPT, out, mode="run", extra=("--final-dir", str(final))),
        _operator_env(out, tmp_path, 2),
    )
    assert second.wait() == 0, second.log()
    _assert_same_weights(final, work / "final")


# -- the stops of our Trainer (issue 37): an evaluation abandoned, a step dropped at a
# micro-batch boundary, a save that cannot fit not started ------------------------------------


def _transformers_alone(work: Path, *extra: str) -> tuple[Path, str]:
    """The stock script with ``extra``, uninterrupted, without the integration: its final
    weights and its log."""
    final = work / "final"
    argv = [str(SCRIPT), "--output-dir", str(work / "out"), "--final-dir", str(final), *extra]
    run = Run(work, argv, _env())
    assert run.wait() == 0, run.log()
    return final, run.log()


def _lines(log: str, prefix: str) -> list[str]:
    return [ln for ln in log.splitlines() if ln.startswith(prefix)]


def test_sigterm_during_a_long_evaluation_abandons_it_and_the_resumed_run_evaluates_again(
    tmp_path: Path,
) -> None:
    """An evaluation of 4 batches of 1.5 s (6 s) with a 3 s grace: the SIGTERM after its first
    batch abandons it at the next batch, the completed step is saved at once. The resumed run
    runs that evaluation first, with the same random numbers: its evaluations and its final
    weights equal transformers' alone, uninterrupted (side by side)."""
    config = ("--eval-steps", "4", "--save-steps", "99")
    ref_final, ref_log = _transformers_alone(tmp_path / "ref", *config)
    out, final = tmp_path / "out", tmp_path / "final"
    grace = 3.0
    first = Run(
        tmp_path / "a1",
        _argv(SCRIPT, out, mode="run", extra=(*config, "--eval-sleep", "1.5")),
        _operator_env(out, tmp_path, 1, PREEMPTIBLE_GRACE_SECONDS=str(grace)),
    )
    first.wait_for("EVAL BATCH 4")
    first.signal(signal.SIGTERM)
    assert first.wait() == EXIT_PREEMPTED, first.log()
    log = first.log()
    msg = first.termination()
    assert msg.reason == "preempted" and msg.complete and msg.stop == "evaluation", msg
    assert msg.step == 4 and msg.checkpoint and msg.checkpoint.endswith("checkpoint-4"), msg
    assert msg.sigterm_to_exit_seconds is not None and msg.sigterm_to_exit_seconds < grace, msg
    assert len(_lines(log, "EVAL BATCH 4")) <= 2, "the evaluation was not abandoned"
    assert not _lines(log, "EVALUATED"), log
    record = json.loads((out / "checkpoint-4" / RUNTIME_STATE_NAME).read_text())
    assert record["pending_evaluation"] == {"skip_scheduler": False}, record

    second = Run(
        tmp_path / "a2",
        _argv(SCRIPT, out, mode="run", extra=(*config, "--final-dir", str(final))),
        _operator_env(out, tmp_path, 2),
    )
    assert second.wait() == 0, second.log()
    evaluated = _lines(second.log(), "EVALUATED")
    assert evaluated[:1] == _lines(ref_log, "EVALUATED 4"), "the evaluation did not run again"
    assert evaluated == _lines(ref_log, "EVALUATED"), (evaluated, _lines(ref_log, "EVALUATED"))
    _assert_same_weights(final, ref_final)


def test_a_step_that_cannot_fit_is_dropped_at_a_micro_batch_boundary(tmp_path: Path) -> None:
    """Four micro-batches of 0.8 s per step, a 1 s grace, finish_step (the default): after the
    SIGTERM the rest of the step cannot fit, so the partial accumulation is dropped at the next
    micro-batch boundary and the previous step saved at once; the resumed run trains the
    dropped micro-batches again and ends equal to transformers alone, uninterrupted."""
    config = ("--grad-accum", "4", "--save-steps", "99")
    ref_final, _ = _transformers_alone(tmp_path / "ref", *config)
    out, final = tmp_path / "out", tmp_path / "final"
    first = Run(
        tmp_path / "a1",
        _argv(SCRIPT, out, mode="run", extra=(*config, "--micro-sleep", "0.8")),
        _operator_env(out, tmp_path, 1, PREEMPTIBLE_GRACE_SECONDS="1"),
    )
    first.wait_for("SUBSTEP 4")  # the first micro-batch of step 4 (the 2nd step of epoch 1)
    first.signal(signal.SIGTERM)
    assert first.wait() == EXIT_PREEMPTED, first.log()
    msg = first.termination()
    assert msg.reason == "preempted" and msg.complete and msg.stop == "micro_batch", msg
    assert msg.step == 3, f"the last completed step is 3, the JIT checkpoint is {msg.step}"
    assert len(_lines(first.log(), "SUBSTEP 4")) <= 2, "step 4 was not stopped"
    assert msg.micro_batch_seconds is not None and msg.micro_batch_seconds.max >= 0.8, msg
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3"]

    second = Run(
        tmp_path / "a2",
        _argv(SCRIPT, out, mode="run", extra=(*config, "--final-dir", str(final))),
        _operator_env(out, tmp_path, 2),
    )
    assert second.wait() == 0, second.log()
    _assert_same_weights(final, ref_final)


def test_a_jit_save_that_cannot_finish_before_the_deadline_is_not_started(tmp_path: Path) -> None:
    """The periodic save of step 4 takes over 2.5 s, the grace is 1.5 s: after the SIGTERM no
    JIT save is started (a save SIGKILLed half-way is worth nothing); exit 75 at once with
    ``deadline_too_short``, as our Trainer reports it."""
    out = tmp_path / "out"
    grace = 1.5
    run = Run(
        tmp_path / "a1",
        _argv(SCRIPT, out, mode="run", extra=("--step-sleep", "0.3", "--save-sleep", "2.5")),
        _operator_env(out, tmp_path, 1, PREEMPTIBLE_GRACE_SECONDS=str(grace)),
    )
    run.wait_for("STEP 6")
    run.signal(signal.SIGTERM)
    assert run.wait() == EXIT_PREEMPTED, run.log()
    msg = run.termination()
    assert msg.reason == REASON_DEADLINE_TOO_SHORT, msg
    assert msg.checkpoint is None and not msg.complete and msg.stop == "no_save", msg
    assert msg.message and "deadline too short" in msg.message, msg
    assert msg.step >= 6 and msg.sigterm_to_exit_seconds is not None, msg
    assert msg.sigterm_to_exit_seconds < grace, msg
    assert [c.step for c in CheckpointStore(str(out)).list()] == [4], "a JIT save was started"
    assert len(_lines(run.log(), "SAVING")) == 1, run.log()


def test_sigterm_to_one_of_two_ranks_during_an_evaluation_abandons_it_on_both(
    tmp_path: Path,
) -> None:
    """The ranks agree at every evaluation batch: a SIGTERM that reached rank 1 only abandons
    the evaluation on both, at the same batch, and both save the same step (no rank left in
    the evaluation's collectives)."""
    out = tmp_path / "out"
    port = str(free_port())
    runs = []
    for rank in range(2):
        env = _operator_env(
            out,
            tmp_path / f"rank{rank}",
            1,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            WORLD_SIZE="2",
            RANK=str(rank),
            NODE_RANK=str(rank),
            LOCAL_RANK="0",
        )
        (tmp_path / f"rank{rank}").mkdir()
        extra = ("--eval-steps", "4", "--eval-sleep", "1.5", "--save-steps", "99")
        runs.append(Run(tmp_path / f"rank{rank}", _argv(SCRIPT, out, mode="run", extra=extra), env))
    runs[1].wait_for("EVAL BATCH 4")
    runs[1].signal(signal.SIGTERM)  # only rank 1 is signalled
    codes = [r.wait(timeout=120) for r in runs]
    assert codes == [EXIT_PREEMPTED, EXIT_PREEMPTED], [r.log()[-3000:] for r in runs]
    msgs = [r.termination() for r in runs]
    assert [(m.step, m.stop) for m in msgs] == [(4, "evaluation")] * 2, msgs
    assert not any(_lines(r.log(), "EVALUATED") for r in runs)
    info = CheckpointStore(str(out)).inspect("checkpoint-4")
    assert info.complete and info.manifest["world_size"] == 2, info


def test_an_abandoned_evaluation_still_decides_the_best_checkpoint_after_resume(
    tmp_path: Path,
) -> None:
    """load_best_model_at_end, the first evaluation the best one (greater_is_better on
    eval_loss), and the SIGTERM during that evaluation: the resumed run evaluates step 4 first,
    so the best checkpoint and the final (best) weights are transformers' alone, uninterrupted."""
    config = ("--best", "--greater-is-better")
    ref_final, ref_log = _transformers_alone(tmp_path / "ref", *config)
    assert [ln.rsplit("/", 1)[-1] for ln in _lines(ref_log, "LOADING BEST")] == ["checkpoint-4"]
    out, final = tmp_path / "out", tmp_path / "final"
    first = Run(
        tmp_path / "a1",
        _argv(SCRIPT, out, mode="run", extra=(*config, "--eval-sleep", "1.5")),
        _operator_env(out, tmp_path, 1, PREEMPTIBLE_GRACE_SECONDS="3"),
    )
    first.wait_for("EVAL BATCH 4")
    first.signal(signal.SIGTERM)
    assert first.wait() == EXIT_PREEMPTED, first.log()
    msg = first.termination()
    assert (msg.step, msg.stop) == (4, "evaluation"), msg
    second = Run(
        tmp_path / "a2",
        _argv(SCRIPT, out, mode="run", extra=(*config, "--final-dir", str(final))),
        _operator_env(out, tmp_path, 2),
    )
    assert second.wait() == 0, second.log()
    log = second.log()
    assert _lines(log, "EVALUATED") == _lines(ref_log, "EVALUATED"), log
    assert _lines(log, "LOADING BEST") == [f"LOADING BEST {out / 'checkpoint-4'}"], log
    _assert_same_weights(final, ref_final)
