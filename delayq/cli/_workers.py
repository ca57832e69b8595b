"""The worker registry: ``delayq workers`` (running, stopped and gone workers, from their heartbeats; with
``--running``, what each one runs now) and ``delayq history`` (what the workers processed, failed and
dead-lettered per minute, which they write with their heartbeats)."""

from __future__ import annotations

import datetime as dt
import json

import click

from delayq.browse import GONE_AFTER, HISTORY_SPAN, list_workers, queue_history
from delayq.cli._common import Fail, connect, emit, friendly, json_value
from delayq.cli._root import main, parse_duration
from delayq.humanize import human
from delayq.queue import check_queue_name
from delayq.schema import make_tables


@main.command()
@click.option("--all", "show_all", is_flag=True, help="Stopped and gone workers too (kept for an hour).")
@click.option("--running", "show_running", is_flag=True, help="What each worker's handlers run: one row each.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (with what each worker runs, under running).")
@click.pass_context
@friendly
def workers(ctx: click.Context, show_all: bool, show_running: bool, as_json: bool) -> None:
    """Workers from their heartbeats: host, pid, what they serve, slots in use, since when.

    Each ``Worker``/``AsyncWorker`` beats every 10 s; one silent for longer than a minute (crashed, killed,
    frozen, cut off) shows as gone. Without --all, only running ones are listed. With --running, one row per
    delivery a worker's handler runs (as of its last heartbeat): its queue (``topic/group`` for a topic
    handler), key, attempt and how long it has run, the longest first.
    """
    with connect(ctx) as (_, conn):
        found = list_workers(conn, make_tables(ctx.obj["prefix"]))
    shown = [w for w in found if show_all or w.state == "running"]
    if as_json:
        emit([w.as_dict() for w in shown], True, [])
        return
    if show_running:
        jobs = [(w, r) for w in shown for r in w.running]
        jobs.sort(key=lambda wr: -wr[1].running_for)
        rows = [
            {
                "worker": f"{w.host}:{w.pid}",
                "queue": r.queue,
                "key": r.key,
                "attempt": r.attempt,
                "running for": human(r.running_for),
                "state": w.state,
            }
            for w, r in jobs
        ]
        emit(rows, False, ["worker", "queue", "key", "attempt", "running for", "state"])
        busy = sum(w.slots_in_use for w in shown)
        if busy > len(rows):
            click.echo(f"({busy - len(rows)} more running: a heartbeat lists the longest-running, up to 16 KB)")
    else:
        rows = [
            {
                "host": w.host,
                "pid": w.pid,
                "state": w.state,
                "serves": ", ".join([*w.queues, *w.topics]),
                "slots": f"{w.slots_in_use}/{w.slots}",
                "handled": w.handled,
                "since": f"{w.started_at:%Y-%m-%d %H:%M:%S} ({human(w.since)})",
                "heartbeat": f"{human(w.last_heartbeat)} ago",
                "driver": w.driver,
            }
            for w in shown
        ]
        emit(rows, False, ["host", "pid", "state", "serves", "slots", "handled", "since", "heartbeat", "driver"])
    hidden = len(found) - len(shown)
    if hidden:
        click.echo(f"({hidden} stopped or gone — silent for over {human(GONE_AFTER)} — not shown: --all)")


@main.command()
@click.argument("queue", required=False)
@click.option("--last", "last_text", default="1h", show_default=True, help="How far back: from 1m to 24h.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (the dashboard's /history.json).")
@click.pass_context
@friendly
def history(ctx: click.Context, queue: str | None, last_text: str, as_json: bool) -> None:
    """What the workers processed, failed (to be retried) and dead-lettered, per minute, of QUEUE (without it:
    of every queue, summed), over the last hour (--last: up to 24h, what is kept).

    Workers count outcomes as they record them and write the counts with their heartbeats (every 10 s, and at
    a clean stop), per queue and minute of database time; minutes without any are not printed.
    """
    span = parse_duration(last_text)
    if not dt.timedelta(minutes=1) <= span <= HISTORY_SPAN:
        kept = int(HISTORY_SPAN.total_seconds() // 3600)
        raise Fail(f"--last {last_text}: give from 1m to {kept}h (the history kept)")
    name = check_queue_name(queue) if queue is not None else None
    with connect(ctx) as (_, conn):
        found = queue_history(conn, make_tables(ctx.obj["prefix"]), name, span=span)
    if as_json:
        click.echo(json.dumps(found.as_dict(), indent=2, default=json_value))
        return
    rows = [
        {
            "minute": f"{p.minute:%Y-%m-%d %H:%M}",
            "processed": p.processed,
            "failed": p.failed,
            "dead-lettered": p.dead_lettered,
        }
        for p in found.points
    ]
    emit(rows, False, ["minute", "processed", "failed", "dead-lettered"])
    processed, failed, dead = found.totals()
    click.echo(
        f"total since {found.start:%Y-%m-%d %H:%M} UTC ({human(span)}): "
        f"processed {processed}, failed {failed}, dead-lettered {dead}"
    )
