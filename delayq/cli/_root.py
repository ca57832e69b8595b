"""The ``delayq`` group and what its commands share: the URL (checked, shown without secrets), durations
and times, and the queue an operator acts on."""

from __future__ import annotations

import datetime as dt
import re

import click
import sqlalchemy as sa

from delayq import engines
from delayq.browse import queue_names
from delayq.cli._common import Fail
from delayq.queue import DelayedQueue
from delayq.schema import DEFAULT_PREFIX, make_tables
from delayq.serializers import BytesSerializer

DEFAULT_URL = "sqlite:///delayq.db"


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
    ctx.obj = {"url": engines.driver_url(url), "prefix": prefix}  # postgres://, as Heroku's DATABASE_URL has it


def unknown_queue_note(ctx: click.Context, conn: sa.Connection, name: str) -> str:
    """Empty for a queue the database knows of; else a note that it has nothing at all, and which queues do.

    Queues are not registered: a drained queue (no messages, dead letters or cron schedule) reads as a
    new one, so an operation on it is no error, and the note helps spot a typo.
    """
    names = queue_names(conn, make_tables(ctx.obj["prefix"]))
    if name in names:
        return ""
    return f"queue {name!r} has no messages, dead letters or cron schedule; queues that have: {known_list(names)}"


def known_list(names: list[str]) -> str:
    """The first ``KNOWN_SHOWN`` of ``names`` for a note, ``none`` when there are none."""
    return ", ".join(names[:KNOWN_SHOWN]) + (", ..." if len(names) > KNOWN_SHOWN else "") if names else "none"


def _noted(note: str) -> str:
    return f" ({note})" if note else ""


KNOWN_SHOWN = 10


def admin_queue(engine: sa.Engine, ctx: click.Context, name: str) -> DelayedQueue:
    # Operations that move messages do not decode payloads: any serializer's rows qualify.
    return DelayedQueue(engine, name, table_prefix=ctx.obj["prefix"], serializer=BytesSerializer())


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
