"""The queue history on the dashboard: a chart (``_history.html``: ``/history``, the fragment the overview and a
queue's page load) and its data (``/history.json``), both from ``browse.queue_history``: what the workers
processed, failed and dead-lettered per minute over the last day, as stored in the database, so a restarted
dashboard draws the same. The chart is an SVG drawn here (stacked bars, axes, hover values as ``<title>``s): no
script draws it, the page's script only reloads the fragment."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from delayq.browse import HISTORY_SPAN, QueueHistory, queue_history
from delayq.errors import InvalidInputError
from delayq.queue import check_queue_name
from delayq.web._reads import Where
from delayq.web._render import Dashboard, json_response

MAX_HOURS = int(HISTORY_SPAN.total_seconds() // 3600)
BUCKETS = (1, 2, 5, 10, 15, 30, 60)
"""Minutes a bar may stand for: the fewest that keep the bars at most ``MAX_BARS``."""
MAX_BARS = 300
WIDTH, HEIGHT = 760, 190
LEFT, RIGHT, TOP, BOTTOM = 52, 10, 12, 26
"""The plot's margins in the SVG's units: the y axis's labels at the left, the x axis's below."""
OUTCOMES = (("processed", "processed"), ("failed", "failed"), ("dead_lettered", "dead-lettered"))


def _asked(request: Request) -> tuple[str | None, int]:
    """The queue (absent: every queue) and the hours (1 to 24, 24 by default) asked for; one line when bad."""
    queue = request.query_params.get("queue")
    text = request.query_params.get("hours", str(MAX_HOURS))
    if not (len(text) <= 2 and text.isascii() and text.isdecimal() and 1 <= int(text) <= MAX_HOURS):
        raise InvalidInputError(f"hours must be a whole number from 1 to {MAX_HOURS}")
    return None if queue is None else check_queue_name(queue), int(text)


def _read(where: Where, queue: str | None, hours: int) -> QueueHistory:
    with where.engine.connect() as conn:
        return queue_history(conn, where.tables, queue, span=dt.timedelta(hours=hours))


async def history_json(dash: Dashboard, request: Request) -> Response:
    queue, hours = _asked(request)
    found = await run_in_threadpool(_read, dash.where, queue, hours)
    return json_response(found.as_dict() | {"hours": hours})


async def history_fragment(dash: Dashboard, request: Request) -> Response:
    queue, hours = _asked(request)
    found = await run_in_threadpool(_read, dash.where, queue, hours)
    return dash.render(request, "_history.html", history_queue=queue, history_hours=hours, chart=chart(found, hours))


@dataclass(frozen=True)
class Bar:
    """One bar: the minutes it stands for, its stacked parts ``(outcome, y, height)``, and its hover text."""

    x: float
    width: float
    parts: list[tuple[str, float, float]]
    title: str


def _ceiling(n: int) -> int:
    """The y axis's top: 1, 2 or 5 times a power of ten, at least ``n`` (and 1)."""
    if n <= 1:
        return 1
    power = int(10 ** (len(str(n)) - 1))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= n)


def _label(start: dt.datetime, minutes: int) -> str:
    if minutes == 1:
        return f"{start:%H:%M}"
    return f"{start:%H:%M} to {start + dt.timedelta(minutes=minutes):%H:%M}"


def chart(found: QueueHistory, hours: int) -> dict[str, Any]:
    """What ``_history.html`` draws: bars of ``bucket`` minutes (the counts summed), axes and their labels."""
    points = found.dense()
    bucket = next((b for b in BUCKETS if len(points) / b <= MAX_BARS), BUCKETS[-1])
    groups = [points[i : i + bucket] for i in range(0, len(points), bucket)]
    sums = [(g[0].minute, [sum(getattr(p, name) for p in g) for name, _ in OUTCOMES]) for g in groups]
    top = _ceiling(max((sum(counts) for _, counts in sums), default=0))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    step = plot_w / max(len(groups), 1)
    bars = []
    for i, (start, counts) in enumerate(sums):
        if not any(counts):
            continue
        y, parts = float(TOP + plot_h), []
        for (name, _), n in zip(OUTCOMES, counts, strict=True):
            if n:
                h = n / top * plot_h
                y -= h
                parts.append((name, round(y, 2), round(h, 2)))
        shown = ", ".join(f"{label} {n}" for (_, label), n in zip(OUTCOMES, counts, strict=True))
        bars.append(
            Bar(round(LEFT + i * step, 2), round(max(step - 0.6, 0.6), 2), parts, f"{_label(start, bucket)}: {shown}")
        )
    y_ticks = [(round(TOP + plot_h - v / top * plot_h, 2), f"{v:,}") for v in sorted({0, top // 2, top})]
    every = 15 if hours <= 2 else 60 if hours <= 6 else 180
    x_ticks = [
        (round(LEFT + i / bucket * step, 2), f"{p.minute:%H:%M}")
        for i, p in enumerate(points)
        if (p.minute.hour * 60 + p.minute.minute) % every == 0
    ]
    processed, failed, dead = found.totals()
    return {
        "width": WIDTH,
        "height": HEIGHT,
        "left": LEFT,
        "top": TOP,
        "bottom": TOP + plot_h,
        "right": WIDTH - RIGHT,
        "bars": bars,
        "y_ticks": y_ticks,
        "x_ticks": x_ticks,
        "unit": f"messages per {bucket} min" if bucket > 1 else "messages per minute",
        "hours": hours,
        "now": found.now,
        "totals": {"processed": processed, "failed": failed, "dead-lettered": dead},
    }
