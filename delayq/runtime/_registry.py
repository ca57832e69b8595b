"""The worker registry: each worker's row in ``{prefix}workers``, for ``delayq workers``, ``top`` and the dashboard.

A worker inserts its row when it starts, updates it (heartbeat, slots in use, handled, what its handlers run
now) from its heartbeat loop every ``BEAT`` seconds (one UPDATE; no loop of its own), marks it stopped on a
clean stop, and every ``FORGET_EVERY`` beats deletes up to ``FORGET_BATCH`` rows whose heartbeat is older than
``FORGET_AFTER`` (a crashed worker's, or one stopped long ago). A row whose heartbeat is older than
``delayq.browse.GONE_AFTER`` (60 s) reads as gone (``delayq.browse.WorkerInfo.state``).

The queue history: the worker's queues count their outcomes in its ``Tally`` as they record them (processed,
failed, dead-lettered; in memory, no statement), and each beat (and the clean stop) adds the counts since the
last one to the current minute's row of each queue, in the beat's transaction (one upsert, only when there are
counts). When that transaction fails, the counts go back into the tally for the next beat. With the forgetting,
the worker deletes up to ``HISTORY_BATCH`` history rows older than ``HISTORY_KEPT``.

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
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from delayq.clock import Clock, duration_ms, to_ms
from delayq.dialects import bounds
from delayq.queue import _workers
from delayq.runtime._jobs import describe
from delayq.schema import Tables

if TYPE_CHECKING:
    from delayq.runtime._jobs import Jobs
    from delayq.runtime._topics import TopicConsumer

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
HISTORY_KEPT = dt.timedelta(hours=24)
"""Queue history rows of minutes older than this are deleted (by any running worker)."""
HISTORY_KEPT_MS = duration_ms(HISTORY_KEPT)
HISTORY_BATCH = 500
"""History rows one deletion removes at most (about once a minute per running worker)."""
RUNNING_BYTES = 16_000
"""The most a heartbeat writes of what the handlers run (JSON, in bytes): the longest-running first."""


_SLOTS = {"acked": 0, "retried": 1, "dead_lettered": 2}
"""The queue events a tally counts, and where (the order of ``delayq.queue._workers.COUNTS``)."""


class Tally:
    """A worker's outcome counts per queue since they were last written: processed (acked), failed (a retry
    recorded) and dead-lettered. Thread-safe; the worker's queues call ``count`` as they record an outcome."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, list[int]] = {}

    def count(self, event: str, queue: str, n: int) -> None:
        """``n`` messages of ``queue`` had ``event`` (an ``observe.Event``; the others are not counted)."""
        slot = _SLOTS.get(event)
        if slot is not None and n:
            with self._lock:
                self._counts.setdefault(queue, [0, 0, 0])[slot] += n

    def take(self) -> dict[str, list[int]]:
        """The counts so far, which start again from zero."""
        with self._lock:
            taken, self._counts = self._counts, {}
        return taken

    def put_back(self, taken: dict[str, list[int]]) -> None:
        """Counts taken whose write failed: the next one writes them."""
        with self._lock:
            for queue, counts in taken.items():
                mine = self._counts.setdefault(queue, [0, 0, 0])
                for slot, n in enumerate(counts):
                    mine[slot] += n


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
        jobs: Jobs | None = None,
        consumers: Sequence[TopicConsumer] = (),
    ) -> None:
        self.engine, self.tables, self.clock = engine, tables, clock
        self.tally = Tally()
        """The outcomes the worker's queues count, written with the beats to the queue history."""
        self._jobs, self._consumers = jobs, consumers
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

        running = self._running()
        counts = self.tally.take()

        def step(conn: Connection) -> None:
            # (update first: the insert may have failed, or committed though its reply was lost)
            now = self._now()
            if not _workers.beat(conn, self.tables, self.id, in_use, handled, now, running) and self._active:
                self._insert(conn, in_use, handled)
            if counts:
                _workers.add_history(conn, self.tables, counts, now)
            if forget:
                gone = _workers.forget(conn, self.tables, FORGET_AFTER_MS, FORGET_BATCH, now)
                if gone:
                    log.info("worker registry: %d row(s) of workers gone for %s deleted", gone, FORGET_AFTER)
                _workers.prune_history(conn, self.tables, HISTORY_KEPT_MS, HISTORY_BATCH, now)

        if not self._run("heartbeat", step):
            self.tally.put_back(counts)

    def stop(self, handled: int) -> None:
        """Mark the row stopped (a clean stop), writing the last counts; no beat from here on."""
        if not self._active:
            return
        self._active = False
        counts = self.tally.take()

        def step(conn: Connection) -> None:
            now = self._now()
            _workers.stop(conn, self.tables, self.id, handled, now)
            if counts:
                _workers.add_history(conn, self.tables, counts, now)

        self._run("stop", step)

    def _running(self) -> str | None:
        """What the handlers run now, as the row's ``running`` JSON (queue or ``topic/group``, key, attempt, ms
        run so far): the longest-running first, at most ``RUNNING_BYTES``; None when nothing runs."""
        clock, mono = self.clock, time.monotonic()
        on_clock = None if clock is None else clock.now()

        def ran_ms(started_at: float, started_on_clock: dt.datetime | None) -> int:
            if on_clock is not None and started_on_clock is not None:
                return max(duration_ms(on_clock - started_on_clock), 0)
            return max(int((mono - started_at) * 1000), 0)

        found: list[tuple[int, dict[str, object]]] = []
        for j in self._jobs.still_running() if self._jobs is not None else ():
            ms = ran_ms(j.started_at, j.started_on_clock)
            found.append((ms, {"queue": j.queue.name, "key": j.delivery.key, "attempt": j.delivery.attempts, "ms": ms}))
        for c in self._consumers:
            label = f"{c.sub.topic}/{c.sub.group}"
            for t in c.holding():
                if not t.finishing:
                    ms = ran_ms(t.started_at, t.started_on_clock)
                    d = t.delivery
                    found.append((ms, {"topic": label, "key": d.message_id, "attempt": d.attempts, "ms": ms}))
        if not found:
            return None
        found.sort(key=lambda f: -f[0])
        shown = [entry for _, entry in found]
        text = json.dumps(shown, ensure_ascii=False)
        while len(text.encode()) > RUNNING_BYTES:
            shown = shown[: len(shown) // 2]
            text = json.dumps(shown, ensure_ascii=False)
        return text

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
