"""The worker registry: ``delayq workers`` (running, stopped and gone workers, from their heartbeats)."""

from __future__ import annotations

import click

from delayq.browse import GONE_AFTER, list_workers
from delayq.cli._common import connect, emit, friendly
from delayq.cli._root import main
from delayq.humanize import human
from delayq.schema import make_tables


@main.command()
@click.option("--all", "show_all", is_flag=True, help="Stopped and gone workers too (kept for an hour).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
@friendly
def workers(ctx: click.Context, show_all: bool, as_json: bool) -> None:
    """Workers from their heartbeats: host, pid, what they serve, slots in use, since when.

    Each ``Worker``/``AsyncWorker`` beats every 10 s; one silent for longer than a minute (crashed, killed,
    frozen, cut off) shows as gone. Without --all, only running ones are listed.
    """
    with connect(ctx) as (_, conn):
        found = list_workers(conn, make_tables(ctx.obj["prefix"]))
    shown = [w for w in found if show_all or w.state == "running"]
    if as_json:
        emit([w.as_dict() for w in shown], True, [])
        return
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
