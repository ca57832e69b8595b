"""The ``delayq`` command assembled: every command registered on ``main``, the topics' group included."""

from __future__ import annotations

from delayq.cli import (  # noqa: F401  (they register on main)
    _audit,
    _bulk,
    _cron,
    _dead_letters,
    _flow,
    _messages,
    _setup,
    _stats,
    _web,
    _worker,
    _workers,
)
from delayq.cli._root import main
from delayq.topics.cli import topics

main.add_command(topics)
