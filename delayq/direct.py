"""The hot path: delayq's own short operations sent straight to the pooled DBAPI connection.

SQLAlchemy's per-execute machinery (execution context, result objects, events) costs more
than a round trip to a local server. For the operations delayq owns from start to end (an
offer, a claim, an ack), the same Core statements are compiled once per engine dialect and
executed on a DBAPI cursor of a connection checked out of the engine's own pool. Driver
errors are wrapped as SQLAlchemy wraps them (``IntegrityError``, ``OperationalError``, ...),
and a connection the dialect reports as dropped is invalidated in the pool.

Engines whose users watch statements (``echo``, ``sqlalchemy.engine`` logging at INFO,
connection events, execution options such as ``schema_translate_map``) take SQLAlchemy's
own path, so what they observe does not change.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import namedtuple
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import PoolProxiedConnection
from sqlalchemy.sql.compiler import SQLCompiler

_ENGINE_LOG = logging.getLogger("sqlalchemy.engine")


class Rows(Protocol):
    """What delayq reads from a statement's result, from SQLAlchemy's or the direct path."""

    @property
    def rowcount(self) -> int: ...

    def all(self) -> Sequence[Any]: ...

    def first(self) -> Any: ...

    def scalars(self) -> Iterable[Any]: ...

    def scalar_one(self) -> Any: ...


class Executes(Protocol):
    """What delayq's hot operations need of a connection: a SQLAlchemy ``Connection`` or a ``DirectConnection``."""

    def execute(self, statement: Any, parameters: Any = None, /) -> Rows: ...

    def exec_driver_sql(self, statement: str, parameters: Any = None, /) -> Rows: ...


def watched(engine: Engine) -> bool:
    """True when someone observes this engine's statements, so they must go through SQLAlchemy."""
    return bool(
        engine.echo
        or engine._has_events  # connection events (before_cursor_execute, ...)
        or engine.get_execution_options()
        or _ENGINE_LOG.isEnabledFor(logging.INFO)
    )


class DirectResult:
    """The rows a statement returned (fetched at once) and its row count."""

    __slots__ = ("_rows", "rowcount")

    def __init__(self, rows: list[Any], rowcount: int) -> None:
        self._rows = rows
        self.rowcount = rowcount

    def all(self) -> list[Any]:
        return self._rows

    def first(self) -> Any:
        return self._rows[0] if self._rows else None

    def scalars(self) -> Iterator[Any]:
        return (row[0] for row in self._rows)

    def scalar_one(self) -> Any:
        if len(self._rows) != 1:
            raise sa.exc.NoResultFound("expected one row") if not self._rows else sa.exc.MultipleResultsFound()
        return self._rows[0][0]


class DirectConnection:
    """A pooled DBAPI connection that runs Core statements compiled once, without SQLAlchemy's execution layer."""

    def __init__(self, pooled: PoolProxiedConnection, dialect: sa.Dialect) -> None:
        self.pooled = pooled
        self.dialect = dialect
        self.dbapi_connection: Any = pooled.dbapi_connection
        self._cursor: Any = None

    @classmethod
    def checkout(cls, engine: Engine) -> DirectConnection:
        """A connection from the engine's pool; a failure to connect raised as SQLAlchemy raises it."""
        dialect = engine.dialect
        try:
            return cls(engine.raw_connection(), dialect)
        except dialect.loaded_dbapi.Error as exc:
            dropped = dialect.is_disconnect(exc, None, None)
            raise DBAPIError.instance(
                None, None, exc, dialect.loaded_dbapi.Error, connection_invalidated=dropped, dialect=dialect
            ) from exc

    def execute(self, statement: sa.Executable, parameters: Mapping[str, Any] | None = None, /) -> DirectResult:
        sql, args = _bound(_compile(statement, self.dialect), parameters or {})
        return self.exec_driver_sql(sql, args)

    def exec_driver_sql(self, sql: str, parameters: Sequence[Any] | Mapping[str, Any] | None = None, /) -> DirectResult:
        """Run one SQL string as is, with the driver's own parameters (in its paramstyle)."""
        cursor = self._cursor_for(sql, parameters)
        try:
            cursor.execute(sql) if parameters is None else cursor.execute(sql, parameters)
            description = cursor.description
            if description is None:
                return DirectResult([], cursor.rowcount)
            row = _row_type(tuple(column[0] for column in description))
            return DirectResult([row._make(values) for values in cursor.fetchall()], cursor.rowcount)
        except self.dialect.loaded_dbapi.Error as exc:
            raise self._wrapped(exc, sql, parameters) from exc

    def commit(self) -> None:
        try:
            self.dbapi_connection.commit()
        except self.dialect.loaded_dbapi.Error as exc:
            raise self._wrapped(exc, "COMMIT", ()) from exc

    def _cursor_for(self, sql: str, args: object) -> Any:
        if self._cursor is None:
            try:
                self._cursor = self.dbapi_connection.cursor()
            except self.dialect.loaded_dbapi.Error as exc:
                raise self._wrapped(exc, sql, args) from exc
        return self._cursor

    def _wrapped(self, exc: Any, sql: str, args: Any) -> BaseException:
        """``exc`` as SQLAlchemy raises it (``IntegrityError``, ...); the connection invalidated if it dropped."""
        dropped = self.dialect.is_disconnect(exc, self.dbapi_connection, self._cursor)
        if dropped:
            self.pooled.invalidate(exc)
        wrapped: BaseException = DBAPIError.instance(
            sql, args, exc, self.dialect.loaded_dbapi.Error, connection_invalidated=dropped, dialect=self.dialect
        )
        return wrapped

    def close(self, *, clean: bool = False) -> None:
        """Return the connection to the pool, which rolls it back unless it is ``clean`` (no transaction open).

        After a COMMIT, or in autocommit, there is nothing to roll back, and on mysqlclient that
        ROLLBACK is a round trip: hand the connection back as SQLAlchemy's own
        ``Connection.close()`` does after ending a transaction itself.
        """
        if self._cursor is not None:
            with contextlib.suppress(self.dialect.loaded_dbapi.Error):  # the pool's reset finds out the rest
                self._cursor.close()
        close_clean = getattr(self.pooled, "_close_special", None)
        if clean and close_clean is not None:
            close_clean(transaction_reset=True)
        else:
            self.pooled.close()


@functools.lru_cache(maxsize=512)
def _compile(statement: sa.Executable, dialect: sa.Dialect) -> SQLCompiler:
    compiled = statement.compile(dialect=dialect)  # type: ignore[attr-defined]
    assert isinstance(compiled, SQLCompiler)
    return compiled


def _bound(compiled: SQLCompiler, parameters: Mapping[str, Any]) -> tuple[str, Any]:
    """The SQL and the driver's arguments (a sequence or a mapping, as its paramstyle wants)."""
    if compiled.post_compile_params or compiled.literal_execute_params:  # rendered at execution (IN lists, LIMIT)
        expanded = compiled.construct_expanded_state(parameters)
        return expanded.statement, expanded.positional_parameters if compiled.positional else expanded.parameters
    values = compiled.construct_params(parameters)
    if compiled.positional and compiled.positiontup is not None:
        return compiled.string, [values[name] for name in compiled.positiontup]
    return compiled.string, values


@functools.lru_cache(maxsize=512)
def _row_type(names: tuple[str, ...]) -> Any:
    """A named tuple for these column names: rows read by name and by position."""
    return namedtuple("Row", names, rename=True)
