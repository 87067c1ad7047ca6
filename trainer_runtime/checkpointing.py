"""Save and resume orchestration of the Trainer: the Trainer asks, :class:`CheckpointManager`
decides how.

The Trainer's loop only says *when* (``train -> train_step -> should_stop``: a due periodic save, a
JIT stop, the end of training, a resume at the start). The manager owns the rest:

- **resume**: which checkpoint (``resume_from_checkpoint``, ``$PREEMPTIBLE_RESUME_FROM``, one copy
  per node), loading it (FSDP pieces, DDP rank shares read once over the ranks, transformers'
  files), the fallback to the previous complete checkpoint when one turns out corrupt on any rank,
  and keeping complete checkpoints newer than one resumed from by path;
- **save**: the files of a checkpoint (rank shares with an agreed plan, FSDP pieces), the writer,
  a step never saved twice, the discard of a failed write;
- **async saves** (``save_async``): the snapshot into pinned staging, the writer thread, its commit
  at a later step boundary, the JIT save that supersedes a pending one (cancelled, its directory
  removed once the JIT checkpoint is committed), and what is left in flight at a stop or an error.

It never imports the Trainer: what it needs of it is :class:`CheckpointHost`. The decisions that
need no process group are pure functions here (:func:`resume_mode`, :func:`supersedes`,
:func:`loaded_optimizer_source`), table-tested in ``tests/unit/runtime``.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from typing import Any, Literal, Protocol

import torch

from trainer_runtime.checkpoint import fallback, per_node
from trainer_runtime.checkpoint.background import (
    BackgroundSave,
    SnapshotBuffers,
    resolve_save_async,
    snapshot_entry,
)
from trainer_runtime.checkpoint.background import json_bytes as _json_bytes
from trainer_runtime.checkpoint.hf_format import (
    HF_OPTIMIZER_NAME,
    HF_SCHEDULER_NAME,
    has_model_files,
    hf_rng_file_name,
    load_hf_rng_state,
    load_model_files,
    model_file_entries,
    model_weights,
    side_files,
    torch_load,
)
from trainer_runtime.checkpoint.io import (
    OPTIMIZER_META_KEY,
    CheckpointReader,
    CheckpointWriter,
    optimizer_state_to_tensors,
    remove_checkpoint,
    write_entry,
)
from trainer_runtime.checkpoint.layout import (
    RUNTIME_STATE_NAME,
    TRAINER_STATE_NAME,
    CheckpointInfo,
    CheckpointStore,
    checkpoint_name,
    inspect_checkpoint,
    parse_step,
)
from trainer_runtime.checkpoint.model_state import (
    MODEL_STEM,
    OPTIMIZER_INDEX_NAME,
    OPTIMIZER_NAME,
    OPTIMIZER_STEM,
    SCHEDULER_NAME,
    TRAINING_ARGS_NAME,
    rng_file_name,
)
from trainer_runtime.checkpoint.pinned import PinnedStaging, local_ranks_from_env
from trainer_runtime.checkpoint.resume_choice import parent_of, requested_resume, resolve_in_store
from trainer_runtime.checkpoint.rng import restore_rng_state
from trainer_runtime.checkpoint.safetensors_stream import TensorFile, fault_in_alongside
from trainer_runtime.checkpoint.share_resume import load_shared
from trainer_runtime.checkpoint.shares import ShareGroup, agree_on_plan, share_entries
from trainer_runtime.checkpoint.storage import Storage
from trainer_runtime.data.arguments import dataset_state_file_name, iterable_dataset_state
from trainer_runtime.distributed import collectives
from trainer_runtime.errors import CheckpointCorruptError, CheckpointError, ResumeError
from trainer_runtime.protocol import under_operator
from trainer_runtime.state import PREEMPTIBLE_KEY

__all__ = [
    "ASYNC_POLL_SECONDS",
    "CheckpointHost",
    "CheckpointManager",
    "ResumeMode",
    "loaded_optimizer_source",
    "resume_mode",
    "supersedes",
]

logger = logging.getLogger(__name__)

# How often ranks re-agree while a periodic save waits behind a background write (each poll is one
# all-reduce of one int); short next to a step, so a SIGTERM is acted on without delay.
ASYNC_POLL_SECONDS = 0.05

# How the checkpoint to resume from was asked for: what a corrupt one falls back to.
# "latest": resume_from_checkpoint=True; "latest_env": $PREEMPTIBLE_RESUME_FROM=latest;
# "env_path": a path from the operator; "path": a path the caller gave.
ResumeMode = Literal["latest", "latest_env", "env_path", "path"]

Entries = list[tuple[str, Any, bool]]


# -- pure decisions --------------------------------------------------------------------------------
def resume_mode(resume: bool | str | None, *, from_env: bool) -> ResumeMode | None:
    """How a resolved ``resume`` request (after :func:`requested_resume`) was asked for; None:
    no resume."""
    if resume is None or resume is False:
        return None
    if resume is True:
        return "latest_env" if from_env else "latest"
    return "env_path" if from_env else "path"


def may_fall_back(mode: ResumeMode | None) -> bool:
    """A corrupt checkpoint is replaced by the previous complete one unless the caller named it
    by path (then the error says so instead)."""
    return mode != "path"


def keeps_newer(mode: ResumeMode | None) -> bool:
    """Whether complete checkpoints newer than the one loaded can exist and must be kept: only
    after a resume from a path ("latest" loaded the newest complete one, or the one before a
    corrupt one)."""
    return mode in ("path", "env_path")


def supersedes(*, jit: bool, pending_step: int, step: int) -> bool:
    """Before a save, with a background write of ``pending_step`` in flight: True when the save
    cancels it (a JIT save of a newer step: the newer state supersedes it), False when it waits
    for it and commits it first (a periodic save, or a JIT save of the same step)."""
    return jit and pending_step != step


def loaded_optimizer_source(
    *,
    sharded_optimizer: bool | None,
    has_ours: bool,
    has_scheduler: bool,
    has_hf_optimizer: bool,
    has_hf_scheduler: bool,
) -> Literal["ours", "transformers", "none"]:
    """Where a resume takes the optimizer and scheduler state from. ``sharded_optimizer``: None
    without FSDP, else whether the FSDP pieces held the optimizer state. "ours": our optimizer
    files (or the FSDP pieces) and scheduler.json; "transformers": optimizer.pt/scheduler.pt;
    "none": neither (saved with save_only_model): the schedule is fast-forwarded."""
    optimizer_saved = has_ours if sharded_optimizer is None else sharded_optimizer
    if optimizer_saved and has_scheduler:
        return "ours"
    if sharded_optimizer is None and has_hf_optimizer and has_hf_scheduler:
        return "transformers"
    return "none"


# -- what the manager needs of the Trainer ---------------------------------------------------------
class CheckpointHost(Protocol):
    """The Trainer as the manager sees it: its state, and the hooks that decide what a checkpoint
    holds of it (the data position, the record, the callbacks) and how a load is applied."""

    args: Any
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    lr_scheduler: Any
    state: Any
    control: Any
    accelerator: Any
    train_dataset: Any
    last_checkpoint: CheckpointInfo | None
    _fsdp: Any
    _metric_schedule: bool
    _dataset_state: dict[str, Any] | None

    # saving
    def _checkpoint_entries(self, main: bool, jit: bool, *, snapshot: bool = False) -> Entries: ...
    def _fsdp_entries(self, main: bool, jit: bool) -> list[tuple[str, Any]]: ...
    def _manifest_extra(self) -> dict[str, Any]: ...
    def _processing_class_to_save(self) -> Any: ...
    def _checkpoint_rng_state(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]: ...
    def _before_checkpoint_write(self) -> None: ...
    def _preemptible_record(self, jit: bool, background: bool = False) -> dict[str, Any]: ...
    def _is_iterable(self) -> bool: ...
    def _stamp(self, phase: str) -> None: ...
    def _after_checkpoint_commit(
        self, info: CheckpointInfo, seconds: float, *, blocking: bool = True
    ) -> None: ...

    # loading
    def _load_checkpoint(self, info: CheckpointInfo) -> None: ...
    def _load_model_shards(self, info: CheckpointInfo) -> bool: ...
    def _restore_progress(
        self, state: dict[str, Any], record: dict[str, Any], info: CheckpointInfo
    ) -> None: ...
    def _restore_data_position(
        self, record: dict[str, Any], info: CheckpointInfo
    ) -> tuple[int, int]: ...
    def _resume_start_state(self) -> dict[str, Any]: ...
    def _restore_resume_start_state(self, saved: dict[str, Any]) -> None: ...


class CheckpointManager:
    """Saves and resumes the Trainer's checkpoints (module docstring). One per Trainer."""

    def __init__(self, host: CheckpointHost) -> None:
        self._host = host
        args = host.args
        # the periodic checkpoint a writer thread is writing (save_async), at most one, and the
        # one a JIT save cancelled (its directory removed once the JIT checkpoint is committed)
        self.in_flight: BackgroundSave | None = None
        self._superseded: BackgroundSave | None = None
        # the host buffers snapshots are copied into (checkpoint/pinned.py: kept, pinned ahead
        # or at the save)
        self.staging = PinnedStaging(
            getattr(args, "save_async_keep_snapshot", None), local_ranks=local_ranks_from_env()
        )
        self.mode: ResumeMode | None = None
        # After a resume from an older checkpoint than the newest complete one: its step (the
        # saves of later steps keep complete checkpoints there, kept_checkpoint).
        self.keep_complete_after: int | None = None

    @property
    def snapshot_buffers(self) -> SnapshotBuffers:
        return self.staging.buffers

    @property
    def _output_dir(self) -> str:
        return str(self._host.args.output_dir)

    @property
    def _local_rank(self) -> int:
        return int(self._host.accelerator.local_process_index)

    # -- resume: which checkpoint --------------------------------------------------------------
    def resolve(self, resume: bool | str | None) -> CheckpointInfo | None:
        """The checkpoint ``train(resume_from_checkpoint=resume)`` starts from, or None."""
        resume, from_env = requested_resume(resume)
        self.mode = resume_mode(resume, from_env=from_env)
        self.keep_complete_after = None  # set again once loaded (note_resumed)
        if self.mode is None:
            return None
        assert resume is not None and resume is not False
        if per_node.each_node_active(self._host.args):
            # Each node resumes from its own copy; all ranks agree on the step (a collective).
            return per_node.resolve_resume(
                self._output_dir, resume, from_env=from_env, local_rank=self._local_rank
            )
        return resolve_in_store(self._output_dir, resume, from_env=from_env)

    def load_with_fallback(self, info: CheckpointInfo) -> CheckpointInfo | None:
        """Load ``info``; when it turns out corrupt on any rank, mark it, fall back to the newest
        complete checkpoint before it and load that, every rank agreeing (fallback.py). Returns
        what was loaded. A path the caller asked for never falls back: CheckpointCorruptError."""
        host = self._host
        fresh = host._resume_start_state()
        each_node = per_node.each_node_active(host.args)
        local_rank = self._local_rank
        while True:
            error: Exception | None = None
            try:
                host._load_checkpoint(info)
            except Exception as exc:
                error = exc
            kind, message = fallback.outcome_of(error)
            agreed, outcomes = fallback.settle(
                kind, message, info.path, each_node=each_node, local_rank=local_rank
            )
            if agreed == fallback.OK:
                return info
            if agreed == fallback.ERROR:
                if error is not None:
                    raise error
                raise ResumeError(
                    f"cannot resume from {info.path}: {fallback.describe(outcomes, fallback.ERROR)}"
                )
            cause = fallback.describe(outcomes, fallback.CORRUPT)
            marker = None
            if fallback.marks_here(outcomes, each_node=each_node, local_rank=local_rank):
                marker = fallback.mark(info.path, cause)
            falls_back = may_fall_back(self.mode)
            host._restore_resume_start_state(fresh)
            logger.error(
                "checkpoint %s is corrupt: %s; marked corrupt%s, it is never resumed from again%s",
                info.path,
                cause,
                f" ({marker})" if marker else "",
                "; falling back to the previous complete checkpoint" if falls_back else "",
            )
            if not falls_back:
                raise CheckpointCorruptError(
                    f"cannot resume from {info.path}: it is corrupt ({cause}); it was asked for "
                    "by path, so no other checkpoint is substituted: pass an earlier "
                    "checkpoint, or resume_from_checkpoint=True for the newest complete one"
                )
            older = self._older_complete(info, each_node)
            if older is None:
                # The model already holds weights of the corrupt checkpoint: starting from
                # scratch needs a fresh process. With every checkpoint marked, the next attempt
                # ("latest") starts from scratch; a path gets an error again.
                raise CheckpointCorruptError(
                    f"cannot resume: {info.path} is corrupt ({cause}) and no complete "
                    "checkpoint precedes it; it is marked, so a new run resuming from 'latest' "
                    "starts from scratch"
                )
            logger.error("falling back to %s (step %d)", older.path, older.step)
            info = older

    def _older_complete(self, failed: CheckpointInfo, each_node: bool) -> CheckpointInfo | None:
        """The newest complete checkpoint before ``failed``, the same on every rank."""
        if each_node:
            return per_node.resolve_resume(
                self._output_dir,
                True,
                from_env=True,  # none left: None (the caller reports it)
                local_rank=self._local_rank,
                below=failed.step,
            )
        older = CheckpointStore(parent_of(failed.path)).latest_complete(below=failed.step)
        step = fallback.agree_step(older.step if older is not None else None)
        return older if step is not None else None

    def note_resumed(self, loaded: CheckpointInfo | None) -> None:
        """After a resume (or none: ``loaded`` None): which later saves keep the complete
        checkpoints already there (:meth:`kept_checkpoint`)."""
        self.keep_complete_after = self._newer_complete_kept(loaded)

    def _newer_complete_kept(self, loaded: CheckpointInfo | None) -> int | None:
        """After a resume from a path: the loaded step when complete checkpoints newer than it
        are in the output dir (a caller's explicit path to an older one), whose steps' saves
        then keep them (:meth:`kept_checkpoint`); else None. The ranks agree (one all-reduce,
        only after a resume from a path), so that every rank takes the same path at a save."""
        if loaded is None or not keeps_newer(self.mode):
            return None  # "latest" loaded the newest complete one (or the one before a corrupt)
        store = CheckpointStore(self._output_dir)
        # only the directories of later steps are inspected (usually none)
        later = [n for n in store.names() if (parse_step(n) or -1) > loaded.step]
        newer = [i for i in (store.inspect(n) for n in later) if i.complete]
        if not collectives.agree_to_stop(bool(newer)):
            return None
        if newer:
            logger.warning(
                "resumed from %s as asked, although %s (step %d) is complete and newer: its "
                "steps are trained again, and the save of a step that has a complete checkpoint "
                "keeps that checkpoint (never replaced); to branch off, use another output_dir",
                loaded.path,
                newer[-1].path,
                newer[-1].step,
            )
        return loaded.step

    def kept_checkpoint(self, step: int) -> CheckpointInfo | None:
        """The complete checkpoint of ``step`` already in the output dir that this save must
        not replace (a run resumed from an older one), or None: save as usual. Every rank looks
        at its own view of the directory; it is kept only when every rank sees it complete."""
        if self.keep_complete_after is None or step <= self.keep_complete_after:
            return None
        info = CheckpointStore(self._output_dir).inspect(checkpoint_name(step))
        if collectives.agree_to_stop(not info.complete):
            return None
        logger.warning(
            "not saving step %d: %s is complete already (attempt %s) and newer than the "
            "checkpoint this run resumed from; it is kept, never replaced",
            step,
            info.path,
            info.attempt,
        )
        return info

    # -- resume: loading one checkpoint --------------------------------------------------------
    def load(self, info: CheckpointInfo) -> None:
        """Restore model, optimizer, scheduler, RNG, state and data position from ``info``: the
        tensors here, the progress and data position through the host's hooks."""
        host = self._host
        reader = CheckpointReader(info.path)
        has = reader.has
        fsdp = host._fsdp is not None

        # fsdp: model (and optimizer) from every rank's shards; False: optimizer not in them.
        sharded_optimizer = host._load_model_shards(info) if fsdp else None
        if sharded_optimizer is None and not has_model_files(host.model, has):
            raise ResumeError(
                f"cannot resume from {info.path}: it holds no weights this model can load "
                "(model.safetensors, its shards, or a PEFT adapter; pickled weights are not read)"
            )
        # DDP: a rank-shared save is read once over the ranks, each its share (share_resume.py)
        shared = None
        if sharded_optimizer is None and collectives.is_distributed():
            saved_world = (info.manifest or {}).get("world_size")
            shared = load_shared(reader, host.model, saved_world)
        if (
            sharded_optimizer is None
            and (shared is None or shared.optimizer is None)
            and has(OPTIMIZER_NAME)
            and has(SCHEDULER_NAME)
            and fault_in_alongside()
        ):
            # the optimizer file's buffer is allocated and faulted in on a helper thread while
            # the model file is read (CheckpointReader.prepare_owned); only with a second core
            reader.prepare_owned(OPTIMIZER_NAME)
        if sharded_optimizer is None and (shared is None or not shared.model_loaded):
            # a model wholly in host memory is read in one pass straight into its parameters,
            # checksummed as it is read (hf_format.read_into_tensors); otherwise copied from the
            # file's mapped pages, checksummed on helper threads (reader.wait_verified below)
            load_model_files(
                host.model,
                reader.load_bytes,
                has,
                info.path,
                load=reader.load_tensors_and_metadata,
            )
        state = reader.load_json(TRAINER_STATE_NAME)
        # Our record; checkpoints of earlier versions kept it in trainer_state.json; a
        # transformers.Trainer checkpoint has none.
        if has(RUNTIME_STATE_NAME):
            record = dict(reader.load_json(RUNTIME_STATE_NAME) or {})
        else:
            record = dict(state.get(PREEMPTIBLE_KEY) or {})
        host._restore_progress(state, record, info)

        optimizer, scheduler = host.optimizer, host.lr_scheduler
        assert optimizer is not None and scheduler is not None
        rank, world = collectives.rank(), collectives.world_size()
        rng_name = rng_file_name(rank, world)
        source = loaded_optimizer_source(
            sharded_optimizer=sharded_optimizer,
            has_ours=has(OPTIMIZER_NAME) or has(OPTIMIZER_INDEX_NAME),
            has_scheduler=has(SCHEDULER_NAME),
            has_hf_optimizer=has(HF_OPTIMIZER_NAME),
            has_hf_scheduler=has(HF_SCHEDULER_NAME),
        )
        if source == "ours":
            if sharded_optimizer is None:
                optimizer_state = (
                    shared.optimizer
                    if shared is not None and shared.optimizer is not None
                    else reader.load_optimizer()
                )
                assert optimizer_state is not None
                optimizer.load_state_dict(optimizer_state)
            scheduler.load_state_dict(reader.load_json(SCHEDULER_NAME))
        elif source == "transformers":
            # A transformers.Trainer checkpoint (or one of ours exported for it).
            where = f"{info.path}/{HF_OPTIMIZER_NAME}"
            optimizer.load_state_dict(torch_load(reader.load_bytes(HF_OPTIMIZER_NAME), where))
            where = f"{info.path}/{HF_SCHEDULER_NAME}"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # torch's "save optimizer too" note
                scheduler_state = torch_load(reader.load_bytes(HF_SCHEDULER_NAME), where)
            scheduler.load_state_dict(scheduler_state)
        else:
            step = host.state.global_step
            logger.warning(
                "%s has no optimizer/scheduler state (saved with save_only_model?): the optimizer "
                "starts fresh and the schedule is fast-forwarded to step %d; the run will not be "
                "identical to an uninterrupted one",
                info.path,
                step,
            )
            with warnings.catch_warnings():
                # "lr_scheduler.step() before optimizer.step()": intended when fast-forwarding.
                warnings.simplefilter("ignore", UserWarning)
                # (a metric-driven schedule has no per-step position to fast-forward)
                for _ in range(0 if host._metric_schedule else step):
                    scheduler.step()
        hf_rng_name = hf_rng_file_name(rank, world)
        if has(rng_name):
            restore_rng_state(reader.load_tensors(rng_name), reader.load_metadata(rng_name))
        elif has(hf_rng_name):
            where = f"{info.path}/{hf_rng_name}"
            load_hf_rng_state(torch_load(reader.load_bytes(hf_rng_name), where))
        else:
            logger.warning("%s has no %s: RNG state not restored", info.path, rng_name)
        dataset_state_name = dataset_state_file_name(rank, world)
        if host._is_iterable() and has(dataset_state_name) and not host.args.ignore_data_skip:
            host._dataset_state = reader.load_json(dataset_state_name)

        epoch, batch = host._restore_data_position(record, info)
        # Nothing trains on the state before its checksums matched the manifest.
        reader.wait_verified()
        host.last_checkpoint = info
        logger.info(
            "resumed from %s: step %d, epoch %d, batch %d of the epoch",
            info.path,
            host.state.global_step,
            epoch,
            batch,
        )

    # -- saving --------------------------------------------------------------------------------
    def save(self, jit: bool = False) -> CheckpointInfo:
        """Write ``checkpoint-<global_step>`` (all ranks); a step is never saved twice.

        With save_async a periodic save (``jit=False``) only snapshots the state and returns the
        in-flight checkpoint (incomplete until committed at a later step boundary); a JIT save
        first settles a write in flight (waits for it when it is of this step, else cancels it)
        and the time that takes counts as part of the JIT save's measured time."""
        host = self._host
        started = time.perf_counter()
        waited = self._settle(jit=jit)
        if jit:
            self.staging.on_stop()  # kept snapshot memory, given back when short
        step = host.state.global_step
        last = host.last_checkpoint
        if last is not None and last.step == step:
            return last
        kept = self.kept_checkpoint(step)
        if kept is not None:
            host.last_checkpoint = kept
            return kept
        if not jit and self.save_async_active():
            return self._start_async_save()
        writer = self._new_writer(step)
        try:
            writer.begin()
            host._stamp(f"writing {'the JIT ' if jit else ''}checkpoint-{step}")
            writer.write_entries(host._checkpoint_entries(writer.is_coordinator, jit))
            info = writer.commit(host._manifest_extra())
        except Exception:
            # e.g. ENOSPC: its partial directory, newer than every complete checkpoint, would
            # hold the space (rotation keeps what may still be being written)
            writer.discard()
            raise
        seconds = info.save_seconds if info.save_seconds is not None else None
        if seconds is None:
            seconds = time.perf_counter() - started
        self._remove_superseded(writer.is_coordinator)
        host._after_checkpoint_commit(info, seconds + waited)
        return info

    def _new_writer(self, step: int) -> CheckpointWriter:
        host = self._host
        barriers = [0]

        def barrier() -> None:
            # entering a barrier is progress: a rank that never gets here is the one the others
            # wait for (peers.py: hung_ranks)
            barriers[0] += 1
            host._stamp(f"barrier {barriers[0]} of checkpoint-{step}")
            collectives.barrier()

        return CheckpointWriter(
            self._output_dir,
            step,
            rank=collectives.rank(),
            world_size=collectives.world_size(),
            barrier=barrier,
            # save_on_each_node: every node's main process writes a full copy on its own disk
            **per_node.writer_options(host.args),
        )

    def entries(self, main: bool, jit: bool, *, snapshot: bool = False) -> Entries:
        """The files of a checkpoint, in write order: (name, data, per_rank). ``data`` is bytes,
        a TensorFile (written as it is serialised), or a callable returning bytes (our record,
        built when written: it holds the JIT save's SIGTERM-to-exit time). ``snapshot``: for a
        background write, every tensor is copied to host memory and every record built now, so
        training may go on changing the originals."""
        host = self._host
        args = host.args
        fsdp = host._fsdp is not None
        entries: Entries = []
        rank, world = collectives.rank(), collectives.world_size()
        # DDP: the replicated model and optimizer state is split across the ranks by bytes,
        # each writing its share at once (shares.py); one copy per node keeps whole files.
        share = world > 1 and not fsdp and not per_node.each_node_active(args)
        groups: list[ShareGroup] = []
        # The model as transformers saves it (a PreTrainedModel opens with from_pretrained, a
        # PEFT model's checkpoint holds the adapter only) and the processing class's files.
        processing = host._processing_class_to_save()
        weights = model_weights(host.model) if share else None
        if weights is not None:
            groups.append(ShareGroup(MODEL_STEM, weights.tensors, weights.metadata))
        if fsdp:
            # every rank: its own pieces of the sharded model and optimizer state (fsdp.py)
            entries += [(n, d, False) for n, d in host._fsdp_entries(main, jit)]
        if main:
            if not fsdp and weights is None:
                # the weights stay tensors: written as they are serialised, no file in memory
                entries += [(n, d, False) for n, d in model_file_entries(host.model, processing)]
            else:
                entries += [(n, d, False) for n, d in side_files(host.model, processing)]
        if not args.save_only_model:
            optimizer, scheduler = host.optimizer, host.lr_scheduler
            assert optimizer is not None and scheduler is not None
            if not fsdp and (main or share):
                tensors, meta = optimizer_state_to_tensors(optimizer.state_dict())
                if share:
                    extra = {OPTIMIZER_META_KEY: meta}
                    groups.append(ShareGroup(OPTIMIZER_STEM, tensors, index_extra=extra))
                else:
                    file = TensorFile(tensors, {OPTIMIZER_META_KEY: meta})
                    entries.append((OPTIMIZER_NAME, file, False))
            if main:
                entries.append((SCHEDULER_NAME, _json_bytes(scheduler.state_dict()), False))
            rng_tensors, rng_meta = host._checkpoint_rng_state()
            entries.append((rng_file_name(rank, world), TensorFile(rng_tensors, rng_meta), True))
            if host._is_iterable():
                dataset_state = iterable_dataset_state(
                    host.train_dataset, args.dataloader_num_workers
                )
                if dataset_state is not None:
                    entries.append(
                        (dataset_state_file_name(rank, world), _json_bytes(dataset_state), True)
                    )
        if share:
            # Each rank plans its share alone: the plans must be the same (one small all-gather
            # of their digests), or no index could be trusted (a tensor on one rank only).
            host._stamp(f"agreeing on the share plan of checkpoint-{host.state.global_step}")
            agree_on_plan(groups, world, per_node.gather_objects)
        entries += [(n, d, False) for n, d in share_entries(groups, rank, world, coordinator=main)]
        # Every rank records the best checkpoint, so every rank loads it at the end.
        host._before_checkpoint_write()
        if main:
            entries.append((TRAINING_ARGS_NAME, _json_bytes(args.to_dict()), False))
            # trainer_state.json holds transformers' TrainerState fields only (its Trainer loads
            # the file with TrainerState(**json)); our record is a file of its own.
            state = host.state.to_dict()
            state.pop(PREEMPTIBLE_KEY, None)
            entries.append((TRAINER_STATE_NAME, _json_bytes(state), False))
            record: Callable[[], bytes] = lambda: _json_bytes(  # noqa: E731
                host._preemptible_record(jit, snapshot)
            )
            entries.append((RUNTIME_STATE_NAME, record() if snapshot else record, False))
        if snapshot:
            buffers = self.staging.buffers
            entries = [(n, snapshot_entry(n, d, buffers), r) for n, d, r in entries]
        return entries

    def save_model(self, target: str, gathered: dict[str, torch.Tensor] | None) -> bool:
        """``Trainer.save_model``'s files (the model as transformers saves it, the processing
        class's files, training_args.json) in ``target``; True on the process that wrote them.
        Every rank calls it (the barrier at its end)."""
        host = self._host
        accelerator = host.accelerator
        if not per_node.is_checkpoint_writer(
            host.args,
            is_main_process=accelerator.is_main_process,
            is_local_main_process=accelerator.is_local_main_process,
        ):
            collectives.barrier()
            return False
        storage = Storage(target)
        storage.makedirs("")
        for name, data in model_file_entries(
            host.model, host._processing_class_to_save(), gathered=gathered
        ):
            write_entry(storage, name, data)
        storage.write_json(TRAINING_ARGS_NAME, host.args.to_dict())
        storage.fsync_dir("")
        collectives.barrier()
        return True

    # -- asynchronous periodic checkpoints (save_async) ----------------------------------------
    def save_async_active(self) -> bool:
        """save_async, resolved: None means on under the operator for a plain single process."""
        host = self._host
        return resolve_save_async(
            host.args,
            operator=under_operator(),
            world_size=collectives.world_size(),
            fsdp=host._fsdp is not None,
        )

    def _start_async_save(self) -> CheckpointInfo:
        """Snapshot the state (the training stall) and hand it to a writer thread."""
        if self.in_flight is not None:
            raise CheckpointError("a background checkpoint is already in flight")
        host = self._host
        started = time.perf_counter()
        step = host.state.global_step
        writer = self._new_writer(step)
        # Sentinel first. Several ranks create it together (a barrier) here; one rank lets the
        # writer thread create it before its first file.
        alone = writer.world_size == 1
        if not alone:
            writer.begin()
        self.staging.before_snapshot()
        entries = host._checkpoint_entries(writer.is_coordinator, False, snapshot=True)
        self.in_flight = BackgroundSave(writer, entries, begin=alone)
        stall = time.perf_counter() - started
        self.staging.after_snapshot(stall)
        logger.info(
            "checkpoint %s: state copied in %.3f s, written in the background", writer.path, stall
        )
        return CheckpointInfo(
            path=writer.path,
            name=writer.name,
            step=step,
            complete=False,
            reason="being written in the background (save_async)",
            size_bytes=0,
            manifest=None,
            attempt=writer.attempt,
        )

    def poll(self) -> None:
        """At a step boundary: commit the background checkpoint once every rank wrote its files
        (one all-reduce per step while a write is in flight, none otherwise)."""
        save = self.in_flight
        if save is None:
            return
        if collectives.agree_to_stop(not save.done()):
            return  # some rank is still writing
        self._commit()

    def stop_while_pending(self) -> bool:
        """A periodic save is due while a background write is still in flight (at most one):
        wait for it, all ranks agreeing every ``ASYNC_POLL_SECONDS``, but not past a SIGTERM.
        True when a JIT stop became due meanwhile: the caller skips the periodic save and the
        stop that follows writes this step, cancelling the older write instead of waiting for
        it. False once every rank's write is done (committed by the save that follows). The
        last step waits as before: the end of training commits what is in flight."""
        host = self._host
        save = self.in_flight
        if save is None or host.control.should_training_stop:
            return False
        while True:
            latch = getattr(host, "sigterm_latch", None)
            wants_jit = bool(host.args.enable_jit_checkpoint and latch and latch.should_act())
            # 2: some rank must stop; 1: some rank is still writing; 0: every rank is done.
            state = collectives.agree_max(2 if wants_jit else (0 if save.done() else 1))
            if state == 2:
                return True
            if state == 0:
                return False
            save.wait(ASYNC_POLL_SECONDS)

    def _commit(self) -> None:
        save = self.in_flight
        assert save is not None
        save.wait()
        self.in_flight = None
        self.staging.after_write(save.seconds)
        failed = collectives.agree_to_stop(save.error is not None)
        if failed:
            # every rank's writer thread has ended (each waited, then they agreed)
            save.writer.discard(every_rank_done=True)
            if save.error is not None:
                raise save.error
            raise CheckpointError(
                f"the background write of {save.writer.path} failed on another rank"
            )
        committing = time.perf_counter()
        info = save.writer.commit(self._host._manifest_extra())
        self._host._after_checkpoint_commit(
            info, save.seconds + time.perf_counter() - committing, blocking=False
        )

    def _settle(self, *, jit: bool) -> float:
        """Before a save: at most one write in flight. A periodic save waits for the one in
        flight and commits it; a JIT save does the same when it is of the same step, and
        otherwise cancels it (the newer state supersedes it; its directory, incomplete, is
        removed once the JIT checkpoint is committed). Returns the seconds spent."""
        save = self.in_flight
        if save is None:
            return 0.0
        started = time.perf_counter()
        step = self._host.state.global_step
        if supersedes(jit=jit, pending_step=save.step, step=step):
            save.cancel()
            self.in_flight = None
            self._superseded = save
            logger.warning(
                "JIT checkpoint of step %d supersedes the background checkpoint %s (cancelled; "
                "removed once the JIT checkpoint is committed)",
                step,
                save.writer.path,
            )
        else:
            self._commit()
        return time.perf_counter() - started

    def _remove_superseded(self, coordinator: bool) -> None:
        """After the JIT checkpoint is committed: the coordinator removes the directory of the
        background write it cancelled (an abandoned write older than a complete checkpoint;
        every rank's writer thread ended before the JIT save began). A crash before this point
        leaves it incomplete, which resume skips."""
        save, self._superseded = self._superseded, None
        if save is None or not coordinator:
            return
        writer = save.writer
        try:
            if not inspect_checkpoint(writer.root, writer.name).complete:
                remove_checkpoint(writer.root, writer.name, writer.attempt)
                writer.root.fsync_dir("")
        except Exception as exc:  # the JIT checkpoint is committed: never fail the stop here
            logger.warning("could not remove the superseded checkpoint %s: %s", writer.path, exc)

    def settle_before_deadline(self, budget: float | None) -> None:
        """No JIT save (the deadline is too short): a background write in flight is committed if
        every rank's finishes within ``budget`` seconds (a newer complete checkpoint), else
        cancelled; never waited for past it (None: no deadline)."""
        save = self.in_flight
        if save is None:
            return
        save.wait(budget)
        if collectives.agree_to_stop(not save.done()):
            logger.warning(
                "the background write of %s cannot finish before the deadline: cancelled",
                save.writer.path,
            )
            self.abandon()
            return
        self._commit()

    def finish(self) -> None:
        """End of training: the checkpoint in flight is committed before train() returns."""
        if self.in_flight is not None:
            self._commit()

    def abandon(self) -> None:
        """train() is leaving: on an error, stop the writer thread (its checkpoint stays
        incomplete; no collective is attempted on a failing run); free the snapshot buffers."""
        save, self.in_flight = self.in_flight, None
        if save is not None:
            save.cancel()
            save.writer.discard()  # this rank's thread has ended; one rank: the directory
        self.staging.clear()

    def maybe_pin_ahead(self, step: int, save_steps: int, step_seconds: float | None) -> None:
        """After a step under save_strategy='steps': pin the staging memory ahead of the next
        periodic save when it is not kept (checkpoint/pinned.py)."""
        self.staging.maybe_pin_ahead(
            step, save_steps, step_seconds, writing=self.in_flight is not None
        )
