"""The web dashboard (``delayq.web``) through Starlette's TestClient, on every backend: each page shows real
data, actions change the database (and only with the CSRF token, and only when allowed), payloads are
escaped, pages go by keyset, the app follows its mount path. The browser's view is tests/test_web_browser.py."""

from __future__ import annotations

import base64
import datetime as dt
import os
import re
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from conftest import Backend
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Mount

from delayq import CronService, DelayedQueue, Delivery, Handler, Subscription, Topic, Worker
from delayq.browse import STATE_NAMES, database_now, list_messages
from delayq.cli import main
from delayq.runtime import _registry
from delayq.schema import make_tables
from delayq.web import BasicAuth, app

with warnings.catch_warnings():  # (Starlette 1.x prefers httpx2 under its TestClient; httpx works)
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

XSS = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'


def upload_thumbnail(key: str) -> None:
    raise OSError(f"storage hiccup on {key}")


def dead_letter(q: DelayedQueue, key: str, payload: Any = None) -> None:
    """Offer ``key`` and dead-letter it from a real exception (its attempt history has a traceback)."""
    q.offer(key, payload if payload is not None else {"k": key})
    d = q.try_poll()
    assert d is not None and d.key == key
    try:
        upload_thumbnail(key)
    except OSError as exc:
        assert d.dead_letter(str(exc))


def client(engine: sa.Engine, **kwargs: Any) -> TestClient:
    c = TestClient(app(engine, **kwargs))
    c.get("/cron")  # (any page: sets the CSRF cookie)
    return c


def post(c: TestClient, action: str, token: str | None = "cookie", **form: str) -> Any:
    data = dict(form)
    if token is not None:
        data["csrf"] = c.cookies.get("delayq_csrf") if token == "cookie" else token
    return c.post(f"/act/{action}", data=data, follow_redirects=False)


def test_every_page_shows_real_data(backend: Backend, queue_name: str) -> None:
    engine = backend.engine
    q = DelayedQueue(engine, queue_name)
    dead_letter(q, "img-7")
    q.offer("ready-1", {"to": "ann@example.com"})
    q.offer("later-1", {"to": "bob@example.com"}, at=dt.timedelta(hours=2))
    CronService(q).install_periodic("hourly-report", every=dt.timedelta(hours=1))
    topic_name = f"web-{uuid.uuid4().hex[:10]}"
    topic = Topic(engine, topic_name)
    topic.create(2)
    topic.publish_many([("customer-1", f"m{i}", {"i": i}) for i in range(3)])
    sub = Subscription(engine, topic_name, "billing", "billing-host-1")
    sub.rebalance()
    sub.poll(10)
    c = client(engine)

    overview = c.get("/")
    assert overview.status_code == 200 and queue_name in overview.text
    row = re.search(rf'<tr data-queue="{queue_name}">.*?</tr>', overview.text, re.S)
    assert row is not None and 'data-field="dead">1<' in row.group(0) and 'data-field="scheduled">' in row.group(0)
    [panel] = [r for r in c.get("/api/overview").json()["queues"] if r["queue"] == queue_name]
    assert (panel["ready"], panel["dead"], panel["paused"]) == (1, 1, False)
    assert panel["scheduled"] >= 2  # later-1 and the schedule's installed runs
    assert c.get("/api/queue", params={"queue": queue_name}).json()["ready"] == 1

    listing = c.get("/queue", params={"queue": queue_name})
    assert "ready-1" in listing.text and "later-1" in listing.text and "ann@example.com" in listing.text
    assert "Run now" not in listing.text  # read-only: no buttons
    scheduled = c.get("/queue", params={"queue": queue_name, "state": "scheduled"})
    assert "later-1" in scheduled.text and "ready-1" not in scheduled.text
    prefixed = c.get("/queue", params={"queue": queue_name, "prefix": "later"})
    assert "later-1" in prefixed.text and "ready-1" not in prefixed.text

    dead = c.get("/dead", params={"queue": queue_name})
    assert "img-7" in dead.text and "storage hiccup on img-7" in dead.text

    message = c.get("/message", params={"queue": queue_name, "key": "img-7"})
    assert message.status_code == 200 and "OSError" in message.text and "upload_thumbnail" in message.text
    assert "&#34;k&#34;: &#34;img-7&#34;" in message.text  # pretty-printed JSON, escaped
    live = c.get("/message", params={"queue": queue_name, "key": "later-1"})
    assert "bob@example.com" in live.text and "created" in live.text and "asked due" in live.text
    missing = c.get("/message", params={"queue": queue_name, "key": "nope"})
    assert missing.status_code == 404 and "no message &#39;nope&#39;" in missing.text

    cron = c.get("/cron")
    assert "hourly-report" in cron.text and queue_name in cron.text

    topics = c.get("/topics")
    assert topic_name in topics.text
    page = c.get("/topic", params={"topic": topic_name})
    assert "billing" in page.text and "billing-host-1" in page.text and "watermark" in page.text
    assert any(t["topic"] == topic_name and t["published"] == 3 for t in c.get("/api/topics").json()["topics"])
    sub.close()

    assert c.get("/static/delayq.css").status_code == 200 and c.get("/static/delayq.js").status_code == 200
    assert "cdn" not in overview.text.lower() and "https://" not in overview.text


def test_the_workers_page_shows_running_workers_from_the_registry(
    backend: Backend, queue_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_registry, "BEAT", 0.0)  # a registry beat at every heartbeat tick (10 s apart by default)
    engine = backend.engine
    release = threading.Event()

    class Blocking(Handler):
        queue = queue_name

        def handle(self, delivery: Delivery) -> None:
            release.wait(30)

    worker = Worker(engine, [Blocking()], concurrency=3, poll_interval=dt.timedelta(milliseconds=20), listen=False)
    DelayedQueue(engine, queue_name).offer("a", 1)
    registry = worker._core.registry
    worker.start()
    try:
        c = client(engine)

        def mine() -> dict[str, Any] | None:
            return next((w for w in c.get("/api/workers").json()["workers"] if w["id"] == registry.id), None)

        deadline = time.monotonic() + 30
        while (found := mine()) is None or found["slots"] != "1/3":  # (the beat after the claim)
            assert time.monotonic() < deadline, found
            time.sleep(0.02)
        assert (found["state"], found["pid"], found["serves"], found["driver"]) == (
            "running",
            os.getpid(),
            queue_name,
            "threads",
        )
        page = c.get("/workers")
        row = re.search(rf'<tr data-worker="{registry.id}" class="worker running">.*?</tr>', page.text, re.S)
        assert row is not None and queue_name in row.group(0) and ">1/3<" in row.group(0)
        assert socket.gethostname()[:200] in row.group(0)
        assert 'href="/workers"' in c.get("/").text  # the nav links to it
    finally:
        release.set()
        assert worker.stop()
    stopped = c.get("/workers")
    assert re.search(rf'<tr data-worker="{registry.id}" class="worker stopped">', stopped.text)


def test_actions_change_the_database(backend: Backend, queue_name: str) -> None:
    engine = backend.engine
    q = DelayedQueue(engine, queue_name)
    for i in range(3):
        dead_letter(q, f"bad-{i}")
    dead_letter(q, "other-1")
    q.offer("later", 1, at=dt.timedelta(hours=2))
    q.offer("doomed", 2, at=dt.timedelta(hours=2))
    c = client(engine, actions=True)
    here = f"/queue?queue={queue_name}"

    done = post(c, "run-now", queue=queue_name, key="later", next=here)
    assert done.status_code == 303 and done.headers["location"] == here
    assert q.stats().ready == 1
    assert '<p class="notice" role="status">later: due now</p>' in c.get(here).text  # said once
    assert "later: due now" not in c.get(here).text
    assert 'class="notice"' not in c.get(here + "&done=you+were+hacked").text  # a link cannot say it
    assert post(c, "reschedule", queue=queue_name, key="later", in_seconds="3600", next=here).status_code == 303
    assert q.stats().ready == 0
    assert post(c, "cancel", queue=queue_name, key="doomed", next=here).status_code == 303
    assert q.get("doomed") is None

    assert post(c, "pause", queue=queue_name, next=here).status_code == 303 and q.flow().paused
    assert "Resume" in c.get(here).text
    assert post(c, "resume", queue=queue_name, next=here).status_code == 303 and not q.flow().paused
    limits = {"concurrency": "3", "rate": "10", "per_seconds": "60"}
    assert post(c, "limits", queue=queue_name, next=here, **limits).status_code == 303
    flow = q.flow()
    assert (flow.concurrency, flow.rate, flow.rate_period) == (3, 10, dt.timedelta(minutes=1))

    assert post(c, "requeue", queue=queue_name, key="bad-0", next="/").status_code == 303
    assert q.get("bad-0") is not None and q.stats().dead == 3
    assert post(c, "purge", queue=queue_name, key="other-1", next="/").status_code == 303
    assert q.stats().dead == 2

    asked = post(c, "requeue-all", queue=queue_name, prefix="bad-", next="/")
    assert asked.status_code == 200 and "Requeue 2 dead letter(s)" in asked.text and q.stats().dead == 2
    assert post(c, "requeue-all", queue=queue_name, prefix="bad-", confirmed="yes", next="/").status_code == 303
    assert q.stats().dead == 0 and q.get("bad-2") is not None

    other = DelayedQueue(engine, f"{queue_name}-x")  # (the first one's limits hold its claims back now)
    dead_letter(other, "x-1")
    dead_letter(other, "x-2")
    asked = post(c, "purge-all", queue=other.name, next="/")
    assert "Purge 2 dead letter(s)" in asked.text and other.stats().dead == 2
    assert post(c, "purge-all", queue=other.name, confirmed="yes", next="/").status_code == 303
    assert other.stats().dead == 0

    bad = post(c, "limits", queue=queue_name, concurrency="many", next=here)
    assert bad.status_code == 400 and "positive integer" in bad.text and q.flow().concurrency == 3
    gone = post(c, "cancel", queue=queue_name, key="doomed", next=here)
    assert gone.status_code == 303 and "nothing done: no message &#39;doomed&#39;" in c.get(here).text
    away = post(c, "pause", queue=queue_name, next="https://evil.example/")
    assert away.headers["location"] == "/"  # only this dashboard's own pages


def test_an_action_without_the_token_or_read_only_is_refused_and_changes_nothing(
    backend: Backend, queue_name: str
) -> None:
    engine = backend.engine
    q = DelayedQueue(engine, queue_name)
    dead_letter(q, "dead-1")
    q.offer("keep", 1, at=dt.timedelta(hours=1))

    read_only = client(engine)
    for action in ("cancel", "pause", "requeue"):
        refused = post(read_only, action, queue=queue_name, key="keep" if action == "cancel" else "dead-1")
        assert refused.status_code == 403 and "read-only" in refused.text
    writable = client(engine, actions=True)
    assert post(writable, "cancel", token=None, queue=queue_name, key="keep").status_code == 403
    assert post(writable, "cancel", token="x" * 43, queue=queue_name, key="keep").status_code == 403
    cross = writable.post(
        "/act/pause",
        data={"queue": queue_name, "csrf": writable.cookies.get("delayq_csrf")},
        headers={"origin": "https://evil.example"},
        follow_redirects=False,
    )
    assert cross.status_code == 403
    assert writable.get("/act/pause").status_code == 405  # actions are POSTs only
    assert q.get("keep") is not None and q.stats().dead == 1 and not q.flow().paused
    cookie = writable.cookies.jar
    assert any(k.name == "delayq_csrf" and k.has_nonstandard_attr("HttpOnly") for k in cookie)


def test_html_and_script_in_payloads_and_keys_are_escaped(backend: Backend, queue_name: str) -> None:
    q = DelayedQueue(backend.engine, queue_name)
    dead_letter(q, "dead-xss", {"html": XSS})
    q.offer("<b>key</b>", {"html": XSS})
    c = client(backend.engine, actions=True)
    pages = [
        c.get("/queue", params={"queue": queue_name}),
        c.get("/message", params={"queue": queue_name, "key": "<b>key</b>"}),
        c.get("/dead", params={"queue": queue_name}),
        c.get("/message", params={"queue": queue_name, "key": "dead-xss"}),
    ]
    for page in pages:
        assert page.status_code == 200
        assert "<script>window" not in page.text and "<img src=x" not in page.text and "<b>key" not in page.text
        assert "&lt;script&gt;" in page.text or "&lt;b&gt;key" in page.text
    names = c.get("/queue", params={"queue": "<i>q</i>"})
    assert "<i>q</i>" not in names.text and "&lt;i&gt;q&lt;/i&gt;" in names.text


def test_listings_go_by_keyset_pages(backend: Backend, queue_name: str) -> None:
    q = DelayedQueue(backend.engine, queue_name)
    q.offer_many([(f"k-{i:03d}", i, dt.timedelta(seconds=-i % 7)) for i in range(120)])
    c = client(backend.engine)
    seen: list[str] = []
    url: str | None = f"/queue?queue={queue_name}"
    pages = 0
    while url is not None:
        text = c.get(url).text
        seen += re.findall(r">(k-\d{3})</a>", text)
        found = re.search(r'<a rel="next" href="([^"]+)"', text)
        url = None if found is None else found.group(1).replace("&amp;", "&")
        pages += 1
    assert pages == 3 and sorted(seen) == [f"k-{i:03d}" for i in range(120)] and len(set(seen)) == 120
    keyed: list[str] = []  # under a key prefix: by key
    url = f"/queue?queue={queue_name}&prefix=k-0"
    while url is not None:
        text = c.get(url).text
        keyed += re.findall(r">(k-\d{3})</a>", text)
        found = re.search(r'<a rel="next" href="([^"]+)"', text)
        url = None if found is None else found.group(1).replace("&amp;", "&")
    assert keyed == [f"k-{i:03d}" for i in range(100)]
    with backend.engine.connect() as conn:  # the same, through the public read the CLI could use
        tables, now = make_tables(), database_now(conn)
        first = list_messages(conn, tables, queue_name, state=None, now=now, limit=70)
        rest = list_messages(conn, tables, queue_name, state=None, now=now, limit=70, after=first[-1].cursor)
    assert len(rest) == 50 and not {m.key for m in first} & {m.key for m in rest}
    assert c.get(f"/queue?queue={queue_name}&after=nonsense").status_code == 400


def test_mounted_under_a_path_every_link_and_action_follows_it(engine: sa.Engine, queue_name: str) -> None:
    q = DelayedQueue(engine, queue_name)
    q.offer("m-1", 1, at=dt.timedelta(hours=1))
    outer = Starlette(routes=[Mount("/ops/delayq", app=app(engine, actions=True))])
    c = TestClient(outer)
    page = c.get("/ops/delayq/queue", params={"queue": queue_name})
    assert page.status_code == 200
    assert 'href="/ops/delayq/static/delayq.css"' in page.text and 'action="/ops/delayq/act/cancel"' in page.text
    assert f'href="/ops/delayq/message?queue={queue_name}&amp;key=m-1"' in page.text
    assert c.get("/ops/delayq/static/delayq.js").status_code == 200
    token = c.cookies.get("delayq_csrf")
    done = c.post(
        "/ops/delayq/act/cancel",
        data={"queue": queue_name, "key": "m-1", "csrf": token, "next": f"/ops/delayq/queue?queue={queue_name}"},
        follow_redirects=False,
    )
    assert done.status_code == 303 and done.headers["location"] == f"/ops/delayq/queue?queue={queue_name}"
    assert q.get("m-1") is None


def test_the_authorize_hook_sees_every_request(engine: sa.Engine) -> None:
    asked: list[str] = []

    def authorize(request: Request) -> bool:
        asked.append(request.url.path)
        return request.headers.get("x-team") == "ops"

    c = TestClient(app(engine, authorize=authorize))
    for path in ("/", "/api/overview", "/static/delayq.js"):
        assert c.get(path).status_code == 403
        assert c.get(path, headers={"x-team": "ops"}).status_code == 200
    assert c.post("/act/pause", data={"queue": "q"}).status_code == 403
    assert asked.count("/static/delayq.js") == 2


def test_basic_auth_asks_every_request(engine: sa.Engine) -> None:
    c = TestClient(BasicAuth(app(engine), "ops:s3cret"))
    denied = c.get("/")
    assert denied.status_code == 401 and denied.headers["www-authenticate"].startswith("Basic")
    good = base64.b64encode(b"ops:s3cret").decode()
    bad = base64.b64encode(b"ops:guess").decode()
    assert c.get("/", headers={"authorization": f"Basic {good}"}).status_code == 200
    assert c.get("/", headers={"authorization": f"Basic {bad}"}).status_code == 401
    assert c.get("/", headers={"authorization": "Basic !!!"}).status_code == 401


def test_delayq_web_binds_this_machine_by_default_and_says_so(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    import uvicorn

    served: list[dict[str, Any]] = []
    monkeypatch.setattr(uvicorn, "run", lambda asgi, **kw: served.append({"app": asgi, **kw}))
    run: Callable[..., Any] = CliRunner().invoke
    out = run(main, ["--url", backend.url, "web"])
    assert out.exit_code == 0, out.output
    assert served[-1]["host"] == "127.0.0.1" and served[-1]["port"] == 8042
    assert "http://127.0.0.1:8042/ (this machine only; read-only; no authentication)" in out.output
    wide = run(main, ["--url", backend.url, "web", "--host", "0.0.0.0", "--allow-actions"])
    assert "every network" in wide.output and "warning: reachable from other machines" in wide.output
    guarded = run(main, ["--url", backend.url, "web", "--basic-auth", "ops:pw"])
    assert isinstance(served[-1]["app"], BasicAuth) and "basic auth" in guarded.output
    bad = run(main, ["--url", backend.url, "web", "--basic-auth", "nocolon"])
    assert bad.exit_code == 2 and "USER:PASSWORD" in bad.output and len(served) == 3


def test_state_filter_of_an_unknown_state_is_one_line(engine: sa.Engine, queue_name: str) -> None:
    c = TestClient(app(engine))
    bad = c.get("/queue", params={"queue": queue_name, "state": "sleeping"})
    assert bad.status_code == 400 and "no such state" in bad.text
    long = c.get("/queue", params={"queue": "q" * 300})
    assert long.status_code == 400
    options = re.findall(r'<option value="([^"]*)"', c.get(f"/queue?queue={queue_name}").text)
    assert options == ["", *STATE_NAMES]  # (every state ``delayq ls --state`` takes, the kept ones too)


def test_the_counts_snapshot_is_read_once_for_every_viewer(engine: sa.Engine, queue_name: str) -> None:
    """Stale-while-revalidate: a page gets the last snapshot at once; a stale one starts one read in the
    background, however many pages ask meanwhile (the dashboard's clock injected, the read held by a test)."""
    from delayq.web._reads import Where, overview
    from delayq.web._samples import Samples
    from delayq.web._snapshot import Snapshots

    DelayedQueue(engine, queue_name).offer("a", 1)
    now = [100.0]
    reads: list[int] = []
    release = threading.Event()

    def read(where: Where) -> Any:
        reads.append(1)
        if len(reads) > 1:
            assert release.wait(10)
        return overview(where)

    snaps = Snapshots(Where(engine, "delayq_", None), 2.0, Samples(), read, clock=lambda: now[0])
    first = snaps.latest()  # none yet: read now
    assert first.get(queue_name) is not None and len(reads) == 1
    now[0] += 1.0
    assert snaps.latest() is first and len(reads) == 1  # fresh enough
    DelayedQueue(engine, queue_name).offer("b", 2)
    now[0] += 5.0
    assert snaps.latest() is first and snaps.latest() is first  # stale: served at once, one read started
    release.set()
    for _ in range(100):
        if snaps.latest() is not first:
            break
        threading.Event().wait(0.05)
    assert len(reads) == 2
    view = snaps.latest().get(queue_name)
    assert view is not None and view.stats.ready == 2


def test_the_charts_count_arrivals_and_departures_between_reads(engine: sa.Engine, queue_name: str) -> None:
    from delayq.web._reads import Where, overview
    from delayq.web._samples import Samples

    q = DelayedQueue(engine, queue_name)
    q.offer_many([(f"k-{i}", i, None) for i in range(4)])
    now = [1000.0]
    samples = Samples(every=1.0, clock=lambda: now[0])
    where = Where(engine, "delayq_", None)
    samples.add(overview(where, samples.below())[1])
    q.offer_many([(f"n-{i}", i, None) for i in range(3)])  # 3 arrive
    assert q.ack_many(q.try_poll_many(2)) == 2  # 2 leave
    now[0] += 10.0
    samples.add(overview(where, samples.below())[1])
    series = samples.series(queue_name)
    assert series["in_per_s"] == [[1010.0, 0.3]] and series["out_per_s"] == [[1010.0, 0.2]]
    assert [v for _, v in series["backlog"]] == [4, 5]


def test_the_messages_page_filters_by_tag_and_refuses_a_bad_tag_in_one_line(engine: sa.Engine, queue_name: str) -> None:
    q = DelayedQueue(engine, queue_name)
    q.offer("a", 1, tags=["billing"])
    q.offer("b", 2, tags=["email", "eu"])
    q.offer("c", 3)
    c = TestClient(app(engine))
    page = c.get("/queue", params={"queue": queue_name, "tag": "email"})
    keys = re.findall(r'key=([abc])"', page.text)
    assert page.status_code == 200 and keys == ["b"] and "email, eu" in page.text
    assert sorted(re.findall(r'key=([abc])"', c.get("/queue", params={"queue": queue_name}).text)) == ["a", "b", "c"]
    bad = c.get("/queue", params={"queue": queue_name, "tag": "Not A Tag!"})
    assert bad.status_code == 400 and "tag" in bad.text
