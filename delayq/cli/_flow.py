"""Flow control from the command line: ``delayq pause QUEUE`` and ``delayq resume QUEUE``."""

from __future__ import annotations

import click

from delayq.cli._common import connect, friendly
from delayq.cli._root import admin_queue, main
from delayq.queue import check_queue_name


@main.command()
@click.argument("queue")
@click.pass_context
@friendly
def pause(ctx: click.Context, queue: str) -> None:
    """Pause QUEUE: workers start none of its messages (within their flow refresh, 1 s by default) until
    ``delayq resume``; offers are still stored, and messages already running run to their end."""
    with connect(ctx) as (engine, conn):
        conn.rollback()
        admin_queue(engine, ctx, check_queue_name(queue)).pause()
    click.echo(f"{queue}: paused")


@main.command()
@click.argument("queue")
@click.pass_context
@friendly
def resume(ctx: click.Context, queue: str) -> None:
    """Resume QUEUE after ``delayq pause``: workers take its messages again at their next claim."""
    with connect(ctx) as (engine, conn):
        conn.rollback()
        admin_queue(engine, ctx, check_queue_name(queue)).resume()
    click.echo(f"{queue}: resumed")
