"""What ``delayq cron ls`` shows: every recorded schedule with its next and last runs, judged at now."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from delayq.clock import from_ms, to_ms
from delayq.cron.schedule import Schedule, namespace_bounds, parse_run_key, run_key_ms, run_prefix
from delayq.queue import _views
from delayq.schema import Tables


def schedule_views(
    engine: sa.Engine, conn: Connection, tables: Tables, *, queue: str | None = None, now: dt.datetime | None = None
) -> list[dict[str, Any]]:
    """Every recorded schedule (of ``queue``, or all), as ``delayq cron ls`` shows it, judged at ``now``
    (the database's time by default): definition, next runs (future ones only), last run and its state,
    who refreshed it when, and ``stalled`` when nobody did for longer than its look-ahead window."""
    s = tables.schedules
    now_ms = to_ms(now) if now is not None else _views.database_now_ms(conn)
    records = sa.select(s).order_by(s.c.queue, s.c.name)
    if queue is not None:
        records = records.where(s.c.queue == queue)
    runs: dict[tuple[str, str], dict[int, Any]] = {}
    for row in _views.rows_under(conn, tables, namespace_bounds(), queue):
        parsed = parse_run_key(row.key)
        if parsed is not None:
            runs.setdefault((row.queue, run_prefix(parsed[0], parsed[1])), {})[parsed[2]] = row
    views = []
    for record in conn.execute(records).all():
        definition = json.loads(record.definition)
        schedule = Schedule.from_definition(record.name, definition)
        mine = runs.get((record.queue, run_prefix(record.name, record.config_hash)), {})
        future = sorted(due for due in mine if due > now_ms)
        until = record.installed_until if record.installed_until is not None else record.refreshed_at
        last_run = None
        before = schedule.run_before(from_ms(min(now_ms, until)))
        if before is not None and to_ms(before) > record.installed_at:
            due = to_ms(before)
            key = run_key_ms(record.name, record.config_hash, due)
            run = mine.get(due)
            if run is None:
                state = "dead" if _views.dead_count(conn, tables, record.queue, key) else "done"
            elif run.lock_token is not None and run.scheduled_at > now_ms:
                state = "in flight"
            else:
                state = "retrying" if run.attempts else "due"
            last_run = {"due": from_ms(due).isoformat(), "state": state, "key": key}
        views.append(
            {
                "queue": record.queue,
                "name": record.name,
                "prefix": record.name,
                "config": record.config_hash,
                "definition": definition,
                "summary": _summary(schedule),
                "next_run": from_ms(future[0]).isoformat() if future else None,
                "next_due": [from_ms(due).isoformat() for due in future[:3]],
                "last_run": last_run,
                "installed_at": from_ms(record.installed_at).isoformat(),
                "refreshed_at": from_ms(record.refreshed_at).isoformat(),
                "refreshed_by": record.refreshed_by,
                "installed_until": from_ms(until).isoformat(),
                "lookahead_s": max(0, until - record.refreshed_at) / 1000,
                "stalled": now_ms - record.refreshed_at > max(0, until - record.refreshed_at),
            }
        )
    return views


def _summary(schedule: Schedule) -> str:
    ahead = schedule.ahead if isinstance(schedule.ahead, int) else f"{schedule.ahead}"
    if schedule.every is not None:
        return f"every {schedule.every} (ahead {ahead})"
    if schedule.kind == "daily":
        times = ", ".join(f"{int(e.split()[1]):02d}:{int(e.split()[0]):02d}" for e in schedule.expressions)
        return f"daily at {times} {schedule.tz} (ahead {ahead})"
    return f"cron {' | '.join(schedule.expressions)} {schedule.tz} (ahead {ahead})"
