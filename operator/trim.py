"""Drop ``metadata.managedFields`` from every object kopf watches, as it arrives.

kopf keeps the last body of every watched object for as long as the object exists (a
TrainingJob's daemon holds it), and a body's ``managedFields`` (the apiserver's record of which
client last set which field) were about 40% of a running TrainingJob's decoded JSON (traced at
1,500 TrainingJobs, docs/operator.md "Operator at scale"). Neither kopf nor the operator reads
them: the operator writes its status with PUT on the status subresource and kopf patches
finalizers and annotations, none of which send managedFields back.

kopf has no public hook between its watch stream and its per-object memory, so ``install``
wraps the one function every stream of kopf passes through (the initial list and the watch
that follows), ``kopf._cogs.clients.watching.continuous_watch``. Where a kopf release has no
such function, nothing is wrapped and the operator runs as before, with more memory (logged).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

__all__ = ["install", "trim_event"]

log = logging.getLogger("preemptible_operator")

_MARK = "_preemptible_trimmed"


def trim_event(event: Any) -> Any:
    """The watch event (``{"type", "object"}``) with its object's managedFields removed, in
    place; anything else (kopf's bookmarks, an event without an object) as it is."""
    if isinstance(event, dict):
        obj = event.get("object")
        if isinstance(obj, dict):
            meta = obj.get("metadata")
            if isinstance(meta, dict):
                meta.pop("managedFields", None)
    return event


def _trimmed(
    watch: Callable[..., AsyncIterator[Any]],
) -> Callable[..., AsyncIterator[Any]]:
    @functools.wraps(watch)
    async def continuous_watch(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        async for event in watch(*args, **kwargs):
            yield trim_event(event)

    setattr(continuous_watch, _MARK, True)
    return continuous_watch


def install() -> bool:
    """Wrap kopf's watch stream (once; later calls do nothing). True where it is wrapped."""
    try:
        from kopf._cogs.clients import watching
    except ImportError:
        log.warning("kopf's watch module was not found: watched objects keep managedFields")
        return False
    current = getattr(watching, "continuous_watch", None)
    if current is None:
        log.warning("kopf has no continuous_watch: watched objects keep managedFields")
        return False
    if not getattr(current, _MARK, False):
        watching.continuous_watch = _trimmed(current)
    return True
