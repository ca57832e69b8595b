"""The ``delayq`` command: migrate, demo, worker, and the operator's view of queued messages.

Every command takes ``--url`` (or ``DELAYQ_URL``; default ``sqlite:///delayq.db``). Bad input prints one
line saying what to do and exits with code 2, without a traceback.

``main`` (the console script ``delayq``) and the command line's other names are imported on first use:
``delayq.topics.cli`` builds on ``delayq.cli._common`` without importing the commands, which include its
own.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from delayq.cli._root import main as main

__all__ = ["main"]

_PARTS = ("_app", "_dead_letters", "_messages", "_stats", "_worker", "_setup", "_root", "_common")
"""The modules that define the names below."""

_NAMES = frozenset(
    [
        "ASYNC_DRIVERS",
        "AnywhereOptions",
        "CANCEL_CHUNK",
        "DEFAULT_URL",
        "DRIVER_HINTS",
        "DURATION",
        "Fail",
        "INSTALL",
        "KNOWN_SHOWN",
        "LOG_LEVELS",
        "OTHER_DRIVERS",
        "PAYLOAD_SHOWN",
        "SECRET_QUERY_KEYS",
        "STATE_COLOURS",
        "UNITS",
        "admin_queue",
        "cancel",
        "check_schema",
        "check_sqlite_file",
        "check_url",
        "connect",
        "cron",
        "cron_ls",
        "cron_uninstall",
        "dead",
        "demo",
        "emit",
        "enqueue",
        "friendly",
        "json_value",
        "load_handlers",
        "ls",
        "main",
        "migrate",
        "parse_duration",
        "parse_time",
        "prefix_chunks",
        "read_payload",
        "relative",
        "reschedule",
        "run_now",
        "serve_metrics",
        "show",
        "shown_url",
        "stats",
        "top",
        "unknown_queue_note",
        "worker",
        "worker_engine",
    ]
)
"""The names ``delayq.cli`` had as one module, still importable from it."""


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from delayq.cli import _app  # noqa: F401  (every command registered on ``main``)

    for part in _PARTS:
        found = vars(importlib.import_module(f"{__name__}.{part}"))
        if name in found:
            return found[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
