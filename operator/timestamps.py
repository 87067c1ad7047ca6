"""RFC 3339 timestamps as the Kubernetes API writes them (``2026-12-01T18:00:00Z``)."""

from __future__ import annotations

import datetime as dt

__all__ = ["now_rfc3339", "parse_rfc3339"]


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(value: str | None) -> float | None:
    """Seconds since the epoch; None for a missing or unreadable value (status fields written by
    older operators or by hand must not stop a reconcile pass)."""
    if not value:
        return None
    try:
        return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
