"""Watchdog: a worker loop stuck in a database call on a connection that went silent gets it dropped.

A connection whose peer vanished without a word (a NAT or firewall that forgot it, a host that
died) can leave a driver waiting for a reply forever: psycopg has no read timeout, and TCP keepalives
only speak up on an idle socket. The watchdog follows the connections the worker's own loops check
out of the engine's pool (pool ``checkout`` / ``checkin`` events); one held past ``stall_after`` has
its socket shut down, which fails the stuck call as a lost connection: SQLAlchemy invalidates it and
delayq retries on a new one. The socket is found at checkout, while the connection is idle (mysqlclient
tells its socket only then).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from delayq.dialects.bounds import shut_down_socket, socket_of

log = logging.getLogger("delayq.worker")


class Watchdog:
    """Drops the connection of a watched thread that has held it longer than ``stall_after`` seconds."""

    def __init__(self, engine: sa.Engine, stall_after: float, watched: Callable[[], set[int]]) -> None:
        self.engine = engine
        self.stall_after = stall_after
        self._watched = watched  # the idents of the threads whose calls must not hang
        # id(dbapi connection) -> (its socket, read at checkout while idle; the thread; since)
        self._held: dict[int, tuple[tuple[int, int] | None, int, float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.dropped = 0
        """Connections dropped so far."""

    def start(self) -> None:
        _watching(self.engine).add(self)
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="delayq-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        _watching(self.engine).discard(self)

    def on_checkout(self, dbapi_connection: Any, record: Any, proxy: Any) -> None:
        with self._lock:
            self._held[id(dbapi_connection)] = (socket_of(dbapi_connection), threading.get_ident(), time.monotonic())

    def on_checkin(self, dbapi_connection: Any, record: Any) -> None:
        with self._lock:
            self._held.pop(id(dbapi_connection), None)

    def _loop(self) -> None:
        while not self._stop.wait(min(1.0, self.stall_after / 4)):
            try:
                self.check()
            except Exception as exc:  # the watchdog must not die of what it watches
                log.warning("watchdog: %s", exc)

    def check(self) -> None:
        """Drop the connections watched threads have held past ``stall_after``."""
        watched, now = self._watched(), time.monotonic()
        with self._lock:
            stuck = [(key, sock, since) for key, (sock, ident, since) in self._held.items() if ident in watched]
        for key, sock, since in stuck:
            if now - since > self.stall_after and sock is not None and shut_down_socket(*sock):
                self.dropped += 1
                log.warning("a database call has not returned in %.0fs: dropping its connection", now - since)
                with self._lock:
                    self._held.pop(key, None)


_hooks_lock = threading.Lock()
_hooked: weakref.WeakKeyDictionary[sa.Engine, set[Watchdog]] = weakref.WeakKeyDictionary()


def _watching(engine: sa.Engine) -> set[Watchdog]:
    """The watchdogs of ``engine``, whose pool events reach each of them. The events are listened to once per
    engine and never removed: SQLAlchemy's listener lists must not change while other threads check
    connections out (a worker started or stopped beside running ones raised "deque mutated during iteration"
    in their checkouts)."""
    with _hooks_lock:
        dogs = _hooked.get(engine)
        if dogs is None:
            dogs = _hooked[engine] = set()
            watched = dogs

            def checkout(dbapi_connection: Any, record: Any, proxy: Any) -> None:
                for dog in list(watched):
                    dog.on_checkout(dbapi_connection, record, proxy)

            def checkin(dbapi_connection: Any, record: Any) -> None:
                for dog in list(watched):
                    dog.on_checkin(dbapi_connection, record)

            sa.event.listen(engine, "checkout", checkout)
            sa.event.listen(engine, "checkin", checkin)
        return dogs
