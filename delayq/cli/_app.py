"""The ``delayq`` command assembled: every command registered on ``main``, the topics' group included."""

from __future__ import annotations

import datetime as dt
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click
import sqlalchemy as sa

from delayq import engines
from delayq.browse import State, StoredMessage, database_now, keys_under, list_messages
from delayq.cli import _setup, _stats, _worker  # noqa: F401  (each registers its commands on main)
from delayq.cli._common import STATE_COLOURS, Fail, _cell, connect, emit, friendly, json_value, relative
from delayq.cli._root import _noted, admin_queue, main, parse_duration, parse_time, unknown_queue_note
from delayq.humanize import human, shorten
from delayq.queue import DelayedQueue, check_prefix, check_queue_name
from delayq.schema import make_tables
from delayq.topics.cli import topics

# -- setup --------------------------------------------------------------------------------------------


# -- workers ------------------------------------------------------------------------------------------


# -- looking -------------------------------------------------------------------------------------------
PAYLOAD_SHOWN = 200
"""Characters of a payload (as JSON) that listings show; ``show`` and ``ls --full`` show it whole."""


@main.command(name="ls")
@click.argument("queue")
@click.option("--state", type=click.Choice([s.value for s in State]), help="Only messages in this state.")
@click.option("--key-prefix", help="Only keys that start with this.")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(min=1))
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--full", is_flag=True, help=f"Payloads whole (else cut at {PAYLOAD_SHOWN} characters).")
@click.pass_context
@friendly
def ls(
    ctx: click.Context,
    queue: str,
    state: str | None,
    key_prefix: str | None,
    limit: int,
    as_json: bool,
    full: bool,
) -> None:
    """List a queue's messages (or dead letters) by due time, in the states `stats` counts.

    A queue with nothing in it lists nothing (exit 0); when the database knows nothing of it at all,
    stderr says so, with the queues it does know. A payload longer than 200 characters (as JSON) is
    cut, with its length: `show` and `--full` print it whole.
    """
    check_queue_name(queue)
    with connect(ctx) as (_, conn):
        now = database_now(conn)
        found = list_messages(
            conn,
            make_tables(ctx.obj["prefix"]),
            queue,
            state=State(state) if state else None,
            now=now,
            key_prefix=key_prefix,
            limit=limit,
        )
        note = "" if found or as_json else unknown_queue_note(ctx, conn, queue)
    if note:
        click.echo(f"note: {note}", err=True)
    if as_json:
        listed = [m.as_dict() for m in found]
        for d in listed:
            d["payload"] = d["payload"] if full else shorten(d["payload"], PAYLOAD_SHOWN)
        emit(listed, True, [])
        return
    dead_only = state == State.DEAD.value
    rows = [_row(m, now, full) for m in found]
    when = ["failed"] if dead_only else ["due", "running"]
    emit(rows, False, ["key", "state", *when, "attempts", "last_error", "payload"])


def _row(m: StoredMessage, now: dt.datetime, full: bool) -> dict[str, Any]:
    return {
        "key": m.key,
        "state": m.state.value,
        "due": relative(m.scheduled_at, now),
        "failed": relative(m.failed_at, now),
        "running": "" if (ran := m.running_for(now)) is None else human(ran),
        "attempts": m.attempts,
        "last_error": m.last_error,
        "payload": m.payload if full else shorten(m.payload, PAYLOAD_SHOWN),
    }


@main.command()
@click.argument("queue")
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
@friendly
def show(ctx: click.Context, queue: str, key: str, as_json: bool) -> None:
    """Everything about one message (or its dead letters)."""
    tables = make_tables(ctx.obj["prefix"])
    check_queue_name(queue)
    with connect(ctx) as (_, conn):
        now = database_now(conn)
        found = list_messages(conn, tables, queue, state=None, now=now, key=key, limit=1) + list_messages(
            conn, tables, queue, state=State.DEAD, now=now, key=key, limit=20
        )
        if not found:
            raise Fail(f"no message {key!r} in queue {queue!r}{_noted(unknown_queue_note(ctx, conn, queue))}")
    if as_json:
        click.echo(json.dumps([m.as_dict() for m in found], indent=2, default=json_value))
        return
    for m in found:
        for name, value in m.as_dict().items():
            if name == "attempt_history" or (name == "failed_at" and value is None):
                continue
            if name == "state":
                value = click.style(value, fg=STATE_COLOURS.get(value))
            when = {"scheduled_at": m.scheduled_at, "failed_at": m.failed_at}.get(name)
            shown = _cell(value) if when is None else f"{value} ({relative(when, now)})"
            click.echo(f"{name:>13}: {shown}")
        for r in m.attempt_history:
            click.echo(
                click.style(f"\n  attempt {r.attempt} failed {relative(r.at, now)} ({r.at.isoformat()})", bold=True)
            )
            click.echo(f"  {r.message}")
            for line in (r.traceback or "").rstrip().splitlines():
                click.echo(click.style(f"    {line}", dim=True))
        click.echo()


# -- acting ---------------------------------------------------------------------------------------------


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


CANCEL_CHUNK = 1000
"""At most this many of the listed keys per DELETE of ``cancel --key-prefix``."""


def prefix_chunks(prefix: str, keys: list[str], size: int) -> Iterator[tuple[str, bool, int]]:
    """Cover ``keys`` (each starts with ``prefix``) with longer prefixes that hold at most ``size`` of them each.

    Yields ``(sub, exact, n)``: ``cancel_prefix(sub)`` deletes ``n`` of the keys, or, when ``exact``,
    ``sub`` is itself one of the keys (shorter than the prefixes below it) for ``cancel(sub)``.
    """
    if len(keys) <= size:
        yield prefix, False, len(keys)
        return
    prefix = _common_prefix(keys)  # at least ``prefix``: skip the characters every key shares
    groups: dict[str, list[str]] = {}
    exact = 0
    for k in keys:
        if len(k) == len(prefix):
            exact += 1
        else:
            groups.setdefault(k[: len(prefix) + 1], []).append(k)
    if exact:
        yield prefix, True, exact
    for sub in sorted(groups):
        yield from prefix_chunks(sub, groups[sub], size)


def _common_prefix(keys: list[str]) -> str:
    lo, hi = min(keys), max(keys)  # what the first and the last share, all share
    n = 0
    while n < len(lo) and lo[n] == hi[n]:
        n += 1
    return lo[:n]


@main.command()
@click.argument("queue")
@click.argument("key", required=False)
@click.option("--key-prefix", help="Every message whose key starts with this (asks first unless --yes).")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
@friendly
def cancel(ctx: click.Context, queue: str, key: str | None, key_prefix: str | None, yes: bool) -> None:
    """Delete a message, or every message under --key-prefix.

    With --key-prefix, the messages listed and confirmed are deleted in chunks of at most 1,000 (a DELETE
    of a longer prefix each, with a progress bar on stderr); one offered under such a prefix meanwhile goes too.
    """
    if (key is None) == (key_prefix is None):
        raise Fail("give a KEY or --key-prefix PREFIX (one of them)")
    if key is not None:
        _act(ctx, queue, key, lambda q: q.cancel(key), "cancelled")
        return
    assert key_prefix is not None
    with connect(ctx) as (engine, conn):
        keys = keys_under(conn, make_tables(ctx.obj["prefix"]), check_queue_name(queue), check_prefix(key_prefix))
        if not keys:
            note = _noted(unknown_queue_note(ctx, conn, queue))
            raise Fail(f"no message in queue {queue!r} has a key that starts with {key_prefix!r}{note}")
        conn.rollback()
        if not yes:
            click.confirm(
                f"cancel {len(keys)} message(s) of {queue!r} whose key starts with {key_prefix!r}?", abort=True
            )
        q, done = admin_queue(engine, ctx, queue), 0
        # A statement per chunk of at most CANCEL_CHUNK keys: the bar moves, and no statement locks many rows.
        with click.progressbar(length=len(keys), label="cancel", file=sys.stderr, show_pos=True) as bar:
            for sub, exact, n in prefix_chunks(key_prefix, keys, CANCEL_CHUNK):
                done += q.cancel(sub) if exact else q.cancel_prefix(sub)
                bar.update(n)
    click.echo(f"{queue}: {done} message(s) cancelled")


@main.command()
@click.argument("queue")
@click.argument("key")
@click.argument("payload")
@click.option("--at", "at_text", help="When it is due, ISO 8601 with an offset (default: now).")
@click.option("--in", "in_text", help="How long from now it is due, e.g. 90s, 5m, 1h30m.")
@click.option("--update", is_flag=True, help="Replace a message already under KEY.")
@click.pass_context
@friendly
def enqueue(
    ctx: click.Context, queue: str, key: str, payload: str, at_text: str | None, in_text: str | None, update: bool
) -> None:
    """Offer a message: PAYLOAD is JSON (a string needs its quotes: '"hello"'), @FILE for a file's, - for stdin's."""
    if at_text is not None and in_text is not None:
        raise Fail("give at most one of --at TIME or --in DURATION")
    text, where = read_payload(payload)
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise Fail(f"{where} is not JSON ({exc}): write a string with its quotes, e.g. '\"hello\"'") from None
    at: dt.datetime | dt.timedelta | None = None
    if at_text is not None:
        at = parse_time(at_text)
    elif in_text is not None:
        at = parse_duration(in_text)
    with connect(ctx) as (engine, conn):
        conn.rollback()
        outcome = DelayedQueue(engine, queue, table_prefix=ctx.obj["prefix"]).offer(key, value, at, update=update)
    click.echo(f"{queue} {key}: {outcome.value}")


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


def _act(ctx: click.Context, queue: str, key: str, action: Callable[[DelayedQueue], bool], done: str) -> None:
    with connect(ctx) as (engine, conn):
        conn.rollback()  # hold nothing while the action runs on its own connection
        if not action(admin_queue(engine, ctx, queue)):
            raise Fail(f"no message {key!r} in queue {queue!r}{_noted(unknown_queue_note(ctx, conn, queue))}")
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
            keys = _dead_keys(ctx, conn, queue, key, key_prefix, everything)
            if not keys:
                raise Fail(f"no dead letters match in queue {queue!r}{_noted(unknown_queue_note(ctx, conn, queue))}")
        if not yes:
            click.confirm(f"{verb} {len(keys)} dead letter key(s) of {queue!r}?", abort=True)
        engine = engines.create_engine(ctx.obj["url"], pool_size=1)
        q, done = admin_queue(engine, ctx, queue), 0
        try:
            with engines.read_bound(engine):
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
        click.echo(json.dumps(views, indent=2, default=json_value))
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
    from delayq.cron import schedule_views, uninstall

    check_queue_name(queue)
    with connect(ctx) as (engine, conn):
        views = schedule_views(engine, conn, make_tables(ctx.obj["prefix"]), queue=queue)
        if not any(v["name"] == name for v in views):
            known = ", ".join(repr(v["name"]) for v in views) or "none"
            raise Fail(f"no schedule {name!r} on queue {queue!r} (its schedules: {known})")
    if not yes:
        click.confirm(f"uninstall cron schedule {name!r} of queue {queue!r}?", abort=True)
    with connect(ctx) as (engine, conn):
        conn.rollback()
        deleted = uninstall(admin_queue(engine, ctx, queue), name)
    click.echo(f"{queue} {name}: uninstalled, {deleted} pending run(s) deleted")


# -- topics --------------------------------------------------------------------------------------------
main.add_command(topics)
