"""delayq top, driven headless: snapshots of the queues, the rendered view (rich's recording console), the command."""

from __future__ import annotations

import datetime as dt
import io

import sqlalchemy as sa
from click.testing import CliRunner
from conftest import Backend
from rich.console import Console

from delayq import DelayedQueue
from delayq.cli import main
from delayq.top import Top, render, run


def upload_thumbnail(key: str) -> None:
    raise OSError(f"storage hiccup on {key}")


def failing(q: DelayedQueue, key: str, dead: bool) -> None:
    q.offer(key, {"k": key})
    d = q.try_poll()
    assert d is not None and d.key == key
    try:
        upload_thumbnail(key)
    except OSError as exc:
        assert (d.dead_letter(str(exc)) if dead else d.retry(dt.timedelta(hours=1), str(exc))) is True


def test_snapshots_count_states_flow_and_recent_failures(engine: sa.Engine, queue_name: str) -> None:
    q = DelayedQueue(engine, queue_name)
    failing(q, "img-1", dead=False)
    failing(q, "img-2", dead=True)
    q.offer_many([("a", 1, None), ("b", 2, None)])
    q.offer("later", 3, at=dt.timedelta(hours=1))
    top = Top(engine, only=[queue_name])
    first = top.snapshot()
    [row] = first.queues
    assert (row.stats.ready, row.stats.scheduled, row.stats.dead) == (2, 2, 1)
    assert row.arrived_per_s is None  # no rate before a second look
    assert [(f.key, f.dead, f.attempt) for f in first.failures] == [("img-2", True, 1), ("img-1", False, 1)]
    assert first.failures[0].traceback_tail[-1] == "OSError: storage hiccup on img-2"
    assert any("upload_thumbnail" in line for line in first.failures[0].traceback_tail)

    q.offer_many([(f"new-{i}", i, None) for i in range(3)])
    assert q.ack_many(q.try_poll_many(2)) == 2
    second = top.snapshot()
    [row] = second.queues
    assert row.arrived_per_s is not None and row.arrived_per_s > 0
    assert row.left_per_s is not None and row.left_per_s > 0

    out = Console(record=True, width=150, file=io.StringIO())
    out.print(render(second))
    text = out.export_text()
    assert queue_name in text and "recent failures" in text
    assert "dead" in text and "'img-2' attempt 1" in text and "OSError: storage hiccup on img-2" in text


def test_the_live_view_refreshes_on_a_terminal(backend: Backend, queue_name: str) -> None:
    DelayedQueue(backend.engine, queue_name).offer("x", 1)
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=120)
    ticks: list[float] = []
    run(Top(backend.engine, only=[queue_name]), console, interval=1.0, times=3, sleep=ticks.append)
    assert ticks == [1.0, 1.0] and queue_name in screen.getvalue()


def test_delayq_top_as_a_command(backend: Backend, queue_name: str) -> None:
    DelayedQueue(backend.engine, queue_name).offer("x", 1)
    args = ["--url", backend.url, "top", "--queue", queue_name, "--times", "2", "--interval", "0.1"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert result.output.count("delayq top") == 2 and queue_name in result.output
