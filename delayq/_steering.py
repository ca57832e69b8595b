"""The two exceptions a handler raises to steer its message (re-exported by ``delayq.handler``): a leaf,
so that what reports outcomes (``delayq.observe``) can tell them apart without importing the handlers."""

from __future__ import annotations

import datetime as dt


class Retry(Exception):
    """Raise in ``handle`` to try the message again after ``after`` (default: the handler's policy's delay).

    A requested retry is not logged as a failure (INFO, with ``reason``), but it counts as an
    attempt: the delivery it ends was one of ``retry.max_attempts``, and when it was the last one
    the message moves to the dead letters with ``reason``. A handler that waits on something for
    long should raise it with a long ``after`` rather than often, or raise ``max_attempts``.
    """

    def __init__(self, after: dt.timedelta | None = None, reason: str | None = None) -> None:
        super().__init__(reason or "retry requested")
        self.after = after
        self.reason = reason


class DeadLetter(Exception):
    """Raise in ``handle`` to give up on the message at once: it moves to the dead letters."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
