"""What flow control sets, shown where an operator looks (issue 42, item 3): a message's priority and group on
``Message`` (``get``, the listings), ``Delivery``, ``delayq show``, ``ls --json`` and the dashboard's message page;
each queue's limits, pause and running count in ``delayq stats`` and the overview, a paused or limited queue
listed with nothing in it; and the message page of a kept (completed, cancelled, dead) job. Every backend; the
queue's own reads with both APIs."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import re
import socket
import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from conftest import Backend, make_async_engine

from delayq import DelayedQueue, Delivery, Handler, Worker
from delayq.browse import State, database_now, list_messages
from delayq.cli import main
from delayq.runtime import _registry
from delayq.schema import make_tables
from delayq.web import app

with warnings.catch_warnings():  # (Starlette 1.x prefers httpx2 under its TestClient; httpx works)
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

HOUR = dt.timedelta(hours=1)
BOTH_APIS = pytest.mark.parametrize("api", ["sync", "async"], indirect=True)


def flow_of(d: Any) -> tuple[str, int, str | None]:
    return d.key, d.priority, d.group


# -- priority and group on deliveries and messages --------------------------------------------------------
@BOTH_APIS
def test_a_delivery_carries_its_priority_and_group_on_every_claim_path(make_queue: Callable[..., DelayedQueue]) -> None:
    """The plain claim (a claimer whose cached flow knows no priority yet), the claim by priority level and the
    grouped claim each hand the handler the message's priority and group."""
    producer = make_queue()
    consumer = make_queue(flow_refresh=HOUR)  # (its cached flow state stays "no priorities, no groups")
    assert consumer.try_poll() is None
    producer.offer("plain", 1, priority=7, group="customer-1")
    producer.offer("none", 2, at=dt.timedelta(seconds=-1))
    assert sorted(flow_of(d) for d in consumer.try_poll_many(5)) == [("none", 0, None), ("plain", 7, "customer-1")]

    by_level = make_queue(name=f"{producer.name}-levels")
    by_level.offer("low", 1, priority=-3)
    by_level.offer("high", 2, priority=4)
    assert [flow_of(d) for d in by_level.try_poll_many(5)] == [("high", 4, None), ("low", -3, None)]

    grouped = make_queue(name=f"{producer.name}-groups")
    grouped.offer("g1", 1, group="a", priority=2)
    grouped.offer("g2", 2, group="a")
    grouped.offer("solo", 3)
    assert [flow_of(d) for d in grouped.try_poll_many(5)] == [("g1", 2, "a"), ("solo", 0, None)]


@BOTH_APIS
def test_get_shows_a_messages_priority_and_group_live_and_once_kept(
    make_queue: Callable[..., DelayedQueue],
) -> None:
    q = make_queue(retention=HOUR)
    q.offer("job", {"n": 1}, priority=5, group="customer-9")
    q.offer("plain", {"n": 2})
    live, plain = q.get("job"), q.get("plain")
    assert live is not None and (live.priority, live.group) == (5, "customer-9")
    assert plain is not None and (plain.priority, plain.group) == (0, None)
    [d] = [d for d in q.try_poll_many(2) if d.key == "job"]
    running = q.get("job")
    assert running is not None and (running.state, running.priority, running.group) == ("running", 5, "customer-9")
    assert d.ack(result="done")
    kept = q.get("job")
    # (the finished rows and dead letters record them: delayq_0013)
    assert kept is not None and (kept.state, kept.priority, kept.group) == ("completed", 5, "customer-9")


# -- limits, pause and running counts where the queue is shown ---------------------------------------------
def flow_queues(engine: sa.Engine, base: str) -> dict[str, DelayedQueue]:
    """Queues named after ``base``: one paused, one limited, one with a group concurrency, one paused and resumed
    (none with messages), and one with a concurrency limit and two of its three messages running."""
    qs = {s: DelayedQueue(engine, f"{base}-{s}") for s in ("paused", "limited", "groups", "resumed", "busy")}
    qs["paused"].pause()
    qs["limited"].set_concurrency_limit(3)
    qs["limited"].set_rate_limit(10, dt.timedelta(minutes=1))
    qs["groups"].set_group_concurrency(2)
    qs["resumed"].pause()
    qs["resumed"].resume()
    qs["busy"].offer_many([(f"k{i}", i, None) for i in range(3)])
    qs["busy"].set_concurrency_limit(2)
    assert len(qs["busy"].try_poll_many(3)) == 2
    return qs


def test_stats_lists_a_paused_or_limited_queue_with_nothing_in_it_and_shows_limits_pause_and_running(
    backend: Backend, queue_name: str
) -> None:
    qs = flow_queues(backend.engine, queue_name)
    runner = CliRunner()
    listed = runner.invoke(main, ["--url", backend.url, "stats", "--json"])
    assert listed.exit_code == 0, listed.output
    rows = {r["queue"]: r for r in json.loads(listed.output) if r["queue"].startswith(queue_name)}
    assert sorted(rows) == sorted(qs[s].name for s in ("paused", "limited", "groups", "busy"))  # not "resumed"
    paused, limited, groups, busy = (rows[qs[s].name] for s in ("paused", "limited", "groups", "busy"))
    assert (paused["paused"], paused["ready"], paused["concurrency_limit"]) == (True, 0, None)
    assert (limited["concurrency_limit"], limited["rate_limit"], limited["rate_period_s"]) == (3, 10, 60.0)
    assert groups["group_concurrency"] == 2
    assert (busy["running"], busy["in_flight"], busy["ready"], busy["concurrency_limit"]) == (2, 2, 1, 2)

    table = runner.invoke(main, ["--url", backend.url, "stats"])
    assert table.exit_code == 0, table.output
    header, *lines = table.output.splitlines()
    assert header.split()[-2:] == ["PAUSED", "LIMITS"]
    shown = {line.split()[0]: line for line in lines}
    assert shown[qs["paused"].name].rstrip().endswith("paused")
    assert shown[qs["limited"].name].rstrip().endswith("concurrency 3, rate 10/1m 00s")
    assert shown[qs["groups"].name].rstrip().endswith("group concurrency 2")
    busy_cells = shown[qs["busy"].name].split()
    assert busy_cells[1:4] == ["1", "0", "2"] and shown[qs["busy"].name].rstrip().endswith("concurrency 2")


def test_the_overview_lists_a_paused_or_limited_queue_with_nothing_in_it_and_shows_limits_and_running(
    backend: Backend, queue_name: str
) -> None:
    qs = flow_queues(backend.engine, queue_name)
    c = TestClient(app(backend.engine))
    panel = {r["queue"]: r for r in c.get("/api/overview").json()["queues"] if r["queue"].startswith(queue_name)}
    assert sorted(panel) == sorted(qs[s].name for s in ("paused", "limited", "groups", "busy"))
    assert (panel[qs["paused"].name]["paused"], panel[qs["paused"].name]["limits"]) == (True, "-")
    assert panel[qs["limited"].name]["limits"] == "concurrency 3, rate 10/1m 00s"
    assert panel[qs["groups"].name]["limits"] == "group concurrency 2"
    busy = panel[qs["busy"].name]
    assert (busy["in_flight"], busy["ready"], busy["limits"]) == (2, 1, "concurrency 2")
    page = c.get("/").text
    row = re.search(rf'<tr data-queue="{qs["limited"].name}">.*?</tr>', page, re.S)
    assert row is not None and "concurrency 3, rate 10/1m 00s" in row.group(0)
    row = re.search(rf'<tr data-queue="{qs["paused"].name}">.*?</tr>', page, re.S)
    assert row is not None and re.search(r'data-flag="paused"\s*>paused<', row.group(0))


# -- the message page of a kept job --------------------------------------------------------------------------
def render_thumbnail(key: str) -> None:
    raise OSError(f"renderer crashed on {key}")


def field(page: str, name: str) -> str:
    """The text of the message page's fact ``data-field=name``."""
    found = re.search(rf'data-field="{name}">(.*?)</dd>', page, re.S)
    assert found is not None, f"no {name} on the page"
    return re.sub(r"<[^>]+>", "", found.group(1)).strip()


def test_the_message_page_shows_a_completed_job_its_result_duration_attempts_tags_priority_and_group(
    backend: Backend, queue_name: str
) -> None:
    q = DelayedQueue(backend.engine, queue_name, retention=HOUR)
    q.offer("job", {"n": 1}, priority=5, group="customer-7", tags=["billing"])
    c = TestClient(app(backend.engine))
    live = c.get("/message", params={"queue": queue_name, "key": "job"}).text
    assert (field(live, "priority"), field(live, "group"), field(live, "tags")) == ("5", "customer-7", "billing")
    first = q.try_poll()
    assert first is not None
    try:
        render_thumbnail("job")
    except OSError as exc:
        assert first.retry(error=str(exc))
    second = q.try_poll()
    assert second is not None and second.ack(result={"sum": 3}, duration=dt.timedelta(milliseconds=1500))

    page = c.get("/message", params={"queue": queue_name, "key": "job"})
    assert page.status_code == 200, page.text
    text = page.text
    assert 'class="state completed"' in text
    assert "&#34;sum&#34;: 3" in text  # the result, pretty-printed and escaped
    assert field(text, "duration") == "1.5s" and field(text, "finished_at").startswith("20")
    assert "renderer crashed on job" in text and "render_thumbnail" in text  # attempt 1's traceback
    assert field(text, "tags") == "billing"
    assert (field(text, "priority"), field(text, "group")) == ("5", "customer-7")  # (kept with it: delayq_0013)
    assert field(text, "worker").startswith("none recorded")  # (acked by hand, outside a worker)


def test_the_message_page_shows_a_cancelled_job_and_the_latest_of_a_dead_letter_and_a_kept_record(
    backend: Backend, queue_name: str
) -> None:
    q = DelayedQueue(backend.engine, queue_name)
    q.offer("stop", {"n": 1}, tags=["eu"])
    held = q.try_poll()
    assert held is not None and q.cancel_job("stop")  # a running job's cancel is kept
    c = TestClient(app(backend.engine, actions=True))
    c.get("/cron")  # (sets the CSRF cookie)
    cancelled = c.get("/message", params={"queue": queue_name, "key": "stop"})
    assert cancelled.status_code == 200 and 'class="state cancelled"' in cancelled.text
    assert field(cancelled.text, "tags") == "eu" and 'data-action="requeue"' not in cancelled.text

    q.offer("stop", {"n": 2})  # offered again under the key, then dead-lettered: the newer record is shown
    again = q.try_poll()
    assert again is not None and again.dead_letter("gave up")
    dead = c.get("/message", params={"queue": queue_name, "key": "stop"}).text
    assert 'class="state dead"' in dead and "gave up" in dead and "&#34;n&#34;: 2" in dead
    assert "and 1 more kept record" in dead and 'data-action="requeue"' in dead
    missing = c.get("/message", params={"queue": queue_name, "key": "never"})
    assert missing.status_code == 404 and "never offered" in missing.text


def test_the_message_page_of_an_in_flight_job_names_the_worker_running_it(
    backend: Backend, queue_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_registry, "BEAT", 0.0)  # (a beat whenever one is asked for)
    started, release = threading.Event(), threading.Event()

    class Blocking(Handler):
        queue = queue_name

        def handle(self, delivery: Delivery) -> None:
            started.set()
            release.wait(30)

    worker = Worker(backend.engine, [Blocking()], concurrency=2, poll_interval=dt.timedelta(milliseconds=20))
    DelayedQueue(backend.engine, queue_name).offer("busy", 1, priority=3)
    worker.start()
    try:
        assert started.wait(30)
        worker._core.registry.beat(1, 0)  # (what the heartbeat loop writes: the handler runs "busy")
        page = TestClient(app(backend.engine)).get("/message", params={"queue": queue_name, "key": "busy"}).text
        assert 'class="state in-flight"' in page and field(page, "priority") == "3"
        assert field(page, "worker").startswith(f"{socket.gethostname()[:200]} pid {os.getpid()}")
    finally:
        release.set()
        assert worker.stop()


def test_listings_ls_json_and_show_carry_a_live_messages_priority_and_group(backend: Backend, queue_name: str) -> None:
    q = DelayedQueue(backend.engine, queue_name, retention=HOUR)
    q.offer("a", 1, priority=4, group="g1")
    q.offer("b", 2)
    q.offer("c", 3, priority=9, group="g2", at=dt.timedelta(seconds=-1))
    [done] = [d for d in q.try_poll_many(3) if d.key == "c"]
    assert done.ack(result="ok")
    with backend.engine.connect() as conn:
        now = database_now(conn)
        live = list_messages(conn, make_tables(), queue_name, state=None, now=now)
        kept = list_messages(conn, make_tables(), queue_name, state=State.COMPLETED, now=now)
    assert sorted((m.key, m.priority, m.group) for m in live) == [("a", 4, "g1"), ("b", 0, None)]
    assert [(m.key, m.priority, m.group) for m in kept] == [("c", 9, "g2")]

    async def listed_async() -> list[tuple[str, int | None, str | None]]:
        from delayq.aio import browse as aio_browse

        engine = make_async_engine(backend.url)
        try:
            async with engine.connect() as conn:
                found = await aio_browse.list_messages(conn, make_tables(), queue_name, state=None, now=now)
        finally:
            await engine.dispose()
        return sorted((m.key, m.priority, m.group) for m in found)

    assert asyncio.run(listed_async()) == [("a", 4, "g1"), ("b", 0, None)]

    runner = CliRunner()
    listing = runner.invoke(main, ["--url", backend.url, "ls", queue_name, "--json"])
    assert listing.exit_code == 0, listing.output
    assert sorted((r["key"], r["priority"], r["group"]) for r in json.loads(listing.output)) == [
        ("a", 4, "g1"),
        ("b", 0, None),
    ]
    shown = runner.invoke(main, ["--url", backend.url, "show", queue_name, "a"])
    assert shown.exit_code == 0, shown.output
    assert re.search(r"^\s*priority: 4$", shown.output, re.M) and re.search(r"^\s*group: g1$", shown.output, re.M)
    finished = runner.invoke(main, ["--url", backend.url, "show", queue_name, "c"]).output
    assert re.search(r"^\s*priority: 9$", finished, re.M), finished
    [as_json] = json.loads(runner.invoke(main, ["--url", backend.url, "show", queue_name, "c", "--json"]).output)
    assert (as_json["state"], as_json["priority"], as_json["group"], as_json["worker"]) == ("completed", 9, "g2", None)
