"""Finished work in the listings: ``completed``, ``cancelled`` and ``dead`` are states of ``browse.list_messages``,
``delayq ls --state`` and the dashboard's queue page (one list of names, ``STATE_NAMES``); keyset pages in every
state; a search across queues by key prefix, tag and state (``browse.search_messages``, ``delayq search``,
``/search``). Every backend; the browse reads through ``delayq.aio.browse`` too."""

from __future__ import annotations

import datetime as dt
import functools
import json
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote_plus, urlencode

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from conftest import Backend, SyncRunner, make_engine
from starlette.testclient import TestClient

from delayq import DelayedQueue, ManualClock, browse, migrations
from delayq.aio import browse as aio_browse
from delayq.browse import STATE_NAMES, State, StoredMessage, database_now, list_messages
from delayq.cli import main
from delayq.schema import make_tables
from delayq.web import app

MINUTE = dt.timedelta(minutes=1)
T = make_tables()


def kept_queue(backend: Backend, name: str, clock: ManualClock) -> DelayedQueue:
    """A queue that keeps completed (and cancelled) messages for an hour."""
    return DelayedQueue(backend.engine, name, clock=clock, retention=dt.timedelta(hours=1))


def finish(q: DelayedQueue, clock: ManualClock, keys: list[str], how: str, tags: list[str] | None = None) -> None:
    """Offer each of ``keys`` and finish it ``how`` ("completed", "cancelled" or "dead"), a minute apart, in
    reverse key order (finish order is not key order); the queue has no other due message."""
    for k in reversed(keys):
        clock.advance(MINUTE)
        q.offer(k, {"k": k}, tags=tags)
        [d] = q.try_poll_many(1)
        assert d.key == k
        if how == "completed":
            assert q.ack_many([d]) == 1
        elif how == "cancelled":
            assert q.cancel_job(k)
        else:
            assert d.dead_letter("boom")


def pages(
    backend: Backend, via: Any, queue: str, state: State | None, size: int, **kw: Any
) -> list[list[StoredMessage]]:
    """Every page of a listing, walked by ``cursor`` (with the sync reads, or ``via`` the async ones)."""
    found: list[list[StoredMessage]] = []
    after = None
    while True:
        page = read(backend, via, "list_messages", queue, state=state, limit=size, after=after, **kw)
        if not page:
            return found
        found.append(page)
        after = page[-1].cursor


def read(backend: Backend, via: Any, name: str, *args: Any, **kw: Any) -> list[StoredMessage]:
    """``browse.<name>`` on a sync connection, or ``delayq.aio.browse.<name>`` when ``via`` is an aio runner."""
    if via is None:
        with backend.engine.connect() as conn:
            return list(getattr(browse, name)(conn, T, *args, now=database_now(conn), **kw))

    async def run() -> list[StoredMessage]:
        async with via.engine.connect() as conn:
            now = await conn.run_sync(database_now)
            return list(await getattr(aio_browse, name)(conn, T, *args, now=now, **kw))

    return list(via.run(run()))


@pytest.fixture(params=["sync", "async"])
def via(request: pytest.FixtureRequest, backend: Backend) -> SyncRunner | None:
    """The browse reads of the sync API (None), or of ``delayq.aio.browse`` (an aio runner)."""
    return None if request.param == "sync" else request.getfixturevalue("aio_runner")


# -- the kept states in browse ------------------------------------------------------------------------------
def test_kept_states_list_by_finish_time_in_keyset_pages_and_by_key_under_a_prefix(
    backend: Backend, queue_name: str, clock: ManualClock, via: Any
) -> None:
    q = kept_queue(backend, queue_name, clock)
    keys = {how: [f"{how[:3]}-{i}" for i in range(5)] for how in ("completed", "cancelled", "dead")}
    for how, ks in keys.items():
        finish(q, clock, ks, how)
    q.offer("live", 1)
    for how, ks in keys.items():
        state = State.named(how)
        walked = pages(backend, via, queue_name, state, 2)
        assert [len(p) for p in walked] == [2, 2, 1]
        flat = [m for p in walked for m in p]
        assert [m.key for m in flat] == ks[::-1]  # finished in reverse key order: listed as they finished
        assert {m.state for m in flat} == {state}
        times = [m.failed_at if how == "dead" else m.finished_at for m in flat]
        assert times == sorted(times) and None not in times
        under = [m.key for p in pages(backend, via, queue_name, state, 2, key_prefix=how[:3] + "-") for m in p]
        assert under == ks  # under a prefix: by key
    completed = read(backend, via, "list_messages", queue_name, state=State.COMPLETED, limit=1)[0]
    assert completed.payload == {"k": "com-4"} and completed.finished_at is not None


# -- one list of state names ----------------------------------------------------------------------------------
def test_the_cli_and_the_web_take_the_same_state_names(backend: Backend, queue_name: str) -> None:
    assert tuple(s.value for s in State) == STATE_NAMES and {"completed", "cancelled", "dead"} <= set(STATE_NAMES)
    for command in ("ls", "search"):
        [option] = [p for p in main.commands[command].params if p.name == "state"]
        assert tuple(option.type.choices) == STATE_NAMES, command  # type: ignore[attr-defined]
    c = TestClient(app(backend.engine))
    for page in (f"/queue?queue={queue_name}", "/search"):
        assert re.findall(r'<option value="([^"]*)"', c.get(page).text) == ["", *STATE_NAMES], page
    for name in STATE_NAMES:
        assert c.get("/queue", params={"queue": queue_name, "state": name}).status_code == 200, name
        assert c.get("/search", params={"state": name}).status_code == 200, name
        assert cli(backend, "ls", queue_name, "--state", name).exit_code == 0, name


# -- the web's queue page in the kept states -----------------------------------------------------------------
def test_the_queue_page_lists_kept_messages_in_keyset_pages_each_linked_to_its_page(
    backend: Backend, queue_name: str, clock: ManualClock
) -> None:
    q = kept_queue(backend, queue_name, clock)
    q.offer_many([(f"c-{i:03d}", i, None) for i in range(55)])
    clock.advance(MINUTE)
    assert q.ack_many(q.try_poll_many(55)) == 55
    finish(q, clock, ["x-1", "x-2"], "cancelled")
    finish(q, clock, ["d-1"], "dead")
    c = TestClient(app(backend.engine))
    seen = walk(c, f"/queue?queue={queue_name}&state=completed")
    assert sorted(k for _, k in seen) == [f"c-{i:03d}" for i in range(55)] and len(seen) == 55
    assert {q for q, _ in seen} == {queue_name}
    page = c.get("/queue", params={"queue": queue_name, "state": "completed"}).text
    assert "<th>finished</th>" in page and "<th>took</th>" in page and "<th>result</th>" in page
    assert [k for _, k in walk(c, f"/queue?queue={queue_name}&state=cancelled")] == ["x-2", "x-1"]
    dead = c.get("/queue", params={"queue": queue_name, "state": "dead"}).text
    assert [k for _, k in linked(dead)] == ["d-1"] and "<th>failed</th>" in dead
    # each row's link opens the message page (kept messages' pages are another part of the dashboard's)
    assert c.get(f"/message?queue={queue_name}&key=d-1").status_code == 200


def linked(html: str) -> list[tuple[str, str]]:
    """The (queue, key) of every message link of a page."""
    found = re.findall(r'href="/message\?queue=([^&"]+)&amp;key=([^&"]+)"', html)
    return [(unquote_plus(q), unquote_plus(k)) for q, k in found]


def walk(c: TestClient, url: str | None) -> list[tuple[str, str]]:
    """The message links of every page of a listing, following its "Next page" links."""
    seen: list[tuple[str, str]] = []
    while url is not None:
        page = c.get(url)
        assert page.status_code == 200, page.text
        seen += linked(page.text)
        found = re.search(r'<a rel="next" href="([^"]+)"', page.text)
        url = None if found is None else found.group(1).replace("&amp;", "&")
    return seen


# -- search across queues -------------------------------------------------------------------------------------
@pytest.fixture
def three_queues(backend: Backend, queue_name: str, clock: ManualClock) -> Iterator[list[str]]:
    """Three queues (their names sort as listed): live ``{run}inv/…`` messages tagged ``eu`` or not, and kept
    ones; their keys start with ``run(names)`` (other tests' queues share the tables: a search sees theirs too)."""
    names = [f"{queue_name}-a", f"{queue_name}-b", f"{queue_name}-c"]
    k = run(names)
    for n, name in enumerate(names):
        finish(kept_queue(backend, name, clock), clock, [f"{k}inv/{n}-done"], "completed", tags=["eu"])
        q = DelayedQueue(backend.engine, name)  # (on the database's clock: due now, as the listings see it)
        q.offer_many([(f"{k}inv/{n}-{i:02d}", i, None) for i in range(30)], tags=["eu"])
        q.offer_many([(f"{k}inv/{n}-x{i}", i, None) for i in range(3)])
        q.offer_many([(f"{k}other/{n}-{i}", i, None) for i in range(5)], tags=["eu"])
    yield names
    with backend.engine.begin() as conn:
        for table in (T.messages, T.finished):
            conn.execute(sa.delete(table).where(table.c.queue.in_(names)))


def run(names: list[str]) -> str:
    """What the keys of ``three_queues`` start with."""
    return names[0].removesuffix("-a") + "/"


def test_a_search_lists_every_queues_matches_by_prefix_tag_and_state_in_keyset_pages(
    backend: Backend, three_queues: list[str], via: Any
) -> None:
    mine, k = set(three_queues), run(three_queues)

    def search(size: int, **kw: Any) -> list[tuple[str, str]]:
        seen: list[tuple[str, str]] = []
        after = None
        while True:
            page = read(backend, via, "search_messages", limit=size, after=after, **kw)
            seen += [(m.queue, m.key) for m in page if m.queue in mine]
            if len(page) < size:
                return seen
            after = (page[-1].queue, page[-1].cursor)

    expected = [(q, f"{k}inv/{n}-{i:02d}") for n, q in enumerate(three_queues) for i in range(30)]
    assert search(7, state=None, key_prefix=f"{k}inv/", tag="eu") == expected  # queue by queue, by key
    assert search(50, state=State.READY, key_prefix=f"{k}inv/", tag="eu") == expected
    kept = [(q, f"{k}inv/{n}-done") for n, q in enumerate(three_queues)]
    assert search(2, state=State.COMPLETED, key_prefix=f"{k}inv/") == kept
    assert search(2, state=State.COMPLETED, key_prefix=f"{k}inv/", tag="eu") == kept
    assert search(5, state=State.DEAD, key_prefix=f"{k}inv/") == []
    every = search(11, state=None, key_prefix=f"{k}inv/")
    assert len(every) == 99 and len(set(every)) == 99


def test_the_search_page_and_delayq_search_list_the_same_matches(backend: Backend, three_queues: list[str]) -> None:
    c = TestClient(app(backend.engine))
    k = run(three_queues)
    prefix = f"{k}inv/"
    seen = [
        (q, k)
        for q, k in walk(c, f"/search?{urlencode({'prefix': prefix, 'tag': 'eu', 'state': 'ready'})}")
        if q in three_queues
    ]
    expected = [(q, f"{k}inv/{n}-{i:02d}") for n, q in enumerate(three_queues) for i in range(30)]
    assert seen == expected
    page = c.get("/search", params={"prefix": prefix, "state": "completed"}).text
    assert [(q, k) for q, k in linked(page) if q in three_queues] == [
        (q, f"{k}inv/{n}-done") for n, q in enumerate(three_queues)
    ]
    assert f'href="/queue?queue={three_queues[0]}&amp;state=completed"' in page  # the queue column links its page
    assert 'href="/search"' in c.get("/").text  # in the navigation
    out = cli(backend, "search", "--key-prefix", prefix, "--tag", "eu", "--state", "ready", "--limit", "1000", "--json")
    assert out.exit_code == 0, out.output
    listed = [(m["queue"], m["key"]) for m in json.loads(out.output) if m["queue"] in three_queues]
    assert listed == expected
    table = cli(backend, "search", "--key-prefix", f"{k}inv/1-do", "--state", "completed")
    assert table.exit_code == 0 and table.output.split()[:2] == ["QUEUE", "KEY"] and three_queues[1] in table.output


# -- bad input: one line, never a 500 -------------------------------------------------------------------------
BAD = ["\x00", "a\x00b", "x" * 10_000, "é" * 300]
"""Values no state, key prefix, tag or queue name is."""
ODD = ["\ufffd", " ", "%", "'; --", "ü/"]
"""Values that may be a key prefix or queue name, or not: never a 5xx (``\ufffd``: what bytes that are not UTF-8
decode to)."""


def test_bad_listing_and_search_input_is_a_4xx_of_one_line_and_never_a_500(backend: Backend, queue_name: str) -> None:
    DelayedQueue(backend.engine, queue_name).offer("k", 1)
    c = TestClient(app(backend.engine))
    cursors = ["nonsense", "1.2", "x.y.z", "99999999999999999999.1.k", "1.-99999999999999999999.k", "1.1.\x00", "1.1."]
    cases: list[tuple[str, dict[str, str]]] = []
    for page, base in (("/queue", {"queue": queue_name}), ("/search", {})):
        cases += [(page, {**base, "state": s}) for s in ["sleeping", "DEAD", " dead", *BAD]]
        cases += [(page, {**base, "prefix": p}) for p in BAD]
        cases += [(page, {**base, "tag": t}) for t in ["Not A Tag!", *BAD]]
        cases += [(page, {**base, "after": a, "after_queue": queue_name}) for a in cursors]
    cases += [("/search", {"after_queue": q, "after": "1.1.k"}) for q in BAD]
    cases += [("/search", {"after": "1.1.k"}), ("/search", {"after_queue": queue_name})]
    raw = "state=%ED%A0%80&prefix=%FF%00&tag=%C0&after=1.1.%ED%A0%80&after_queue=%FF"
    for page, params in [*cases, (f"/queue?queue={queue_name}&{raw}", {}), (f"/search?{raw}", {})]:
        got = c.get(page, params=params or None)  # (an empty ``params`` would drop the URL's query)
        assert 400 <= got.status_code < 500, (page, params, got.status_code)
        one_line(got.text)
    for value in ODD:
        for page, params in (
            ("/queue", {"queue": queue_name, "prefix": value, "tag": "t", "state": "dead"}),
            ("/queue", {"queue": value}),
            ("/search", {"prefix": value, "state": "completed"}),
            ("/search", {"after_queue": value, "after": "1.1.k", "state": "cancelled"}),
        ):
            got = c.get(page, params=params)
            assert got.status_code in (200, 400), (page, params, got.status_code)
            if got.status_code == 400:
                one_line(got.text)
    for empty in ("/search?state=&prefix=&tag=&after=", f"/queue?queue={queue_name}&state=&prefix=&tag=&after="):
        assert c.get(empty).status_code == 200, empty
    for args in (
        ["ls", queue_name, "--state", "sleeping"],
        ["ls", queue_name, "--key-prefix", "a\x00b"],
        ["ls", queue_name, "--key-prefix", ""],
        ["ls", queue_name, "--tag", "Not A Tag!"],
        ["search", "--key-prefix", "x" * 10_000],
        ["search", "--state", "completed", "--tag", "\x00"],
    ):
        got = cli(backend, *args)
        errors = [line for line in got.output.splitlines() if line.startswith("Error: ")]
        assert got.exit_code == 2 and isinstance(got.exception, SystemExit) and len(errors) == 1, (args, got.output)


def one_line(html: str) -> None:
    """The error page says what was wrong in one line."""
    message = re.search(r'<p class="error">(.*?)</p>', html, re.S)
    assert message is not None and message.group(1).strip() and "\n" not in message.group(1).strip(), html[-400:]


def cli(backend: Backend, *args: str) -> Any:
    return CliRunner().invoke(main, ["--url", backend.url, *args])


# -- the plans at scale (PostgreSQL) -------------------------------------------------------------------------
PREFIX = "kept_ls_"
KEPT = 50_000


@pytest.fixture
def kept_rows(postgres: Backend) -> Iterator[sa.Engine]:
    """``KEPT`` completed and as many cancelled rows in one queue, and as many again in another, analyzed."""
    migrations.upgrade(postgres.url, prefix=PREFIX)
    engine = make_engine(postgres.url)
    with engine.begin() as conn:
        for table in ("finished", "dead_letters"):
            conn.exec_driver_sql(f"DELETE FROM {PREFIX}{table}")
        conn.exec_driver_sql(
            f"INSERT INTO {PREFIX}finished (queue, key, payload, payload_type, state, scheduled_at_initially, "
            "created_at, attempts, finished_at, expires_at) SELECT q, 'job/' || lpad(n::text, 6, '0'), '\\x7b7d', "
            "'json', 1 + n %% 2, 0, 0, 1, 4102444800000 + (n * 7919) %% %(rows)s, 4102444800000 * 2 "
            "FROM generate_series(1, %(rows)s) n, (VALUES ('q1'), ('q2')) v(q)",
            {"rows": 2 * KEPT},
        )
        conn.exec_driver_sql(
            f"INSERT INTO {PREFIX}dead_letters (queue, key, payload, payload_type, scheduled_at_initially, "
            f"created_at, attempts, failed_at) SELECT queue, key, payload, payload_type, 0, 0, 1, finished_at "
            f"FROM {PREFIX}finished"
        )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql(f"ANALYZE {PREFIX}finished")
        conn.exec_driver_sql(f"ANALYZE {PREFIX}dead_letters")
    try:
        yield engine
    finally:
        engine.dispose()


def test_a_deep_page_of_kept_rows_reads_an_index_range(kept_rows: sa.Engine) -> None:
    """The listing of each kept state, a page deep in it, by finish time and under a key prefix, is a range
    of one of the table's indexes (replayed under EXPLAIN as sent): never a scan of the queue, nor a sort of it."""
    tables = make_tables(PREFIX)
    with kept_rows.connect() as conn:
        now = database_now(conn)
        deep = {}
        for state in (State.COMPLETED, State.CANCELLED, State.DEAD):
            page = list_messages(conn, tables, "q1", state=state, now=now, limit=50)
            for _ in range(3):
                page = list_messages(conn, tables, "q1", state=state, now=now, limit=50, after=page[-1].cursor)
            deep[state] = page[-1].cursor
        conn.rollback()

    def listing(state: State, **kw: Any) -> Any:
        with kept_rows.connect() as conn:
            return list_messages(conn, tables, "q1", state=state, now=dt.datetime.now(dt.UTC), limit=51, **kw)

    expected = {State.COMPLETED: "finished_state_ix", State.CANCELLED: "finished_state_ix", State.DEAD: "failed_ix"}
    for state, index in expected.items():
        for kw, ix in (({"after": deep[state]}, index), ({"key_prefix": "job/0123", "after": deep[state]}, "key_ix")):
            for plan in plans(kept_rows, functools.partial(listing, state, **kw), state):
                assert "Seq Scan" not in plan and f"{PREFIX}" in plan and ix in plan, (state, kw, plan)
                assert re.search(r"Index Cond: .*finished_at|Index Cond: .*failed_at|Index Cond: .*key", plan), plan
                assert not re.search(r"^\s*->\s*Sort\b|^Sort\b", plan, re.M), (state, kw, plan)  # (no full sort)

    def search(state: State) -> Any:
        with kept_rows.connect() as conn:
            now = database_now(conn)
            return browse.search_messages(conn, tables, state=state, now=now, key_prefix="job/0123", limit=51)

    for state in expected:  # a search: its walk of the queue names probes an index too, then lists as above
        found = plans(kept_rows, functools.partial(search, state), state)
        assert len(found) >= 2 and any(p.startswith("Limit") and "Index Only Scan" in p for p in found), found
        assert all("Seq Scan" not in plan and "Index" in plan for plan in found), found
    with kept_rows.connect() as conn:  # the same pages, walked to the end, list each row once
        walked, after = 0, None
        while page := list_messages(conn, tables, "q2", state=State.CANCELLED, now=now, limit=5000, after=after):
            walked, after = walked + len(page), page[-1].cursor
        assert walked == KEPT


def plans(engine: sa.Engine, action: Any, state: State) -> list[str]:
    """The plans of the listing statements ``action`` sends, replayed under EXPLAIN as sent."""
    table = f"{PREFIX}dead_letters" if state is State.DEAD else f"{PREFIX}finished"
    sent: list[tuple[str, Any]] = []

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        if f"FROM {table}" in statement:
            sent.append((statement, parameters))

    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        action()
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)
    assert sent, f"no listing of {table} was sent"
    with engine.connect() as conn:
        found = ["\n".join(r[0] for r in conn.exec_driver_sql("EXPLAIN " + sql, params)) for sql, params in sent]
        conn.rollback()
    return found
