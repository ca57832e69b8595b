"""Bounds on how long delayq's own transactions and calls may go unanswered, on every backend.

Two bounds, because a frozen client and a silent network look different from each side:

- server side, the *idle bound*: a transaction of delayq's own that sits idle (no statement in
  progress) for longer is ended by the server, so the rows it locked go to other consumers even when
  its client froze or its network went silent between two statements or before the COMMIT. Each
  dialect sets it where it begins such a transaction (``Dialect.owned_start``): PostgreSQL's
  ``idle_in_transaction_session_timeout``, MariaDB's ``idle_*transaction_timeout``.
- client side, the *call bound*: a call of delayq's own (its transaction's statements and the COMMIT)
  that has not returned after the bound has its connection's socket shut down under the driver, so
  the call fails as a lost connection instead of waiting for ever (psycopg has no read timeout, asyncpg
  none unless each call passes one; TCP keepalives only speak up on an idle socket, and a peer that
  acknowledges but never answers, a frozen server or proxy, is never detected by TCP at all).
  ``arm`` / ``disarm``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import socket
import threading
import time
from typing import Any

log = logging.getLogger("delayq")

IDLE_TIMEOUT_S = 30.0
"""Default idle bound: seconds one of delayq's own transactions may sit idle before the server ends it
(``TransientRetry.idle_timeout`` overrides it)."""
CALL_TIMEOUT_S = 60.0
"""Default call bound: seconds one of delayq's own operations may wait for the database before its
connection is dropped (``TransientRetry.call_timeout`` overrides it)."""


OWN_CHECKOUT: contextvars.ContextVar[bool] = contextvars.ContextVar("delayq_own_checkout", default=False)
"""True while delayq checks a connection out for its own transaction (a pool event tells it from the
application's checkouts, which must find the session as the application left it)."""


def socket_of(dbapi_connection: Any) -> tuple[int, int] | None:
    """The connection's socket as (file descriptor, inode), read while the connection is idle
    (mysqlclient answers ``fileno()`` only then); None without one."""
    fileno = getattr(dbapi_connection, "fileno", None) or _transport_fileno(dbapi_connection)
    if fileno is None:
        return None
    try:
        fd = int(fileno())
        return fd, os.fstat(fd).st_ino
    except Exception:  # closed already, or no socket
        return None


def _transport_fileno(dbapi_connection: Any) -> Any:
    """``fileno`` of an asyncio driver's socket (asyncpg behind SQLAlchemy's adapter, which has none of its
    own): its asyncio transport's. Shut down from the call bound's thread, the event loop then reads the
    end of the stream and the driver fails the call as a lost connection. None without one."""
    driver = getattr(dbapi_connection, "driver_connection", None)
    transport = getattr(driver, "_transport", None)  # asyncpg gives no public handle on its transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    return getattr(sock, "fileno", None)


def shut_down_socket(fd: int, inode: int) -> bool:
    """Shut the socket ``fd`` down if it is still the one of that inode (not closed and reused meanwhile)."""
    try:
        dup = os.dup(fd)
    except OSError:
        return False
    with socket.socket(fileno=dup) as sock:
        if os.fstat(dup).st_ino != inode:
            return False
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
    return True


class _Deadlines:
    """Driver connections that must be done by a deadline; one daemon thread drops those past theirs."""

    def __init__(self) -> None:
        self._due: dict[int, tuple[tuple[int, int], float, float]] = {}  # id(conn) -> (socket, deadline, seconds)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._next = float("inf")  # the deadline the thread sleeps until
        self.dropped = 0
        """Connections dropped so far."""

    def arm(self, dbapi_connection: Any, seconds: float) -> None:
        found = socket_of(dbapi_connection)
        if found is None:
            return
        deadline = time.monotonic() + seconds
        with self._cond:
            self._due[id(dbapi_connection)] = (found, deadline, seconds)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="delayq-call-bound", daemon=True)
                self._thread.start()
            if deadline < self._next:
                self._next = deadline
                self._cond.notify()

    def disarm(self, dbapi_connection: Any) -> None:
        with self._cond:
            self._due.pop(id(dbapi_connection), None)

    def _loop(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                for key, (found, deadline, seconds) in list(self._due.items()):
                    if deadline <= now:
                        # Under the lock: a disarm that comes later finds it gone, one that came first won.
                        del self._due[key]
                        if shut_down_socket(*found):
                            self.dropped += 1
                            log.warning("a database call has not returned in %.0fs: dropping its connection", seconds)
                self._next = min((d for _, d, _ in self._due.values()), default=float("inf"))
                self._cond.wait(None if self._next == float("inf") else max(0.01, self._next - now))


_deadlines = _Deadlines()


def arm(dbapi_connection: Any, seconds: float | None) -> None:
    """Drop ``dbapi_connection`` (shut its socket down) unless ``disarm`` comes within ``seconds``; None: no bound."""
    if seconds is not None:
        _deadlines.arm(dbapi_connection, seconds)


def disarm(dbapi_connection: Any) -> None:
    """The connection's calls are done: no drop (a no-op when it was not armed)."""
    _deadlines.disarm(dbapi_connection)


def dropped() -> int:
    """Connections the call bound has dropped in this process so far."""
    return _deadlines.dropped
