"""The engines delayq creates itself (the ``delayq`` command, its demo and worker, Spark tasks).

Each gets the dialect's ``network_timeouts`` as connect arguments, unless the URL sets them:

- PostgreSQL (psycopg): ``connect_timeout`` 10 s, TCP keepalives (idle 10 s, every 5 s, 3 probes) and
  ``tcp_user_timeout`` 30 s, so a server that accepts TCP and never answers fails the connect in 10 s
  and a peer that vanished fails the connection within about 30 s. psycopg has no read timeout:
  ``read_bound`` (below) adds one on the client side for the command line (60 s per statement).
- MariaDB/MySQL (mysqlclient): ``connect_timeout`` 10 s, ``read_timeout`` and ``write_timeout`` 60 s.
- SQLite: nothing (no network).

``create_async_engine`` makes the ``AsyncEngine`` of ``delayq worker --driver asyncio`` from the same URL,
on the database's asyncio driver (``async_url``), with the same timeouts where the driver has them:
psycopg's are libpq's (as above); asyncpg's ``timeout`` (connect) 10 s; asyncmy has a ``connect_timeout``
only (no read or write timeout); aiosqlite nothing.

A URL whose scheme names no driver gets the one delayq runs on (``driver_url``): ``postgres://`` and
``postgresql://`` (a Heroku-style ``DATABASE_URL``) are ``postgresql+psycopg://``, ``mysql://`` is
``mysql+mysqldb://``.

Engines an application builds with ``sqlalchemy.create_engine`` are left as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, overload

import sqlalchemy as sa

from delayq.dialects import bounds, dialect_class

if TYPE_CHECKING:
    import sqlalchemy.ext.asyncio

__all__ = [
    "READ_BOUND_SECONDS",
    "async_url",
    "create_async_engine",
    "create_engine",
    "driver_url",
    "read_bound",
    "sync_url",
]

READ_BOUND_SECONDS = 60.0
"""How long a command waits for one database call before it drops the connection and fails."""


_DRIVERS = {"postgres": "postgresql+psycopg", "postgresql": "postgresql+psycopg", "mysql": "mysql+mysqldb"}
"""The schemes that name no driver, and the spelling with the driver delayq runs on for each."""


@overload
def driver_url(url: str) -> str: ...
@overload
def driver_url(url: sa.URL) -> sa.URL: ...
def driver_url(url: str | sa.URL) -> str | sa.URL:
    """``url`` naming the driver delayq runs on where its scheme names none (``postgres://`` and
    ``postgresql://`` as ``postgresql+psycopg://``, ``mysql://`` as ``mysql+mysqldb://``); any other as it is.
    A string stays a string, changed in its scheme only (one that does not parse is left for the caller)."""
    if isinstance(url, sa.URL):
        driver = _DRIVERS.get(url.drivername.lower())
        return url if driver is None else url.set(drivername=driver)
    scheme, sep, rest = url.partition("://")
    driver = _DRIVERS.get(scheme.lower()) if sep else None
    return url if driver is None else f"{driver}://{rest}"


def create_engine(
    url: str | sa.URL, *, pool_size: int | None = None, max_overflow: int = 10, **kwargs: Any
) -> sa.Engine:
    """An engine with delayq's network timeouts: a pool of ``pool_size`` connections (plus ``max_overflow``),
    or none (``NullPool``, a connection per use) when ``pool_size`` is None. ``kwargs`` go to SQLAlchemy."""
    parsed = driver_url(sa.engine.make_url(url))
    dialect = dialect_class(parsed.get_backend_name(), parsed.get_driver_name())
    defaults = dialect.network_timeouts
    connect_args = {k: v for k, v in defaults.items() if k not in parsed.query}
    connect_args.update(kwargs.pop("connect_args", {}))
    if dialect.in_memory(parsed):
        return sa.create_engine(parsed, connect_args=connect_args, **kwargs)  # one connection, kept (StaticPool)
    if pool_size is None:
        return sa.create_engine(parsed, poolclass=sa.pool.NullPool, connect_args=connect_args, **kwargs)
    return sa.create_engine(parsed, pool_size=pool_size, max_overflow=max_overflow, connect_args=connect_args, **kwargs)


_ASYNC_DRIVERS = {"postgresql": "psycopg", "sqlite": "aiosqlite", "mysql": "asyncmy", "mariadb": "asyncmy"}
"""The asyncio driver a backend's sync URL gets in ``async_url``."""
_ASYNC_NAMES = {"psycopg_async", "asyncpg", "aiosqlite", "asyncmy", "aiomysql"}
_ASYNC_TIMEOUTS = {"asyncmy": ("connect_timeout",), "aiomysql": ("connect_timeout",), "aiosqlite": ()}


def async_url(url: str | sa.URL) -> sa.URL:
    """``url`` with its backend's asyncio driver: ``postgresql+psycopg`` (psycopg's async
    connection), ``sqlite+aiosqlite``, ``mysql+asyncmy``; a URL that names an asyncio driver already
    (asyncpg, aiomysql, ...) as it is."""
    parsed = driver_url(sa.engine.make_url(url))
    driver = parsed.get_driver_name()
    if driver in _ASYNC_NAMES:
        return parsed
    backend = parsed.get_backend_name()
    if backend not in _ASYNC_DRIVERS:
        dialect_class(backend)  # UnsupportedDatabaseError, naming the supported ones
    return parsed.set(drivername=f"{backend}+{_ASYNC_DRIVERS[backend]}")


_SYNC_DRIVERS = {
    "psycopg_async": "psycopg",
    "asyncpg": "psycopg",
    "aiosqlite": "pysqlite",
    "asyncmy": "mysqldb",
    "aiomysql": "mysqldb",
}


def sync_url(url: str | sa.URL) -> sa.URL:
    """``url`` with the synchronous driver delayq runs on for its database (psycopg, sqlite3, mysqlclient) in
    place of an asyncio one; a sync URL as it is (one that names no driver with delayq's, ``driver_url``)."""
    parsed = driver_url(sa.engine.make_url(url))
    driver = _SYNC_DRIVERS.get(parsed.get_driver_name())
    return parsed if driver is None else parsed.set(drivername=f"{parsed.get_backend_name()}+{driver}")


def create_async_engine(
    url: str | sa.URL, *, pool_size: int, max_overflow: int = 10, **kwargs: Any
) -> sa.ext.asyncio.AsyncEngine:
    """An ``AsyncEngine`` on ``async_url(url)`` with the network timeouts its driver has, a pool of
    ``pool_size`` connections (plus ``max_overflow``). ``kwargs`` go to SQLAlchemy."""
    from sqlalchemy.ext.asyncio import create_async_engine as create

    parsed = async_url(url)
    driver = parsed.get_driver_name()
    defaults = dialect_class(parsed.get_backend_name(), driver).network_timeouts
    if driver in _ASYNC_TIMEOUTS:
        defaults = {k: v for k, v in defaults.items() if k in _ASYNC_TIMEOUTS[driver]}
    connect_args = {k: v for k, v in defaults.items() if k not in parsed.query}
    connect_args.update(kwargs.pop("connect_args", {}))
    if parsed.get_backend_name() == "sqlite":
        return create(parsed, connect_args=connect_args, **kwargs)
    return create(parsed, pool_size=pool_size, max_overflow=max_overflow, connect_args=connect_args, **kwargs)


@contextmanager
def read_bound(engine: sa.Engine, seconds: float = READ_BOUND_SECONDS) -> Iterator[None]:
    """While the block runs, a statement on ``engine`` that has had no reply for ``seconds`` has its
    connection's socket shut down (``delayq.dialects.bounds``, the call bound), so it fails as a lost
    connection instead of waiting on a server that stopped answering (psycopg has no read timeout;
    mysqlclient's ``read_timeout`` does the same)."""

    def before(conn: sa.Connection, *_: Any) -> None:
        bounds.arm(conn.connection.dbapi_connection, seconds)

    def after(conn: sa.Connection, *_: Any) -> None:
        bounds.disarm(conn.connection.dbapi_connection)

    def error(context: sa.engine.ExceptionContext) -> None:
        if context.connection is not None and not context.connection.invalidated:
            bounds.disarm(context.connection.connection.dbapi_connection)

    events: dict[str, Callable[..., Any]] = {
        "before_cursor_execute": before,
        "after_cursor_execute": after,
        "handle_error": error,
    }
    for name, fn in events.items():
        sa.event.listen(engine, name, fn)
    try:
        yield
    finally:
        for name, fn in events.items():
            sa.event.remove(engine, name, fn)
