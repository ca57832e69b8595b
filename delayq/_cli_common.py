"""What every command of the ``delayq`` command line shares: one-line failures, the URL's checks, the
connection, and the output (a leaf below ``delayq.cli`` and ``delayq.topics.cli``)."""

from __future__ import annotations

import datetime as dt
import functools
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ParamSpec, TypeVar

import click
import sqlalchemy as sa

from delayq.errors import DelayqError
from delayq.humanize import human
from delayq.schema import make_tables

P = ParamSpec("P")
R = TypeVar("R")


class Fail(click.ClickException):
    """One line on stderr, exit code 2."""

    exit_code = 2


def friendly(command: Callable[P, R]) -> Callable[P, R]:
    """Turn the errors a user can act on into one line and exit code 2."""

    @functools.wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return command(*args, **kwargs)
        except DelayqError as exc:
            raise Fail(str(exc)) from None
        except sa.exc.NoSuchModuleError as exc:
            hint = ""
            if "postgres" in str(exc) and "postgresql" not in str(exc):
                hint = " (write postgresql+psycopg://..., not postgres://...)"
            raise Fail(f"unsupported database URL: {exc}{hint}") from None
        except sa.exc.ArgumentError as exc:
            raise Fail(f"bad database URL: {exc}") from None
        except ValueError as exc:  # a URL part SQLAlchemy cannot read (a port that is no number, ...)
            raise Fail(f"bad database URL: {exc}") from None
        except (sa.exc.OperationalError, sa.exc.ProgrammingError) as exc:  # unreachable, a schema that is not there
            raise Fail(f"cannot use the database: {str(exc.orig).strip().splitlines()[0]}") from None
        except ModuleNotFoundError as exc:
            raise Fail(
                f"the database driver is not installed ({exc.name}): {DRIVER_HINTS.get(exc.name or '', INSTALL)}"
            ) from None

    return wrapper


INSTALL = "pip install 'delayq[postgres]' (psycopg) or 'delayq[mysql]' (mysqlclient)"
DRIVER_HINTS = {
    "psycopg": "pip install 'delayq[postgres]'",
    "MySQLdb": "pip install 'delayq[mysql]'",
    "pymysql": "pip install pymysql, or write mysql+mysqldb://... and pip install 'delayq[mysql]'",
    "psycopg2": "pip install psycopg2-binary, or write postgresql+psycopg://... and pip install 'delayq[postgres]'",
}
OTHER_DRIVERS = {
    # URL driver name -> (its module, the driver delayq is built and tested on, as a URL and an extra)
    "psycopg2": ("psycopg2", "postgresql+psycopg://... (pip install 'delayq[postgres]')"),
    "pymysql": ("pymysql", "mysql+mysqldb://... (pip install 'delayq[mysql]')"),
}
"""Synchronous drivers SQLAlchemy knows that delayq is not tested on: a note when installed, a hint when not."""
ASYNC_DRIVERS = {
    "asyncpg": "postgresql+psycopg://",
    "psycopg_async": "postgresql+psycopg://",
    "aiosqlite": "sqlite:///",
    "asyncmy": "mysql+mysqldb://",
    "aiomysql": "mysql+mysqldb://",
}


def check_url(url: str) -> sa.engine.URL | None:
    """The parsed URL; a ``Fail`` for an asyncio driver or a SQLite file that is not there (never created here)."""
    try:
        parsed = sa.engine.make_url(url)
    except (sa.exc.ArgumentError, ValueError):
        return None  # the command reports a bad URL
    driver = parsed.get_driver_name()
    sync = ASYNC_DRIVERS.get(driver)
    if sync is not None:
        raise Fail(
            f"{parsed.drivername} is an asyncio driver, for the delayq.aio API: the command line needs a "
            f"synchronous one, e.g. {sync}... with the same host and database"
        )
    if driver in OTHER_DRIVERS:
        module, tested = OTHER_DRIVERS[driver]
        if not _importable(module):
            raise Fail(f"the database driver is not installed ({module}): {DRIVER_HINTS[module]}")
        current = click.get_current_context(silent=True)
        noted = current.meta.setdefault("delayq_noted_urls", set()) if current else set()
        if url not in noted:  # once per command, not at every refresh of stats --watch
            noted.add(url)
            click.echo(
                f"note: {parsed.drivername}:// uses {module}, which delayq is not tested on: it is on {tested}",
                err=True,
            )
    return parsed


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails, or a module in sys.modules without a spec
        return module in sys.modules and sys.modules[module] is not None


def check_sqlite_file(parsed: sa.engine.URL | None) -> None:
    """A read-only command on a SQLite file that does not exist fails instead of creating it."""
    if parsed is None or parsed.get_backend_name() != "sqlite":
        return
    database = parsed.database or ""
    if database and database != ":memory:" and not database.startswith("file:") and not os.path.exists(database):
        raise Fail(f"no SQLite database at {database}: run `delayq migrate` there first, or give --url")


@contextmanager
def connect(ctx: click.Context) -> Iterator[tuple[sa.Engine, sa.Connection]]:
    check_sqlite_file(check_url(ctx.obj["url"]))
    engine = sa.create_engine(ctx.obj["url"], poolclass=sa.pool.NullPool)
    try:
        try:
            opened = engine.connect()
        except TypeError as exc:  # mysqlclient's answer to a URL option it does not know
            raise Fail(f"bad database URL: {exc}") from None
        with opened as conn:
            tables = make_tables(ctx.obj["prefix"])
            if not sa.inspect(conn).has_table(tables.messages.name):
                raise Fail(
                    f"delayq's tables ({tables.messages.name}, ...) are not in this database: run "
                    "`delayq migrate` with the same --url"
                )
            yield engine, conn
    finally:
        engine.dispose()


STATE_COLOURS = {
    "ready": "green",
    "scheduled": "cyan",
    "in-flight": "yellow",
    "expired-lock": "magenta",
    "dead": "red",
}


def emit(rows: list[dict[str, Any]], as_json: bool, columns: list[str]) -> None:
    """Rows as JSON, or as a table (headers bold and states coloured when stdout is a terminal)."""
    if as_json:
        click.echo(json.dumps(rows, indent=2, default=str))
        return
    if not rows:
        click.echo("(nothing)")
        return
    widths = {c: max(len(c), *(len(_cell(r[c])) for r in rows)) for c in columns}
    click.echo(click.style("  ".join(c.upper().ljust(widths[c]) for c in columns).rstrip(), bold=True))
    for r in rows:
        cells = []
        for c in columns:
            text = _cell(r[c]).ljust(widths[c])
            colour = STATE_COLOURS.get(r[c]) if c == "state" else None
            cells.append(click.style(text, fg=colour) if colour else text)
        click.echo("  ".join(cells).rstrip())


def relative(at: dt.datetime | None, now: dt.datetime) -> str | None:
    """``in 5m 00s`` or ``3.0s ago``."""
    if at is None:
        return None
    return f"in {human(at - now)}" if at > now else f"{human(now - at)} ago"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return value if isinstance(value, str) else json.dumps(value, default=str)
