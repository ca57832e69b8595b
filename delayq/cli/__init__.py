"""The ``delayq`` command: migrate, demo, worker, and the operator's view of queued messages.

Every command takes ``--url`` (or ``DELAYQ_URL``; default ``sqlite:///delayq.db``). Bad input prints one
line saying what to do and exits with code 2, without a traceback.

One module per command group, each registering its commands on ``main`` (``_root``: the group and what
its commands share): ``_setup`` (migrate, demo), ``_worker``, ``_messages`` (enqueue, ls, show,
reschedule, run-now, cancel), ``_dead_letters`` (dead requeue/purge), ``_stats`` (stats, top), ``_cron``,
``_flow`` (pause, resume, limit), ``_web`` (the dashboard), ``_workers`` (the worker registry), ``_audit``
(who did what), ``_bulk`` (purge, and the filter forms of cancel, reschedule and dead);
``_app`` imports them all and adds ``delayq.topics.cli``'s group. ``_common`` is what they share with
``delayq.topics.cli``, which imports it without the commands: ``main`` (the console script) and the
other names of ``delayq.cli`` are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from delayq.cli._root import main as main

__all__ = ["main"]

_PARTS = ("_root", "_setup", "_worker", "_messages", "_dead_letters", "_stats", "_cron", "_common")
"""The modules that define the names of ``_NAMES``."""

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
    """A name of ``_NAMES``, from the module that defines it, once every command is registered."""
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from delayq.cli import _app  # noqa: F401  (every command registered on ``main``)

    for part in _PARTS:
        found = vars(importlib.import_module(f"{__name__}.{part}"))
        if name in found:
            return found[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
