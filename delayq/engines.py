"""The engines delayq creates itself (the ``delayq`` command, its demo and worker, Spark tasks).

Each gets the dialect's ``network_timeouts`` as connect arguments, unless the URL sets them:

- PostgreSQL (psycopg): ``connect_timeout`` 10 s, TCP keepalives (idle 10 s, every 5 s, 3 probes) and
  ``tcp_user_timeout`` 30 s, so a server that accepts TCP and never answers fails the connect in 10 s
  and a peer that vanished fails the connection within about 30 s. psycopg has no read timeout:
  ``read_bound`` (below) adds one on the client side for the command line (60 s per statement).
- MariaDB/MySQL (mysqlclient): ``connect_timeout`` 10 s, ``read_timeout`` and ``write_timeout`` 60 s.
- SQLite: nothing (no network).

Engines an application builds with ``sqlalchemy.create_engine`` are left as they are.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa

from delayq.dialects import dialect_class
from delayq.watchdog import _shut_down

__all__ = ["READ_BOUND_SECONDS", "create_engine", "read_bound"]

READ_BOUND_SECONDS = 60.0
"""How long a command waits for one database call before it drops the connection and fails."""


def create_engine(
    url: str | sa.URL, *, pool_size: int | None = None, max_overflow: int = 10, **kwargs: Any
) -> sa.Engine:
    """An engine with delayq's network timeouts: a pool of ``pool_size`` connections (plus ``max_overflow``),
    or none (``NullPool``, a connection per use) when ``pool_size`` is None. ``kwargs`` go to SQLAlchemy."""
    parsed = sa.engine.make_url(url)
    defaults = dialect_class(parsed.get_backend_name()).network_timeouts
    connect_args = {k: v for k, v in defaults.items() if k not in parsed.query}
    connect_args.update(kwargs.pop("connect_args", {}))
    if parsed.get_backend_name() == "sqlite" and parsed.database in (None, "", ":memory:"):
        return sa.create_engine(parsed, connect_args=connect_args, **kwargs)  # one connection, kept (StaticPool)
    if pool_size is None:
        return sa.create_engine(parsed, poolclass=sa.pool.NullPool, connect_args=connect_args, **kwargs)
    return sa.create_engine(parsed, pool_size=pool_size, max_overflow=max_overflow, connect_args=connect_args, **kwargs)


@contextmanager
def read_bound(engine: sa.Engine, seconds: float = READ_BOUND_SECONDS) -> Iterator[None]:
    """While the block runs, a statement on ``engine`` that has had no reply for ``seconds`` has its
    connection's socket shut down, so it fails as a lost connection instead of waiting on a server that
    stopped answering (psycopg has no read timeout; mysqlclient's ``read_timeout`` does the same)."""
    bound = _CallBound(seconds)
    events: dict[str, Callable[..., Any]] = {
        "before_cursor_execute": bound.before,
        "after_cursor_execute": bound.after,
        "handle_error": bound.error,
    }
    for name, fn in events.items():
        sa.event.listen(engine, name, fn)
    stop = threading.Event()
    watcher = threading.Thread(target=bound.watch, args=(stop,), name="delayq-read-bound", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join(5)
        for name, fn in events.items():
            sa.event.remove(engine, name, fn)


class _CallBound:
    """The statements under way (by SQLAlchemy connection), since when, on which DBAPI connection."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._calls: dict[int, tuple[Any, float]] = {}
        self._lock = threading.Lock()

    def before(self, conn: sa.Connection, *_: Any) -> None:
        with self._lock:
            self._calls[id(conn)] = (conn.connection.dbapi_connection, time.monotonic())

    def after(self, conn: sa.Connection, *_: Any) -> None:
        with self._lock:
            self._calls.pop(id(conn), None)

    def error(self, context: sa.engine.ExceptionContext) -> None:
        with self._lock:
            self._calls.pop(id(context.connection), None)

    def watch(self, stop: threading.Event) -> None:
        while not stop.wait(min(1.0, self.seconds / 4)):
            now = time.monotonic()
            with self._lock:
                stuck = [k for k, (_, since) in self._calls.items() if now - since > self.seconds]
                dropped = [self._calls.pop(k)[0] for k in stuck]
            for dbapi_connection in dropped:
                _shut_down(dbapi_connection)
