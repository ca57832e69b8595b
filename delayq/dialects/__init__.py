"""The only package that knows backends: one ``Dialect`` per engine, picked once from a registry."""

from __future__ import annotations

import threading
import weakref

from sqlalchemy.engine import Engine

from delayq.dialects.base import ClaimedRow, Dialect, Mode, Statements
from delayq.dialects.mysql import MySQLDialect
from delayq.dialects.postgresql import PostgresDialect
from delayq.dialects.postgresql_asyncpg import AsyncpgDialect
from delayq.dialects.sqlite import SQLiteDialect
from delayq.errors import UnsupportedDatabaseError

__all__ = ["ClaimedRow", "Dialect", "Mode", "Statements", "dialect_class", "dialect_for"]

_REGISTRY: dict[str, type[Dialect]] = {
    "postgresql": PostgresDialect,
    "mysql": MySQLDialect,
    "mariadb": MySQLDialect,
    "sqlite": SQLiteDialect,
}
_BY_DRIVER: dict[tuple[str, str], type[Dialect]] = {
    # Where a driver behaves differently enough under the same SQL (its own transactions, errors, LISTEN).
    ("postgresql", "asyncpg"): AsyncpgDialect,
}
_by_engine: weakref.WeakKeyDictionary[Engine, Dialect] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def dialect_class(name: str, driver: str | None = None) -> type[Dialect]:
    """The dialect class for a SQLAlchemy dialect name (and driver); ``UnsupportedDatabaseError`` otherwise."""
    try:
        return _BY_DRIVER.get((name, driver or "")) or _REGISTRY[name]
    except KeyError:
        supported = ", ".join(sorted(_REGISTRY))
        raise UnsupportedDatabaseError(f"delayq does not run on {name!r}; supported: {supported}") from None


def dialect_for(engine: Engine) -> Dialect:
    """The engine's dialect, made once per engine (checked against the server on first use)."""
    with _lock:
        found = _by_engine.get(engine)
        if found is None:
            found = _by_engine[engine] = dialect_class(engine.dialect.name, engine.dialect.driver)(engine.dialect)
        return found
