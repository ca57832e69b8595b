"""The web dashboard in a real browser: Debian's Chromium driven by Playwright (never a downloaded browser),
against the dashboard served by uvicorn on 127.0.0.1, on every backend. Each page renders, clicking requeue,
pause and cancel changes the database, a payload's script never runs, and the screenshots in docs/ are taken
here (``docs/web-*.png``). Slow: the full profile runs it (scripts/test --full installs what it needs)."""

from __future__ import annotations

import datetime as dt
import os
import shutil
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import Backend, make_engine

from delayq import CronService, DeadLetter, DelayedQueue, Delivery, Handler, Subscription, Topic, Worker, migrations
from delayq.runtime import _registry
from delayq.schema import make_tables

pytestmark = pytest.mark.slow
playwright = pytest.importorskip("playwright.sync_api", reason="pip install playwright (scripts/test --full does)")
uvicorn = pytest.importorskip("uvicorn", reason="the delayq[web] extra")

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DOCS = Path(__file__).resolve().parent.parent / "docs"
XSS = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.fail("no chromium: apt-get install chromium (scripts/test --full does)")
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM)
        yield b
        b.close()


class Served:
    """The dashboard of ``engine`` served by uvicorn in a thread, on a port of 127.0.0.1 the OS picked."""

    def __init__(self, engine: sa.Engine, **kwargs: Any) -> None:
        from delayq.web import app

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app(engine, **kwargs), log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> Served:
        self.thread.start()
        for _ in range(200):  # until it accepts (bounded: 20 s)
            if self.server.started:
                return self
            threading.Event().wait(0.1)
        raise RuntimeError("uvicorn did not start")

    def __exit__(self, *_: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


_HANDLER: dict[str, Any] = {}
exec(  # a handler as an application would have it (its traceback names the application's file, not this one)
    compile(
        "def make_thumbnail(key):\n    upload(key)\n\n\ndef upload(key):\n"
        "    raise OSError(f'storage hiccup on {key}')\n",
        "app/thumbnails.py",
        "exec",
    ),
    _HANDLER,
)


def dead_letter(q: DelayedQueue, key: str) -> None:
    q.offer(key, {"image": f"{key}.png"})
    d = q.try_poll()
    assert d is not None and d.key == key
    try:
        _HANDLER["make_thumbnail"](key)
    except OSError as exc:
        assert d.dead_letter(str(exc))


def test_pages_render_and_requeue_pause_cancel_change_the_database(
    backend: Backend, queue_name: str, browser: Any
) -> None:
    engine = backend.engine
    q = DelayedQueue(engine, queue_name)
    dead_letter(q, "img-7")
    q.offer("later-1", {"to": "bob@example.com"}, at=dt.timedelta(hours=2))
    q.offer("xss-1", {"html": XSS}, at=dt.timedelta(hours=3))
    CronService(q).install_periodic("hourly-report", every=dt.timedelta(hours=1))
    topic_name = f"web-{uuid.uuid4().hex[:10]}"
    Topic(engine, topic_name).create(2)
    Topic(engine, topic_name).publish_many([("c-1", f"m{i}", {"i": i}) for i in range(3)])
    sub = Subscription(engine, topic_name, "billing", "billing-host-1")
    sub.rebalance()
    dialogs: list[str] = []
    with Served(engine, actions=True, refresh=0.5) as served:
        page = browser.new_page()
        page.on("dialog", lambda d: (dialogs.append(d.message), d.accept()))
        page.goto(f"{served.url}/")
        row = page.locator(f'tr[data-queue="{queue_name}"]')
        assert row.locator('[data-field="dead"]').inner_text() == "1"
        page.wait_for_selector("#queues[data-polled]")  # the live panel polled its JSON
        row.locator(f'a:text-is("{queue_name}")').click()

        page.locator('button[data-action="pause"]').click()  # pause, from the queue's page
        page.wait_for_selector('button[data-action="resume"]')
        assert q.flow().paused and "paused" in page.locator(".notice").inner_text()

        page.locator('a:text-is("later-1")').click()
        assert "bob@example.com" in page.locator("pre.payload-full").inner_text()
        page.locator('button[data-action="cancel"]').click()  # asks first: accepted
        page.wait_for_selector(".notice")
        assert q.get("later-1") is None and dialogs == ["Cancel this message?"]

        page.goto(f"{served.url}/dead?queue={queue_name}")
        assert "storage hiccup on img-7" in page.content()
        page.locator("tr", has_text="img-7").locator('button[data-action="requeue"]').click()
        page.wait_for_selector(".notice")
        assert q.get("img-7") is not None and q.stats().dead == 0

        for path, heading in [
            ("/cron", "Cron schedules"),
            ("/topics", "Topics"),
            (f"/topic?topic={topic_name}", f"Topic {topic_name}"),
        ]:
            page.goto(served.url + path)
            assert page.locator("h1").inner_text() == heading
        assert "hourly-report" in page.goto(f"{served.url}/cron").text()
        page.goto(f"{served.url}/topic?topic={topic_name}")
        assert "billing-host-1" in page.content()

        for path in (f"/queue?queue={queue_name}", f"/message?queue={queue_name}&key=xss-1"):
            page.goto(served.url + path)
            page.wait_for_load_state("load")
            assert page.evaluate("window.__pwned") is None  # the payload's script never ran
            assert "<script>window.__pwned" in page.locator("body").inner_text()  # shown as text
        assert dialogs == ["Cancel this message?"]
        page.close()
    sub.close()


class Idle(Handler):
    """A handler of the paused ``reports`` queue: a worker that serves it claims nothing."""

    queue = "reports"

    def handle(self, delivery: Delivery) -> None:
        pass


def test_the_workers_page_shows_a_running_worker_live(
    backend: Backend, queue_name: str, browser: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_registry, "BEAT", 0.0)  # a registry beat at every heartbeat tick (10 s apart by default)

    class Quick(Handler):
        queue = queue_name

        def handle(self, delivery: Delivery) -> None:
            pass

    worker = Worker(backend.engine, [Quick()], concurrency=2, poll_interval=dt.timedelta(milliseconds=20), listen=False)
    worker.start()
    registry = worker._core.registry
    try:
        with Served(backend.engine, refresh=0.3) as served:
            page = browser.new_page()
            page.goto(f"{served.url}/")
            page.locator('nav a:text-is("Workers")').click()
            assert page.locator("h1").inner_text() == "Workers"
            row = page.locator(f'tr[data-worker="{registry.id}"]')
            row.wait_for()
            assert queue_name in row.inner_text() and str(os.getpid()) in row.inner_text()
            assert row.locator('[data-field="state"]').inner_text() == "running"
            page.wait_for_selector("#workers[data-polled]")  # the live panel polled its JSON
            assert worker.stop()
            # the panel's next read shows it stopped (no reload)
            page.wait_for_selector(f'tr[data-worker="{registry.id}"].stopped')
            page.close()
    finally:
        worker.stop()


def test_read_only_shows_no_buttons_and_refuses_a_forged_post(backend: Backend, queue_name: str, browser: Any) -> None:
    q = DelayedQueue(backend.engine, queue_name)
    q.offer("keep", 1, at=dt.timedelta(hours=1))
    with Served(backend.engine) as served:
        page = browser.new_page()
        page.goto(f"{served.url}/queue?queue={queue_name}")
        assert page.locator("button[data-action]").count() == 0 and "read-only" in page.inner_text("header")
        status = page.evaluate(
            """async (queue) => (await fetch("act/cancel", {method: "POST",
                headers: {"content-type": "application/x-www-form-urlencoded"},
                body: new URLSearchParams({queue, key: "keep"})})).status""",
            queue_name,
        )
        assert status == 403 and q.get("keep") is not None
        page.close()
    with Served(backend.engine, actions=True) as served:  # actions on: no token in the form, still refused
        page = browser.new_page()
        page.goto(f"{served.url}/queue?queue={queue_name}")
        status = page.evaluate(
            """async (queue) => (await fetch("act/cancel", {method: "POST",
                headers: {"content-type": "application/x-www-form-urlencoded"},
                body: new URLSearchParams({queue, key: "keep"})})).status""",
            queue_name,
        )
        assert status == 403 and q.get("keep") is not None
        page.close()


class Invoice(Handler):
    """Invoices for the screenshots: most complete with a result, every seventh is dead-lettered."""

    queue = "invoices"
    retention = dt.timedelta(days=7)

    def handle(self, delivery: Delivery) -> Any:
        order = delivery.payload["order"]
        if order % 7 == 3:
            raise DeadLetter(f"order {order}: card declined")
        return {"invoice": delivery.key, "total": f"{40 + order % 7}.00"}


def test_screenshots_for_the_docs(tmp_path: Path, browser: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A small realistic installation in a fresh SQLite file, shot page by page into docs/web-*.png."""
    monkeypatch.setattr(_registry, "BEAT", 0.0)  # (the history written at every heartbeat tick)
    url = f"sqlite:///{tmp_path / 'shots.db'}"
    migrations.upgrade(url)
    engine = make_engine(url)
    emails, thumbs, reports = (DelayedQueue(engine, n) for n in ("emails", "thumbnails", "reports"))
    for i in range(4):
        dead_letter(thumbs, f"thumb-{1040 + i}")
    emails.offer_many(
        [(f"welcome/{2000 + i}", {"to": f"user{i}@example.com", "template": "welcome"}, None) for i in range(12)]
    )
    emails.offer_many(
        [
            (f"reminder/{3000 + i}", {"to": f"user{i}@example.com", "days": 3}, dt.timedelta(hours=i + 1))
            for i in range(30)
        ]
    )
    thumbs.offer_many(
        [(f"thumb-{1100 + i}", {"image": f"uploads/{1100 + i}.jpg", "sizes": [64, 256]}, None) for i in range(7)]
    )
    thumbs.set_concurrency_limit(4)
    invoices = DelayedQueue(engine, "invoices", retention=dt.timedelta(days=7))
    invoices.offer_many([(f"invoice/{7000 + i}", {"order": 7000 + i}, None) for i in range(24)], tags=["billing"])
    invoicing = Worker(engine, [Invoice()], concurrency=4, poll_interval=dt.timedelta(milliseconds=20), listen=False)
    invoicing.start()  # (a real worker: the kept rows name it, and its heartbeats write the history)
    for _ in range(300):  # bounded: 30 s
        if (invoices.stats().completed or 0) + invoices.stats().dead >= 24:
            break
        threading.Event().wait(0.1)
    assert invoicing.stop()
    from delayq.audit import record

    record(
        engine,
        make_tables("delayq_"),
        "limits",
        actor="ops@example.com",
        source="web",
        queue="thumbnails",
        filter={"concurrency": 4},
    )
    record(engine, make_tables("delayq_"), "pause", actor="ops@example.com", source="web", queue="reports")
    reports.pause()
    CronService(reports).install_daily("nightly-report", at=[dt.time(3, 0)], tz="Europe/Berlin")
    topic = Topic(engine, "orders")
    topic.create(4)
    topic.publish_many([(f"customer-{i % 9}", f"order-{i}", {"order": i, "total": 10 + i}) for i in range(40)])
    sub = Subscription(engine, "orders", "billing", "billing-1")
    sub.rebalance()
    for d in sub.poll(15)[:10]:
        sub.ack(d)
    sub.advance_watermarks()
    shots = {
        "overview": "/",
        "queue": "/queue?queue=emails",
        "message": "/message?queue=thumbnails&key=thumb-1040",
        "dead": "/dead?queue=thumbnails",
        "cron": "/cron",
        "topic": "/topic?topic=orders",
        "workers": "/workers",
        "completed": "/queue?queue=invoices&state=completed",
        "kept": "/message?queue=invoices&key=invoice/7004",
        "search": "/search?prefix=invoice/",
        "audit": "/audit",
    }
    workers = [Worker(engine, [Idle()], concurrency=c, listen=False) for c in (4, 8)]
    for w in workers:
        w.start()
    with Served(engine, actions=True, refresh=0.5) as served:
        page = browser.new_page(viewport={"width": 1280, "height": 760})
        page.goto(served.url + "/")
        for i in range(6):  # some work between the panel's reads, for the charts
            for d in emails.try_poll_many(2):
                d.ack()
            emails.offer(f"signup/{i}", {"to": f"new{i}@example.com"})
            page.wait_for_timeout(1100)
        for name, path in shots.items():
            if name != "overview":
                page.goto(served.url + path)
            page.screenshot(path=str(DOCS / f"web-{name}.png"), full_page=False)
        page.close()
    for w in workers:
        assert w.stop()
    sub.close()
    engine.dispose()
    assert all((DOCS / f"web-{n}.png").stat().st_size > 10_000 for n in shots)
