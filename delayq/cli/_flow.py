"""Flow control from the command line: ``delayq pause QUEUE``, ``delayq resume QUEUE``, ``delayq limit QUEUE``."""

from __future__ import annotations

import click
import sqlalchemy as sa

from delayq.browse import has_flow_settings, queue_names
from delayq.cli._common import Fail, audited, connect, friendly
from delayq.cli._root import admin_queue, known_list, main, parse_duration
from delayq.humanize import human
from delayq.queue import DelayedQueue, check_queue_name
from delayq.schema import make_tables

CREATE = click.option("--create", is_flag=True, help="Set it even for a queue the database knows nothing of.")


def _flow_queue(engine: sa.Engine, conn: sa.Connection, ctx: click.Context, name: str, create: bool) -> DelayedQueue:
    """The queue to set, unless the database knows nothing of it (no messages, dead letters, kept messages,
    cron schedule or flow row) and ``--create`` was not given: then a ``Fail``, so a typo never succeeds."""
    if not create:
        tables = make_tables(ctx.obj["prefix"])
        names = queue_names(conn, tables)
        if name not in names and not has_flow_settings(conn, tables, name):
            raise Fail(
                f"no queue {name!r}: it has no messages, dead letters, cron schedule or flow settings (queues that "
                f"have: {known_list(names)}); check the name, or give --create to set it anyway"
            )
    conn.rollback()  # hold nothing while the setting is written on its own connection
    return admin_queue(engine, ctx, name)


@main.command()
@click.argument("queue")
@CREATE
@click.pass_context
@friendly
def pause(ctx: click.Context, queue: str, create: bool) -> None:
    """Pause QUEUE: workers start none of its messages (within their flow refresh, 1 s by default) until
    ``delayq resume``; offers are still stored, and messages already running run to their end."""
    with connect(ctx) as (engine, conn):
        _flow_queue(engine, conn, ctx, check_queue_name(queue), create).pause()
    click.echo(f"{queue}: paused")
    audited(ctx, "pause", queue)


@main.command()
@click.argument("queue")
@CREATE
@click.pass_context
@friendly
def resume(ctx: click.Context, queue: str, create: bool) -> None:
    """Resume QUEUE after ``delayq pause``: workers take its messages again at their next claim."""
    with connect(ctx) as (engine, conn):
        _flow_queue(engine, conn, ctx, check_queue_name(queue), create).resume()
    click.echo(f"{queue}: resumed")
    audited(ctx, "resume", queue)


def _limit(text: str | None, what: str) -> int | None:
    """``none`` (None) or a positive integer."""
    if text is None or text.strip().lower() == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        raise Fail(f"{what} must be a positive integer or 'none', got {text!r}") from None
    if value < 1:
        raise Fail(f"{what} must be a positive integer or 'none', got {text!r}")
    return value


@main.command()
@click.argument("queue")
@click.option(
    "--concurrency", help="At most N of QUEUE's messages running at once across all workers ('none': no limit)."
)
@click.option("--rate", help="At most N claims per --per across all workers ('none': no limit).")
@click.option("--per", "per_text", default="1s", show_default=True, help="The rate's period, e.g. 1s, 1m.")
@click.option("--group-concurrency", help="At most N of one group running at once ('none': the default, 1).")
@CREATE
@click.pass_context
@friendly
def limit(
    ctx: click.Context,
    queue: str,
    concurrency: str | None,
    rate: str | None,
    per_text: str,
    group_concurrency: str | None,
    create: bool,
) -> None:
    """Set QUEUE's concurrency and rate limits, stored in the database for every worker (see ``delayq stats``)."""
    if concurrency is None and rate is None and group_concurrency is None:
        raise Fail("give --concurrency N, --rate N and/or --group-concurrency N (each may be 'none')")
    per = parse_duration(per_text)
    limits = {
        option: _limit(text, f"--{option.replace('_', '-')}")
        for option, text in (("concurrency", concurrency), ("rate", rate), ("group_concurrency", group_concurrency))
        if text is not None
    }
    with connect(ctx) as (engine, conn):
        q = _flow_queue(engine, conn, ctx, check_queue_name(queue), create)
        if "concurrency" in limits:
            q.set_concurrency_limit(limits["concurrency"])
        if "rate" in limits:
            q.set_rate_limit(limits["rate"], per)
        if "group_concurrency" in limits:
            q.set_group_concurrency(limits["group_concurrency"])
        flow = q.flow()
    shown_rate = (
        "none" if flow.rate is None or flow.rate_period is None else f"{flow.rate} per {human(flow.rate_period)}"
    )
    limits_shown = f"concurrency {flow.concurrency or 'none'}, rate {shown_rate}"
    click.echo(f"{queue}: {limits_shown}, group concurrency {flow.group_concurrency}")
    audited(ctx, "limits", queue, concurrency=concurrency, rate=rate, per=per_text, group_concurrency=group_concurrency)
