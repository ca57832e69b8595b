"""Flow control from the command line: ``delayq pause QUEUE``, ``delayq resume QUEUE``, ``delayq limit QUEUE``."""

from __future__ import annotations

import click

from delayq.cli._common import Fail, audited, connect, friendly
from delayq.cli._root import admin_queue, main, parse_duration
from delayq.humanize import human
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
    audited(ctx, "pause", queue)


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
    audited(ctx, "resume", queue)


def _limit(text: str | None, what: str) -> int | None:
    """``none`` (no limit) or a positive integer."""
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
@click.option("--group-concurrency", type=click.IntRange(min=1), help="At most N of one group running at once.")
@click.pass_context
@friendly
def limit(
    ctx: click.Context,
    queue: str,
    concurrency: str | None,
    rate: str | None,
    per_text: str,
    group_concurrency: int | None,
) -> None:
    """Set QUEUE's concurrency and rate limits, stored in the database for every worker (see ``delayq stats``)."""
    if concurrency is None and rate is None and group_concurrency is None:
        raise Fail("give --concurrency N, --rate N (each may be 'none') and/or --group-concurrency N")
    per = parse_duration(per_text)
    with connect(ctx) as (engine, conn):
        conn.rollback()
        q = admin_queue(engine, ctx, check_queue_name(queue))
        if concurrency is not None:
            q.set_concurrency_limit(_limit(concurrency, "--concurrency"))
        if rate is not None:
            q.set_rate_limit(_limit(rate, "--rate"), per)
        if group_concurrency is not None:
            q.set_group_concurrency(group_concurrency)
        flow = q.flow()
    shown_rate = (
        "none" if flow.rate is None or flow.rate_period is None else f"{flow.rate} per {human(flow.rate_period)}"
    )
    limits = f"concurrency {flow.concurrency or 'none'}, rate {shown_rate}"
    click.echo(f"{queue}: {limits}, group concurrency {flow.group_concurrency}")
    audited(ctx, "limits", queue, concurrency=concurrency, rate=rate, per=per_text, group_concurrency=group_concurrency)
