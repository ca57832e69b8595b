"""What every command of the ``delayq`` command line shares: one-line failures, the URL's checks, the
connection, and the output (below the command modules and ``delayq.topics.cli``)."""

from __future__ import annotations

import datetime as dt
import functools
import getpass
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ParamSpec, TypeVar

import click
import sqlalchemy as sa

from delayq import audit, engines, migrations
from delayq.dialects import dialect_class
from delayq.errors import DelayqError, install_hint
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


INSTALL = f"{install_hint('postgres')} (psycopg), or the mysql extra (mysqlclient)"
DRIVER_HINTS = {
    "psycopg": install_hint("postgres"),
    "MySQLdb": install_hint("mysql"),
    "pymysql": f"pip install pymysql, or write mysql+mysqldb://... and {install_hint('mysql')}",
    "greenlet": install_hint("asyncio"),
    "aiosqlite": install_hint("asyncio-sqlite"),
    "asyncmy": install_hint("asyncio-mysql"),
    "asyncpg": install_hint("asyncio-asyncpg"),
    "psycopg2": f"pip install psycopg2-binary, or write postgresql+psycopg://... and {install_hint('postgres')}",
}
OTHER_DRIVERS = {
    # URL driver name -> (its module, the driver delayq is built and tested on, as a URL and an extra)
    "psycopg2": ("psycopg2", f"postgresql+psycopg://... ({install_hint('postgres')})"),
    "pymysql": ("pymysql", f"mysql+mysqldb://... ({install_hint('mysql')})"),
}
"""Synchronous drivers SQLAlchemy knows that delayq is not tested on: a note when installed, a hint when not."""
ASYNC_DRIVERS = {
    "asyncpg": "postgresql+psycopg://",
    "psycopg_async": "postgresql+psycopg://",
    "aiosqlite": "sqlite:///",
    "asyncmy": "mysql+mysqldb://",
    "aiomysql": "mysql+mysqldb://",
}


def check_url(url: str, async_hint: str = "") -> sa.engine.URL | None:
    """The parsed URL; a ``Fail`` for an asyncio driver or a SQLite file that is not there (never created here)."""
    try:
        parsed = sa.engine.make_url(url)
    except (sa.exc.ArgumentError, ValueError):
        return None  # the command reports a bad URL
    try:
        in_memory = dialect_class(parsed.get_backend_name()).in_memory(parsed)
    except DelayqError:
        in_memory = False  # a backend delayq does not run on: the command says so when it connects
    if in_memory:
        raise Fail(
            "sqlite:///:memory: is a database of one process, gone when the command ends: "
            "give a file, e.g. --url sqlite:///delayq.db"
        )
    driver = parsed.get_driver_name()
    sync = ASYNC_DRIVERS.get(driver)
    if sync is not None:
        raise Fail(
            f"{parsed.drivername} is an asyncio driver, for the delayq.aio API: the command line needs a "
            f"synchronous one, e.g. {sync}... with the same host and database{async_hint}"
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
    """A connection to a database whose tables are at this delayq's revision, every call on it bounded."""
    check_sqlite_file(check_url(ctx.obj["url"]))
    engine = engines.create_engine(ctx.obj["url"])
    try:
        with engines.read_bound(engine), opened(engine) as conn:
            check_schema(conn, ctx.obj["prefix"])
            yield engine, conn
    finally:
        engine.dispose()


def opened(engine: sa.Engine) -> sa.Connection:
    try:
        return engine.connect()
    except TypeError as exc:  # mysqlclient's answer to a URL option it does not know
        raise Fail(f"bad database URL: {exc}") from None


def check_schema(conn: sa.Connection, prefix: str) -> None:
    """``Fail`` unless delayq's tables are there, at the revision this delayq needs."""
    tables = make_tables(prefix)
    if not sa.inspect(conn).has_table(tables.messages.name):
        raise Fail(
            f"delayq's tables ({tables.messages.name}, ...) are not in this database: run "
            "`delayq migrate` with the same --url"
        )
    migrations.check_revision(conn, tables)
    conn.rollback()


STATE_COLOURS = {
    "ready": "green",
    "scheduled": "cyan",
    "in-flight": "yellow",
    "expired-lock": "magenta",
    "dead": "red",
    "running": "green",
    "gone": "red",
    "completed": "blue",
    "cancelled": "white",
}


def emit(rows: list[dict[str, Any]], as_json: bool, columns: list[str]) -> None:
    """Rows as JSON, or as a table (headers bold and states coloured when stdout is a terminal)."""
    if as_json:
        click.echo(json.dumps(rows, indent=2, default=json_value))
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


def json_value(value: object) -> str:
    """What JSON output writes for a value JSON has no type for: times in ISO 8601 (with ``T``), as everywhere."""
    return value.isoformat() if isinstance(value, dt.datetime | dt.date | dt.time) else str(value)


def relative(at: dt.datetime | None, now: dt.datetime) -> str | None:
    """``in 5m 00s`` or ``3.0s ago``."""
    if at is None:
        return None
    return f"in {human(at - now)}" if at > now else f"{human(now - at)} ago"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return value if isinstance(value, str) else json.dumps(value, default=json_value)


def read_payload(arg: str) -> tuple[str, str]:
    """The payload's text and what to call it in errors: ``-`` reads stdin, ``@path`` a file, else ``arg``."""
    if arg == "-":
        return sys.stdin.read(), "stdin"
    if arg.startswith("@"):
        path = arg[1:]
        try:
            with open(path, encoding="utf-8") as f:
                return f.read(), path
        except OSError as exc:
            raise Fail(f"cannot read the payload file {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise Fail(f"the payload file {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return arg, "PAYLOAD"


def operator() -> str:
    """Who the audit records as acting from this command line: the OS user (``LOGNAME``, ``USER``, or the
    account's name, as ``getpass.getuser``), else the user id."""
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # (no such variable, and no account of this uid)
        return f"uid {os.getuid()}"


def audited(ctx: click.Context, action: str, queue: str, count: int | None = None, **chosen: object) -> None:
    """Record a done action in the audit (``delayq.audit``), right after it, in a transaction of its own:
    ``chosen`` is what it selected or set (None values left out), ``count`` how many messages it affected.
    A failure is a warning line that says the action was done; the command's exit status stays 0."""
    engine = engines.create_engine(ctx.obj["url"])
    try:
        audit.record(
            engine,
            make_tables(ctx.obj["prefix"]),
            action,
            actor=operator(),
            source="cli",
            queue=queue,
            filter=chosen,
            count=count,
        )
    except (sa.exc.SQLAlchemyError, DelayqError) as exc:  # (whatever it is, the action stands)
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        click.echo(f"warning: {action} on {queue!r} was done, but not recorded in the audit: {reason}", err=True)
    finally:
        engine.dispose()
