"""managedFields are dropped from every object kopf watches, before kopf keeps its body
(operator/trim.py): about 40% of a running TrainingJob's decoded JSON, never read."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kopf._cogs.clients import watching

from preemptible_operator import trim

_FIELDS = [{"manager": "kubectl", "operation": "Apply", "fieldsV1": {"f:spec": {}}}]


def _event(kind: str = "MODIFIED") -> dict[str, Any]:
    return {
        "type": kind,
        "object": {
            "metadata": {"name": "tj", "resourceVersion": "7", "managedFields": list(_FIELDS)},
            "spec": {"numNodes": 2},
        },
    }


@pytest.mark.parametrize(
    ("event", "expected"),
    [
        (
            _event(),
            {"type": "MODIFIED", "object": {"metadata": {"name": "tj", "resourceVersion": "7"},
                                            "spec": {"numNodes": 2}}},
        ),
        (_event(None), {"type": None, "object": {"metadata": {"name": "tj", "resourceVersion": "7"},
                                                  "spec": {"numNodes": 2}}}),
        # an object without managedFields, an error's Status, kopf's bookmarks: as they are
        ({"type": "ADDED", "object": {"metadata": {"name": "x"}}},
         {"type": "ADDED", "object": {"metadata": {"name": "x"}}}),
        ({"type": "ERROR", "object": {"kind": "Status", "code": 410}},
         {"type": "ERROR", "object": {"kind": "Status", "code": 410}}),
        (watching.Bookmark.LISTED, watching.Bookmark.LISTED),
        ({"type": "BOOKMARK", "object": None}, {"type": "BOOKMARK", "object": None}),
    ],
)  # fmt: skip
def test_trim_event(event: Any, expected: Any) -> None:
    assert trim.trim_event(event) == expected


def test_kopfs_watch_stream_yields_objects_without_managed_fields(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through kopf's own infinite_watch (which every watcher of kopf reads), with the API
    stream below it replaced: the wrap is on the function kopf really calls."""

    async def api_stream(**_: Any) -> AsyncIterator[Any]:
        yield _event("ADDED")
        yield watching.Bookmark.LISTED
        yield _event()

    monkeypatch.setattr(watching, "continuous_watch", api_stream)
    assert trim.install()
    assert trim.install()  # a second call wraps nothing more

    async def read() -> list[Any]:
        settings = type("S", (), {"watching": type("W", (), {"reconnect_backoff": 0})()})()
        out = []
        async for event in watching.infinite_watch(
            settings=settings, resource=None, namespace=None, _iterations=1
        ):
            out.append(event)
        return out

    events = asyncio.run(read())
    assert [e if isinstance(e, watching.Bookmark) else e["type"] for e in events] == [
        "ADDED", watching.Bookmark.LISTED, "MODIFIED",
    ]  # fmt: skip
    for event in (events[0], events[2]):
        assert event["object"]["metadata"] == {"name": "tj", "resourceVersion": "7"}
    # wrapped once: the wrapper of the wrapper would be marked too, and call the stream twice
    assert watching.continuous_watch.__wrapped__ is api_stream


def test_install_wraps_nothing_where_kopf_has_no_such_function(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(watching, "continuous_watch")
    assert trim.install() is False
