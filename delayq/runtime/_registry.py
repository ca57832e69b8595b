"""The worker registry: each worker's row in ``{prefix}workers``, for ``delayq workers``, ``top`` and the dashboard.

A worker inserts its row when it starts, updates it (heartbeat, slots in use, handled) from its heartbeat loop
every ``BEAT`` seconds (one UPDATE; no loop of its own), marks it stopped on a clean stop, and every
``FORGET_EVERY`` beats deletes up to ``FORGET_BATCH`` rows whose heartbeat is older than ``FORGET_AFTER``
(a crashed worker's, or one stopped long ago). A row whose heartbeat is older than ``delayq.browse.GONE_AFTER``
(60 s) reads as gone (``delayq.browse.WorkerInfo.state``).

The registry is for people: it never stops a worker from working. Each statement runs in a short transaction
whose connection is dropped after ``CALL_BOUND`` seconds (a row lock held on the row, a silent network), and a
failure (the table missing, say) is logged and tried again at the next beat.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from delayq.clock import Clock, duration_ms, to_ms
from delayq.dialects import bounds
from delayq.queue import _workers
from delayq.runtime._jobs import describe
from delayq.schema import Tables

log = logging.getLogger("delayq.worker")

BEAT = 10.0
"""Seconds between a worker's registry heartbeats."""
FORGET_AFTER = dt.timedelta(hours=1)
"""Rows whose heartbeat is older than this are deleted (by any running worker)."""
FORGET_AFTER_MS = duration_ms(FORGET_AFTER)
FORGET_EVERY = 6
"""Every this many beats (a minute), a worker deletes forgotten rows."""
FORGET_BATCH = 100
"""Rows one deletion removes at most."""
CALL_BOUND = 2.0
"""Seconds a registry statement may wait for the database before its connection is dropped."""
WARN_EVERY = 30
"""A registry failing again and again is logged at the first failure and every this many after."""


class Registry:
    """One worker's row in the registry (see the module's docstring). One loop calls ``beat`` (the heartbeat's);
    ``start`` comes before it beats, ``stop`` may come while a beat runs: that beat's UPDATE leaves a stopped row
    as it is (it matches running rows only), and no beat inserts the row again once stopped."""

    def __init__(
        self,
        engine: sa.Engine,
        tables: Tables,
        *,
        name: str,
        driver: str,
        queues: Sequence[str],
        topics: Sequence[str],
        slots: int,
        clock: Clock | None,
    ) -> None:
        self.engine, self.tables, self.clock = engine, tables, clock
        self.id = str(uuid.uuid4())
        self._row = {
            "worker_id": self.id,
            "name": name,
            "host": socket.gethostname()[:200],
            "pid": os.getpid(),
            "driver": driver,
            "queues": json.dumps(list(queues)),
            "topics": json.dumps(list(topics)),
            "slots": slots,
        }
        self._active = False  # between start and stop: beats go out
        self._next = 0.0  # monotonic: no beat before
        self._beats = 0
        self._failures = 0  # in a row

    def start(self, in_use: int, handled: int) -> None:
        """Insert the row (a failure is logged; the next beat tries again)."""
        self._beats = 0
        self._run("register", lambda c: self._insert(c, in_use, handled))
        self._next = time.monotonic() + BEAT
        self._active = True  # (only now: a beat meanwhile would insert the row too)

    def beat(self, in_use: int, handled: int) -> None:
        """Every ``BEAT`` seconds: update the row (insert it again if it went), now and then forget old rows."""
        if not self._active or time.monotonic() < self._next:
            return
        self._next = time.monotonic() + BEAT
        self._beats += 1
        forget = self._beats % FORGET_EVERY == 0

        def step(conn: Connection) -> None:
            # (update first: the insert may have failed, or committed though its reply was lost)
            if not _workers.beat(conn, self.tables, self.id, in_use, handled, self._now()) and self._active:
                self._insert(conn, in_use, handled)
            if forget:
                gone = _workers.forget(conn, self.tables, FORGET_AFTER_MS, FORGET_BATCH, self._now())
                if gone:
                    log.info("worker registry: %d row(s) of workers gone for %s deleted", gone, FORGET_AFTER)

        self._run("heartbeat", step)

    def stop(self, handled: int) -> None:
        """Mark the row stopped (a clean stop); no beat from here on."""
        if not self._active:
            return
        self._active = False
        self._run("stop", lambda c: _workers.stop(c, self.tables, self.id, handled, self._now()))

    def _insert(self, conn: Connection, in_use: int, handled: int) -> None:
        _workers.insert(conn, self.tables, {**self._row, "slots_in_use": in_use, "handled": handled}, self._now())

    def _now(self) -> int | None:
        return None if self.clock is None else to_ms(self.clock.now())

    def _run(self, what: str, step: Callable[[Connection], None]) -> bool:
        """Run ``step`` in a transaction of its own, bounded by ``CALL_BOUND``; False (logged) when it failed."""
        try:
            with self.engine.connect() as conn:
                dbapi = conn.connection.dbapi_connection
                bounds.arm(dbapi, CALL_BOUND)
                try:
                    step(conn)
                    conn.commit()
                finally:
                    bounds.disarm(dbapi)
        except Exception as exc:  # the registry never stops the worker: log, try again at the next beat
            self._failures += 1
            if self._failures == 1 or self._failures % WARN_EVERY == 0:
                log.warning(
                    "worker registry: %s failed (%s); the worker goes on, the next beat tries again (%d in a row)",
                    what,
                    describe(exc),
                    self._failures,
                )
            return False
        if self._failures:
            log.info("worker registry: %s works again after %d failure(s)", what, self._failures)
        self._failures = 0
        return True


def topic_labels(pairs: Sequence[tuple[str, str]]) -> list[str]:
    """How the registry names a worker's topic handlers: ``topic/group``."""
    return [f"{topic}/{group}" for topic, group in pairs]
