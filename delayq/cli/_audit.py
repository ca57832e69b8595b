"""Who did what: ``delayq audit`` (the actions taken from the dashboard and the command line, newest first)."""

from __future__ import annotations

import dataclasses

import click

from delayq import audit
from delayq.cli._common import connect, emit, friendly
from delayq.cli._root import main
from delayq.schema import make_tables


@main.command(name="audit")
@click.option("--queue", help="Only the actions on this queue.")
@click.option("--action", help="Only this action (pause, limits, cancel, requeue-all, ...).")
@click.option("--actor", help="Only the actions of this user.")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, audit.MAX_PAGE), help="At most N.")
@click.option("--before", type=click.IntRange(min=1), help="Older than the entry with this id (the next page).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
@friendly
def audit_command(
    ctx: click.Context,
    queue: str | None,
    action: str | None,
    actor: str | None,
    limit: int,
    before: int | None,
    as_json: bool,
) -> None:
    """The actions taken from the dashboard and the command line, newest first: when (the database's time),
    who, from where (web, cli), what, on which queue, with what filter, how many messages it affected."""
    with connect(ctx) as (_, conn):
        found = audit.entries(
            conn, make_tables(ctx.obj["prefix"]), queue=queue, action=action, actor=actor, before=before, limit=limit
        )
    if as_json:
        emit([dataclasses.asdict(e) for e in found], True, [])
        return
    rows = [dataclasses.asdict(e) | {"at": f"{e.at:%Y-%m-%d %H:%M:%S}", "filter": e.filter or None} for e in found]
    emit(rows, False, ["id", "at", "actor", "source", "action", "queue", "filter", "count"])
    if len(found) == limit:
        click.echo(f"(more may be older: --before {found[-1].id})")
