"""DataLoader workers that survive a SIGTERM meant for the training process.

A SIGTERM forwarded to a whole process group (torchrun's ``os.killpg`` on each worker's group,
``accelerate launch``, ``trainer-runtime launch``, dumb-init, ``kill -TERM -PGID``) or sent to
every process of a job reaches the DataLoader worker processes too. torch's worker handler exits
quietly only when the parent sent the signal; otherwise the worker dies by it, and the training
process's SIGCHLD handler raises ``DataLoader worker (pid N) is killed by signal: Terminated``
wherever it is (a forward pass, the JIT save): no JIT checkpoint, the attempt counted as a failure.

:func:`shield_from_foreign_sigterm`, run first in each worker (as its ``worker_init_fn``, chained
in front of the user's own by :class:`SigtermShieldedInit`), keeps torch's rule for the parent and
ignores everyone else: SIGTERM is blocked in the worker and a daemon thread takes each one with
``sigwaitinfo`` (which tells the sender, as a Python signal handler cannot). From the parent (the
fallback ``terminate()`` of torch's ``_shutdown_workers``, multiprocessing's exit handler) or once
the parent is gone, the worker exits 0 at once, as torch's handler does; any other is logged
and dropped, and the training process decides when its workers end (the iterator's normal
shutdown, ``done_event`` and ``None`` on the index queue, is untouched; so is torch's watchdog,
which ends a worker whose parent died).

:func:`shield_dataloader` puts the chained ``worker_init_fn`` on a DataLoader already built (it is
read when an iterator starts its workers), so DataLoaders built by transformers' Trainer or by a
user are covered without rebuilding them.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

__all__ = [
    "SigtermShieldedInit",
    "is_shielded",
    "shield_dataloader",
    "shield_from_foreign_sigterm",
    "shield_prepared_dataloaders",
    "shielded_worker_init_fn",
]

logger = logging.getLogger(__name__)

WorkerInitFn = Callable[[int], None]

# Per worker process: the thread is started once, however many shielded inits run in it.
_installed_in: int | None = None


def _unblock_in_child() -> None:
    # A process a worker forks (os.fork, multiprocessing) starts with the default mask: the block
    # is this worker's business only.
    global _installed_in
    _installed_in = None
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _take_sigterms(parent: int) -> None:
    while True:
        info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid == parent or os.getppid() != parent:
            # torch's own rule: the parent asks (its shutdown's terminate()), or it is gone.
            os._exit(0)
        logger.debug(
            "DataLoader worker %d: ignored a SIGTERM from pid %d (not the training process %d)",
            os.getpid(),
            info.si_pid,
            parent,
        )


def _in_worker_process() -> bool:
    # Never in the training process itself (a worker_init_fn called by hand, thread workers):
    # blocking SIGTERM there would take the trainer's own signal away from it.
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    if info is None or getattr(info, "worker_method", "multiprocessing") != "multiprocessing":
        return False
    return threading.current_thread() is threading.main_thread()


def shield_from_foreign_sigterm() -> bool:
    """In a DataLoader worker: exit on a SIGTERM from the parent (or once it is gone), ignore any
    other. Idempotent per process; returns whether it was installed now.

    Must run in the worker's main thread before it starts threads of its own (the first thing of
    ``worker_init_fn``): threads started later inherit the block.
    """
    global _installed_in
    pid = os.getpid()
    if _installed_in == pid or not _in_worker_process():
        return False
    parent = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(
        target=_take_sigterms, args=(parent,), name="sigterm-filter", daemon=True
    ).start()
    if _installed_in is None and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_unblock_in_child)
    _installed_in = pid
    return True


class SigtermShieldedInit:
    """A ``worker_init_fn``: :func:`shield_from_foreign_sigterm`, then the user's own (kept).

    A module-level class holding the user's function, so it pickles for 'spawn' and
    'forkserver' workers whenever the user's function does.
    """

    def __init__(self, user_fn: WorkerInitFn | None = None) -> None:
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        shield_from_foreign_sigterm()
        if self.user_fn is not None:
            self.user_fn(worker_id)

    def __repr__(self) -> str:
        return f"SigtermShieldedInit({self.user_fn!r})"


def is_shielded(fn: Any) -> bool:
    return isinstance(fn, SigtermShieldedInit)


def shielded_worker_init_fn(user_fn: WorkerInitFn | None = None) -> SigtermShieldedInit:
    """``user_fn`` (or nothing) behind the shield; a function already shielded is returned as is.

    The one-line fix for a DataLoader built outside the Trainer::

        DataLoader(..., num_workers=2, worker_init_fn=shielded_worker_init_fn(my_init))
    """
    _start_workers_blocked()
    if isinstance(user_fn, SigtermShieldedInit):
        return user_fn
    return SigtermShieldedInit(user_fn)


def shield_dataloader(loader: Any) -> Any:
    """Put the shield in front of ``loader.worker_init_fn`` (in place; returns ``loader``).

    Any object with ``num_workers`` and ``worker_init_fn`` (torch's DataLoader, accelerate's
    DataLoaderShard / DataLoaderDispatcher); others, and loaders without workers, are returned
    unchanged. Takes effect for the iterators started afterwards (a persistent iterator already
    running keeps the workers it has). Their workers start with SIGTERM blocked
    (:func:`_start_workers_blocked`), so none is unshielded even for a moment.
    """
    if int(getattr(loader, "num_workers", 0) or 0) <= 0 or not hasattr(loader, "worker_init_fn"):
        return loader
    current = loader.worker_init_fn
    if not is_shielded(current):
        loader.worker_init_fn = shielded_worker_init_fn(current)
    _start_workers_blocked()
    return loader


def _start_method(loader: Any) -> str | None:
    import multiprocessing

    context = getattr(loader, "multiprocessing_context", None)
    try:
        if isinstance(context, str):
            return context
        if context is None:
            return multiprocessing.get_start_method()
        return str(context.get_start_method())
    except (AttributeError, RuntimeError, ValueError):
        return None


def _start_workers_blocked() -> None:
    """From now on, a DataLoader whose ``worker_init_fn`` is shielded starts its 'fork' workers
    with SIGTERM blocked, so that one sent before the shield runs in the worker waits for it
    instead of killing the worker.

    torch's ``DataLoader._get_iterator`` (where workers are started) is wrapped once; loaders
    without the shield are untouched. Only 'fork' passes the mask on: multiprocessing's 'spawn'
    and 'forkserver' start their processes with an empty one (such a worker is unshielded while
    its interpreter starts and unpickles the dataset). In the training process the block lasts
    while the workers start; a SIGTERM of its own that came meanwhile is delivered when it ends.
    """
    from torch.utils.data import DataLoader

    original = DataLoader._get_iterator
    if getattr(original, "__sigterm_shield__", False):
        return

    @functools.wraps(original)
    def _get_iterator(self: Any) -> Any:
        if not is_shielded(getattr(self, "worker_init_fn", None)) or _start_method(self) != "fork":
            return original(self)
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            return original(self)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    _get_iterator.__sigterm_shield__ = True  # type: ignore[attr-defined]
    DataLoader._get_iterator = _get_iterator  # type: ignore[method-assign]


def shield_prepared_dataloaders(accelerator: Any) -> Any:
    """Shield every DataLoader that goes through ``accelerator.prepare`` /
    ``accelerator.prepare_data_loader`` (this instance only; idempotent; returns it).

    accelerate rebuilds the loader from the original's attributes, ``worker_init_fn`` included:
    the original is shielded first, the result again in case a version drops the attribute.
    ``None`` (a trainer that has no accelerator yet) is returned as it is.
    """
    original = getattr(accelerator, "prepare_data_loader", None)
    if original is None or getattr(original, "__sigterm_shield__", False):
        return accelerator

    def prepare_data_loader(data_loader: Any, *args: Any, **kwargs: Any) -> Any:
        return shield_dataloader(original(shield_dataloader(data_loader), *args, **kwargs))

    prepare_data_loader.__sigterm_shield__ = True  # type: ignore[attr-defined]
    accelerator.prepare_data_loader = prepare_data_loader
    return accelerator
