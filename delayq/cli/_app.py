"""The ``delayq`` command assembled: every command registered on ``main``, the topics' group included."""

from __future__ import annotations

import datetime as dt
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import click
import sqlalchemy as sa

from delayq import engines
from delayq.browse import State, list_messages
from delayq.cli import _messages, _setup, _stats, _worker  # noqa: F401  (each registers its commands on main)
from delayq.cli._common import Fail, connect, emit, friendly, json_value
from delayq.cli._root import _noted, admin_queue, main, parse_time, unknown_queue_note
from delayq.queue import check_queue_name
from delayq.schema import make_tables
from delayq.topics.cli import topics

# -- setup --------------------------------------------------------------------------------------------


# -- workers ------------------------------------------------------------------------------------------


# -- looking -------------------------------------------------------------------------------------------


# -- acting ---------------------------------------------------------------------------------------------


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
