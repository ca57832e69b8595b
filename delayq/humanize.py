"""Durations as people write them, for logs and the command line."""

from __future__ import annotations

import datetime as dt
import json

__all__ = ["exact", "human", "shorten"]


def human(span: dt.timedelta) -> str:
    """A duration as people write it: ``850ms``, ``2.2s``, ``5m 03s``, ``1h 30m``, ``2d 4h``."""
    total = abs(span.total_seconds())
    if total < 1:
        return f"{total * 1000:.0f}ms"
    if total < 60:
        return f"{total:.1f}s"
    minutes, seconds = divmod(int(total), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {seconds:02d}s"


def exact(span: dt.timedelta) -> str:
    """A duration as an error message gives it back: signed, to the millisecond, its zero parts left out:
    ``-1s``, ``250ms``, ``1.5s``, ``1m 30s``, ``2d 4h`` (``human`` rounds, and drops the sign)."""
    micros = (span.days * 86_400 + span.seconds) * 1_000_000 + span.microseconds  # (abs() overflows at the edge)
    ms = abs(micros) // 1000
    sign = "-" if micros < 0 and ms else ""
    if ms < 1000:
        return f"{sign}{ms}ms"
    seconds, ms = divmod(ms, 1000)
    minutes, seconds = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    parts = [f"{n}{unit}" for n, unit in ((days, "d"), (hours, "h"), (minutes, "m")) if n]
    if seconds or ms:
        parts.append(f"{seconds}.{ms:03d}".rstrip("0").rstrip(".") + "s")
    return sign + " ".join(parts)


def shorten(value: object, limit: int) -> object:
    """``value`` as it is when its JSON is at most ``limit`` characters; else that JSON cut, with its length."""
    text = json.dumps(value, default=str)
    if len(text) <= limit:
        return value
    return f"{text[:limit]}… ({len(text):,} characters)"
