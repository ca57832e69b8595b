"""The cron schedules: ``delayq cron ls`` and ``delayq cron uninstall``."""

from __future__ import annotations

import json

import click

from delayq.cli._common import Fail, connect, emit, friendly, json_value
from delayq.cli._root import admin_queue, main, parse_time
from delayq.queue import check_queue_name
from delayq.schema import make_tables


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

    if queue is not None:
        check_queue_name(queue)
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
