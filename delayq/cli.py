"""The ``delayq`` command: migrate, demo, worker, and the operator's view of queued messages.

Every command takes ``--url`` (or ``DELAYQ_URL``; default ``sqlite:///delayq.db``). Bad input prints one
line saying what to do and exits with code 2, without a traceback.
"""

from __future__ import annotations

import datetime as dt
import functools
import importlib
import json
import logging
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ParamSpec, TypeVar

import click
import sqlalchemy as sa

from delayq import migrations
from delayq.browse import State, list_messages, queue_names
from delayq.dialects import dialect_class
from delayq.errors import DelayqError
from delayq.handler import Handler
from delayq.queue import DelayedQueue, check_queue_name
from delayq.schema import DEFAULT_PREFIX, make_tables
from delayq.serializers import BytesSerializer
from delayq.worker import Worker

DEFAULT_URL = "sqlite:///delayq.db"
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
                f"the database driver is not installed ({exc.name}): pip install 'delayq[postgres]' or 'delayq[mysql]'"
            ) from None

    return wrapper


class AnywhereOptions(click.Group):
    """A group whose own options (``--url``, ``--prefix``) may also follow the subcommand:
    ``delayq migrate --url URL`` works as ``delayq --url URL migrate`` does."""

    moved = ("--url", "--prefix")

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        front: list[str] = []
        rest: list[str] = []
        i = 0
        while i < len(args):
            arg = args[i]
            if arg == "--":
                rest += args[i:]
                break
            if arg in self.moved and i + 1 < len(args):
                front += args[i : i + 2]
                i += 2
                continue
            if arg.split("=", 1)[0] in self.moved and "=" in arg:
                front.append(arg)
            else:
                rest.append(arg)
            i += 1
        return super().parse_args(ctx, front + rest)


@click.group(cls=AnywhereOptions)
@click.version_option(package_name="delayq", prog_name="delayq")
@click.option(
    "--url", envvar="DELAYQ_URL", default=DEFAULT_URL, show_default=True, help="Database URL (or DELAYQ_URL)."
)
@click.option("--prefix", default=DEFAULT_PREFIX, show_default=True, help="Table name prefix.")
@click.pass_context
def main(ctx: click.Context, url: str, prefix: str) -> None:
    """delayq: delayed messages and background jobs in your relational database."""
    if _unencoded_at(url):
        raise click.UsageError("the URL's password contains '@': percent-encode it as %40")
    ctx.obj = {"url": url, "prefix": prefix}


@contextmanager
def connect(ctx: click.Context) -> Iterator[tuple[sa.Engine, sa.Connection]]:
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


def existing_queue(ctx: click.Context, conn: sa.Connection, name: str) -> str:
    names = queue_names(conn, make_tables(ctx.obj["prefix"]))
    if name not in names:
        known = ", ".join(names) if names else "none yet"
        raise Fail(f"no queue named {name!r} (queues with messages: {known})")
    return name


def admin_queue(engine: sa.Engine, ctx: click.Context, name: str) -> DelayedQueue:
    # Operations that move messages do not decode payloads: any serializer's rows qualify.
    return DelayedQueue(engine, name, table_prefix=ctx.obj["prefix"], serializer=BytesSerializer())


def emit(rows: list[dict[str, Any]], as_json: bool, columns: list[str]) -> None:
    if as_json:
        click.echo(json.dumps(rows, indent=2, default=str))
        return
    if not rows:
        click.echo("(nothing)")
        return
    widths = {c: max(len(c), *(len(_cell(r[c])) for r in rows)) for c in columns}
    click.echo("  ".join(c.upper().ljust(widths[c]) for c in columns))
    for r in rows:
        click.echo("  ".join(_cell(r[c]).ljust(widths[c]) for c in columns))


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return value if isinstance(value, str) else json.dumps(value, default=str)


# -- setup --------------------------------------------------------------------------------------------
@main.command()
@click.option("--revision", default="heads", show_default=True, help="Alembic revision to upgrade to.")
@click.option("--schema", default=None, help="Database schema of the tables.")
@click.pass_context
@friendly
def migrate(ctx: click.Context, revision: str, schema: str | None) -> None:
    """Create or upgrade delayq's tables (Alembic's upgrade on delayq's packaged migrations)."""
    url = ctx.obj["url"]
    shown = shown_url(url)
    migrations.upgrade(url, revision, prefix=ctx.obj["prefix"], schema=schema)
    click.echo(f"delayq tables are at {revision} in {shown}")


@main.command()
@click.option("--seconds", default=12.0, show_default=True, help="How long the worker runs.")
@click.pass_context
@friendly
def demo(ctx: click.Context, seconds: float) -> None:
    """A tour on the embedded default: offers, retries, a dead letter, a cron schedule, a worker."""
    from delayq.demo import run_demo

    run_demo(ctx.obj["url"], seconds)


# -- workers ------------------------------------------------------------------------------------------
def load_handlers(spec: str) -> list[Handler | type[Handler]]:
    """Import ``module:attr`` where attr is a Handler class, an instance, or a list of them."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise Fail(f"expected module:attr, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise Fail(f"cannot load {spec!r}: {exc}") from None
    except SyntaxError as exc:
        raise Fail(f"cannot load {spec!r}: {exc.msg} at {exc.filename}:{exc.lineno}") from None
    except Exception as exc:  # the module's own code failed while it was imported: say where
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        raise Fail(f"cannot load {spec!r}: {type(exc).__name__}: {exc} (at {frame.filename}:{frame.lineno})") from None
    try:
        target = getattr(module, attr)
    except AttributeError as exc:
        raise Fail(f"cannot load {spec!r}: {exc}") from None
    items = list(target) if isinstance(target, list | tuple) else [target]
    for item in items:
        if not (isinstance(item, Handler) or (isinstance(item, type) and issubclass(item, Handler))):
            raise Fail(f"{spec!r} holds {item!r}, not a Handler class or instance")
    return items


@main.command()
@click.argument("handlers")
@click.option("--concurrency", default=4, show_default=True, type=click.IntRange(min=1), help="Handlers at once.")
@click.option(
    "--shutdown-timeout",
    default=30.0,
    show_default=True,
    type=click.FloatRange(min=0, max=86_400),
    help="Seconds in-flight handlers may run on after SIGINT/SIGTERM.",
)
@click.option("--log-level", default="INFO", show_default=True)
@click.pass_context
@friendly
def worker(ctx: click.Context, handlers: str, concurrency: int, shutdown_timeout: float, log_level: str) -> None:
    """Run the handlers HANDLERS (module:attr) until SIGINT or SIGTERM."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if "" not in sys.path:
        sys.path.insert(0, "")  # module:attr from the current directory, as python -m would
    loaded = load_handlers(handlers)
    engine = worker_engine(ctx.obj["url"], concurrency)
    try:
        with engine.connect():
            pass  # fail now, with one line, if the database cannot be reached
        Worker(
            engine,
            loaded,
            concurrency=concurrency,
            table_prefix=ctx.obj["prefix"],
            shutdown_timeout=dt.timedelta(seconds=shutdown_timeout),
        ).run()  # raises SchemaMissingError (exit 2, "run `delayq migrate`") when the tables are missing
    finally:
        engine.dispose()


def worker_engine(url: str, concurrency: int) -> sa.Engine:
    """An engine whose pool fits a worker of ``concurrency`` handlers, with network timeouts.

    Each handler may hold a connection for its whole run (a transactional one does), and the fetch
    loop, the heartbeat and the listener need one each besides: a smaller pool would make them
    wait on each other. Engines without a queue pool (SQLite in memory) are left as they are.
    The dialect's ``network_timeouts`` apply unless the URL sets them.
    """
    engine = sa.create_engine(url)
    if not isinstance(engine.pool, sa.pool.QueuePool):
        return engine
    engine.dispose()
    parsed = sa.engine.make_url(url)
    defaults = dialect_class(engine.dialect.name).network_timeouts
    timeouts = {k: v for k, v in defaults.items() if k not in parsed.query}
    # delayq ends every transaction it begins (commit, or a rollback when its Connection closes on an
    # error), so the pool's ROLLBACK on return would only cost a round trip (on mysqlclient).
    return sa.create_engine(
        url,
        pool_size=concurrency + 3,
        max_overflow=concurrency,
        connect_args=timeouts,
        pool_reset_on_return=None,
    )


SECRET_QUERY_KEYS = {"password", "passwd", "pass", "sslpassword", "sslkey_password"}


def _unencoded_at(url: str) -> bool:
    """Whether a password's ``@`` spilled into the host (its tail would appear in errors)."""
    try:
        host = sa.engine.make_url(url).host
    except (sa.exc.ArgumentError, ValueError):
        return False  # the command reports a bad URL
    return host is not None and "@" in host


def shown_url(url: str) -> str:
    """The URL as printed: the password, and every query argument that holds one, masked."""
    parsed = sa.engine.make_url(url)
    masked = {k: "***" for k in parsed.query if k.lower() in SECRET_QUERY_KEYS}
    return parsed.update_query_dict(masked).render_as_string(hide_password=True)


# -- looking -------------------------------------------------------------------------------------------
@main.command()
@click.argument("queue", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--watch", is_flag=True, help="Refresh every --interval seconds until Ctrl-C.")
@click.option("--interval", default=2.0, show_default=True)
@click.option("--times", default=0, hidden=True, help="With --watch: stop after this many refreshes.")
@click.pass_context
@friendly
def stats(ctx: click.Context, queue: str | None, as_json: bool, watch: bool, interval: float, times: int) -> None:
    """Per queue: ready, scheduled, in flight, expired locks, dead, age of the oldest due message."""
    shown = 0
    while True:
        with connect(ctx) as (engine, conn):
            # A named queue with nothing in it shows zeros: to monitoring, a drained queue is a queue.
            names = [check_queue_name(queue)] if queue else queue_names(conn, make_tables(ctx.obj["prefix"]))
            rows = []
            for name in names:
                s = admin_queue(engine, ctx, name).stats(using=conn)
                rows.append(
                    {
                        "queue": name,
                        "ready": s.ready,
                        "scheduled": s.scheduled,
                        "in_flight": s.in_flight,
                        "expired_locks": s.expired_locks,
                        "dead": s.dead,
                        "oldest_due_age_s": None
                        if s.oldest_due_age is None
                        else round(s.oldest_due_age.total_seconds(), 1),
                    }
                )
        if watch and not as_json:
            click.clear()
            click.echo(dt.datetime.now().strftime("%H:%M:%S"))
        emit(rows, as_json, ["queue", "ready", "scheduled", "in_flight", "expired_locks", "dead", "oldest_due_age_s"])
        shown += 1
        if not watch or (times and shown >= times):
            return
        time.sleep(interval)


@main.command(name="ls")
@click.argument("queue")
@click.option("--state", type=click.Choice([s.value for s in State]), help="Only messages in this state.")
@click.option("--key-prefix", help="Only keys that start with this.")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(min=1))
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
@friendly
def ls(ctx: click.Context, queue: str, state: str | None, key_prefix: str | None, limit: int, as_json: bool) -> None:
    """List a queue's messages (or dead letters) by due time."""
    with connect(ctx) as (_, conn):
        existing_queue(ctx, conn, queue)
        found = list_messages(
            conn,
            make_tables(ctx.obj["prefix"]),
            queue,
            state=State(state) if state else None,
            now=dt.datetime.now(dt.UTC),
            key_prefix=key_prefix,
            limit=limit,
        )
    emit([m.as_dict() for m in found], as_json, ["key", "state", "scheduled_at", "attempts", "last_error", "payload"])


@main.command()
@click.argument("queue")
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
@friendly
def show(ctx: click.Context, queue: str, key: str, as_json: bool) -> None:
    """Everything about one message (or its dead letters)."""
    tables = make_tables(ctx.obj["prefix"])
    with connect(ctx) as (_, conn):
        existing_queue(ctx, conn, queue)
        now = dt.datetime.now(dt.UTC)
        found = list_messages(conn, tables, queue, state=None, now=now, key=key, limit=1) + list_messages(
            conn, tables, queue, state=State.DEAD, now=now, key=key, limit=20
        )
    if not found:
        raise Fail(f"no message {key!r} in queue {queue!r}")
    rows = [m.as_dict() for m in found]
    if as_json:
        click.echo(json.dumps(rows, indent=2, default=str))
        return
    for row in rows:
        for name, value in row.items():
            click.echo(f"{name:>13}: {_cell(value)}")
        click.echo()


# -- acting ---------------------------------------------------------------------------------------------
DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)")
UNITS = {"ms": "milliseconds", "s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def parse_duration(text: str) -> dt.timedelta:
    """``90s``, ``5m``, ``1h30m``, ``2d``."""
    parts = DURATION.findall(text.replace(" ", ""))
    if not parts or "".join(n + u for n, u in parts) != text.replace(" ", ""):
        raise Fail(f"bad duration {text!r}: use e.g. 90s, 5m, 1h30m, 2d")
    try:
        return sum((dt.timedelta(**{UNITS[u]: float(n)}) for n, u in parts), dt.timedelta())
    except OverflowError:
        raise Fail(f"duration {text!r} is out of range: at most 100 years") from None


def parse_time(text: str) -> dt.datetime:
    """ISO 8601 with a UTC offset, e.g. 2030-01-01T09:00:00+01:00 or ...Z."""
    try:
        value = dt.datetime.fromisoformat(text)
    except ValueError:
        raise Fail(f"bad time {text!r}: use ISO 8601 with an offset, e.g. 2030-01-01T09:00+01:00") from None
    if value.tzinfo is None:
        raise Fail(f"time {text!r} has no UTC offset: add one, e.g. {text}+00:00")
    return value


@main.command()
@click.argument("queue")
@click.argument("key")
@click.option("--at", "at_text", help="When, ISO 8601 with an offset.")
@click.option("--in", "in_text", help="How long from now, e.g. 90s, 5m, 1h30m.")
@click.pass_context
@friendly
def reschedule(ctx: click.Context, queue: str, key: str, at_text: str | None, in_text: str | None) -> None:
    """Change when a message runs."""
    if (at_text is None) == (in_text is None):
        raise Fail("give exactly one of --at TIME or --in DURATION")
    at: dt.datetime | dt.timedelta = parse_time(at_text) if at_text else parse_duration(in_text or "")
    _act(ctx, queue, key, lambda q: q.reschedule(key, at), "rescheduled")


@main.command(name="run-now")
@click.argument("queue")
@click.argument("key")
@click.pass_context
@friendly
def run_now(ctx: click.Context, queue: str, key: str) -> None:
    """Make a message due now."""
    _act(ctx, queue, key, lambda q: q.reschedule(key), "due now")


@main.command()
@click.argument("queue")
@click.argument("key")
@click.pass_context
@friendly
def cancel(ctx: click.Context, queue: str, key: str) -> None:
    """Delete a message."""
    _act(ctx, queue, key, lambda q: q.cancel(key), "cancelled")


def _act(ctx: click.Context, queue: str, key: str, action: Callable[[DelayedQueue], bool], done: str) -> None:
    with connect(ctx) as (engine, conn):
        existing_queue(ctx, conn, queue)
        conn.rollback()  # hold nothing while the action runs on its own connection
        if not action(admin_queue(engine, ctx, queue)):
            raise Fail(f"no message {key!r} in queue {queue!r}")
    click.echo(f"{queue} {key}: {done}")


@main.group()
def dead() -> None:
    """Act on dead letters."""


def _dead_keys(
    ctx: click.Context, conn: sa.Connection, queue: str, key: str | None, key_prefix: str | None, everything: bool
) -> list[str]:
    if sum((key is not None, key_prefix is not None, everything)) != 1:
        raise Fail("give exactly one of --key K, --key-prefix P or --all")
    found = list_messages(
        conn,
        make_tables(ctx.obj["prefix"]),
        queue,
        state=State.DEAD,
        now=dt.datetime.now(dt.UTC),
        key=key,
        key_prefix=key_prefix,
        limit=10_000_000,
    )
    return list(dict.fromkeys(m.key for m in found))


def _dead_command(verb: str) -> Callable[..., None]:
    @click.argument("queue")
    @click.option("--key", help="One key.")
    @click.option("--key-prefix", help="Keys that start with this.")
    @click.option("--all", "everything", is_flag=True, help="All of the queue's dead letters.")
    @click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
    @click.pass_context
    @friendly
    def command(
        ctx: click.Context, queue: str, key: str | None, key_prefix: str | None, everything: bool, yes: bool
    ) -> None:
        with connect(ctx) as (engine, conn):
            existing_queue(ctx, conn, queue)
            keys = _dead_keys(ctx, conn, queue, key, key_prefix, everything)
        if not keys:
            raise Fail(f"no dead letters match in queue {queue!r}")
        if not yes:
            click.confirm(f"{verb} {len(keys)} dead letter key(s) of {queue!r}?", abort=True)
        engine = sa.create_engine(ctx.obj["url"])
        q, done = admin_queue(engine, ctx, queue), 0
        try:
            if verb == "purge":  # one statement, whatever the number of keys
                done = q.purge_dead(key=key, key_prefix=key_prefix, everything=everything)
            else:
                with (
                    click.progressbar(keys, label=f"{verb}", file=sys.stderr, show_pos=True)
                    if len(keys) > 100
                    else _plain(keys) as bar
                ):
                    for k in bar:
                        done += q.requeue_dead(k)
        finally:
            engine.dispose()
        click.echo(f"{queue}: {done} dead letter(s) {'requeued' if verb == 'requeue' else 'purged'}")

    command.__doc__ = f"{verb.capitalize()} dead letters (asks first unless --yes)."
    return command


@contextmanager
def _plain(keys: list[str]) -> Iterator[list[str]]:
    yield keys


dead.command(name="requeue")(_dead_command("requeue"))
dead.command(name="purge")(_dead_command("purge"))


# -- cron ----------------------------------------------------------------------------------------------
@main.group()
def cron() -> None:
    """Look at installed cron schedules, or uninstall one."""


@cron.command(name="ls")
@click.option("--queue", help="Only this queue.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--at", "at_text", hidden=True, help="Judge as of this time (ISO 8601) instead of the database's now.")
@click.pass_context
@friendly
def cron_ls(ctx: click.Context, queue: str | None, as_json: bool, at_text: str | None) -> None:
    """Installed schedules: definition, next and last run, who refreshed them when, and whether they stalled.

    A schedule is STALLED when no process has refreshed it for longer than its look-ahead: its installed
    runs are used up, and no process that declares it is running.
    """
    from delayq.cron import schedule_views

    with connect(ctx) as (engine, conn):
        now = parse_time(at_text) if at_text else None
        views = schedule_views(engine, conn, make_tables(ctx.obj["prefix"]), queue=queue, now=now)
    if as_json:
        click.echo(json.dumps(views, indent=2, default=str))
        return
    rows = [
        {
            "queue": v["queue"],
            "name": v["name"],
            "definition": v["summary"],
            "next_run": v["next_run"],
            "last_run": None if v["last_run"] is None else f"{v['last_run']['due']} ({v['last_run']['state']})",
            "refreshed": f"{v['refreshed_at']} by {v['refreshed_by']}" if v["refreshed_at"] else None,
            "stalled": "STALLED" if v["stalled"] else "",
        }
        for v in views
    ]
    emit(rows, False, ["queue", "name", "definition", "next_run", "last_run", "refreshed", "stalled"])


@cron.command(name="uninstall")
@click.argument("queue")
@click.argument("name")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
@friendly
def cron_uninstall(ctx: click.Context, queue: str, name: str, yes: bool) -> None:
    """Delete a schedule's record and its pending runs, in one transaction.

    A process that still declares the schedule installs it again (and logs a warning that it did).
    """
    from delayq.cron import uninstall

    if not yes:
        click.confirm(f"uninstall cron schedule {name!r} of queue {queue!r}?", abort=True)
    engine = sa.create_engine(ctx.obj["url"], poolclass=sa.pool.NullPool)
    try:
        deleted = uninstall(admin_queue(engine, ctx, queue), name)
    finally:
        engine.dispose()
    click.echo(f"{queue} {name}: uninstalled, {deleted} pending run(s) deleted")


if __name__ == "__main__":
    main()
