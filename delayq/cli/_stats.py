"""Watching queues: ``delayq stats`` (counts by state) and ``delayq top`` (a live view)."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import click

from delayq import engines
from delayq.browse import queue_names
from delayq.cli._common import Fail, connect, emit, friendly
from delayq.cli._root import admin_queue, main
from delayq.errors import install_hint
from delayq.humanize import human
from delayq.queue import check_queue_name
from delayq.schema import make_tables
from delayq.tags import check_tag


@main.command()
@click.argument("queue", required=False)
@click.option("--tag", help="Count only the messages (and dead letters) carrying this tag.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--watch", is_flag=True, help="Refresh every --interval seconds until Ctrl-C.")
@click.option("--interval", default=2.0, show_default=True)
@click.option("--times", default=0, hidden=True, help="With --watch: stop after this many refreshes.")
@click.pass_context
@friendly
def stats(
    ctx: click.Context, queue: str | None, tag: str | None, as_json: bool, watch: bool, interval: float, times: int
) -> None:
    """Per queue: ready, scheduled, in flight (running now), expired locks, dead, kept completed and cancelled
    messages (shown where there are some), age of the oldest due message, paused, and its limits (concurrency,
    rate, group concurrency).

    Without QUEUE: every queue with messages, dead letters, a cron schedule, a pause or a limit (a drained queue
    with none of them is not known; name it to see its zeros). With --tag: the counts of the messages carrying
    the tag.
    """
    if tag is not None:
        check_tag(tag)
    shown = 0
    while True:
        with connect(ctx) as (engine, conn):
            # A named queue with nothing in it shows zeros: to monitoring, a drained queue is a queue.
            names = [check_queue_name(queue)] if queue else queue_names(conn, make_tables(ctx.obj["prefix"]))
            rows: list[dict[str, Any]] = []
            limits: list[str] = []
            for name in names:
                q = admin_queue(engine, ctx, name)
                s, flow = q.stats(tag=tag, using=conn), q.flow(using=conn)
                limits.append(flow.describe_limits())
                rows.append(
                    {
                        "queue": name,
                        "ready": s.ready,
                        "scheduled": s.scheduled,
                        "in_flight": s.in_flight,
                        "expired_locks": s.expired_locks,
                        "dead": s.dead,
                        "completed": s.completed,
                        "cancelled": s.cancelled,
                        "paused": flow.paused,
                        "priorities": flow.priorities,
                        "running": s.in_flight,
                        "concurrency_limit": flow.concurrency,
                        "rate_limit": flow.rate,
                        "rate_period_s": None if flow.rate_period is None else flow.rate_period.total_seconds(),
                        "grouped": flow.grouped,
                        "group_concurrency": flow.group_concurrency,
                        "oldest_due_age_s": None
                        if s.oldest_due_age is None
                        else round(s.oldest_due_age.total_seconds(), 1),
                    }
                )
        if watch and not as_json:
            click.clear()
            click.echo(dt.datetime.now().strftime("%H:%M:%S"))
        if not as_json:
            for r, limits_said in zip(rows, limits, strict=True):
                hidden_columns = ("priorities", "running", "concurrency_limit", "rate_limit", "rate_period_s")
                for hidden in (*hidden_columns, "grouped", "group_concurrency"):
                    r.pop(hidden)
                r["paused"] = "paused" if r["paused"] else ""
                r["limits"] = limits_said
                age = r.pop("oldest_due_age_s")
                r["oldest_due"] = None if age is None else human(dt.timedelta(seconds=age))
        columns = ["queue", "ready", "scheduled", "in_flight", "expired_locks", "dead", "oldest_due"]
        for kept in ("completed", "cancelled"):  # kept states, where a queue keeps them (retention)
            if any(r[kept] for r in rows):
                columns.insert(columns.index("oldest_due"), kept)
        for flow_column in ("paused", "limits"):  # where some queue is paused, or has a limit
            if any(r.get(flow_column) for r in rows):
                columns.append(flow_column)
        emit(rows, as_json, columns)
        shown += 1
        if not watch or (times and shown >= times):
            return
        time.sleep(interval)


@main.command()
@click.option("--interval", default=1.0, show_default=True, type=click.FloatRange(min=0.1), help="Seconds per refresh.")
@click.option("--queue", "queues", multiple=True, help="Only this queue (repeat for more).")
@click.option("--times", default=0, hidden=True, help="Stop after this many refreshes.")
@click.pass_context
@friendly
def top(ctx: click.Context, interval: float, queues: tuple[str, ...], times: int) -> None:
    """A live view: queues, rates, in flight, oldest due, recent failures with tracebacks (Ctrl-C ends)."""
    try:
        from rich.console import Console

        from delayq.top import Top, run
    except ImportError:
        raise Fail(f"delayq top needs rich: {install_hint('top')}") from None
    with connect(ctx):
        pass  # the tables are there (and a SQLite file is never created)
    engine = engines.create_engine(ctx.obj["url"])
    try:
        only = [check_queue_name(q) for q in queues] or None
        with engines.read_bound(engine):
            run(Top(engine, ctx.obj["prefix"], only=only), Console(), interval, times)
    except KeyboardInterrupt:
        pass
    finally:
        engine.dispose()
