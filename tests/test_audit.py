"""Who did what (``delayq.audit``): every action of the dashboard and of the command line is a row of the audit,
with its actor, source, queue, filter, count and the database's time; ``delayq audit`` and the audit page read
it newest first, a keyset page at a time; a failed record never hides that the action was done."""

from __future__ import annotations

import datetime as dt
import getpass
import json
import re
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from conftest import Backend, make_engine

from delayq import DelayedQueue, ManualClock, audit
from delayq.browse import database_now
from delayq.cli import main
from delayq.errors import InvalidInputError
from delayq.schema import make_tables
from delayq.web import Access, app

with warnings.catch_warnings():  # (Starlette 1.x prefers httpx2 under its TestClient; httpx works)
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

TABLES = make_tables()


def entries(engine: sa.Engine, **kwargs: Any) -> list[audit.AuditEntry]:
    with engine.connect() as conn:
        return audit.entries(conn, TABLES, **kwargs)


def dead_letter(q: DelayedQueue, key: str) -> None:
    q.offer(key, {"k": key})
    d = q.try_poll()
    assert d is not None and d.key == key and d.dead_letter("boom")


def client(engine: sa.Engine, who: str) -> TestClient:
    c = TestClient(app(engine, actions=True, authorize=lambda _: Access("act", who)))
    c.get("/cron")  # (sets the CSRF cookie)
    return c


def post(c: TestClient, action: str, **form: str) -> Any:
    data = {**form, "csrf": c.cookies.get("delayq_csrf"), "next": "/"}
    return c.post(f"/act/{action}", data=data, follow_redirects=False)


def cli(backend: Backend, *args: str) -> Any:
    return CliRunner().invoke(main, ["--url", backend.url, *args], catch_exceptions=False)


@contextmanager
def audit_table_gone() -> Iterator[None]:
    """Every INSERT into the audit table names a table that is not there: the database refuses it, for real."""

    def rewrite(conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool) -> tuple[str, Any]:
        if statement.lstrip().upper().startswith("INSERT") and TABLES.audit.name in statement:
            statement = statement.replace(TABLES.audit.name, "delayq_no_such_audit")
        return statement, params

    sa.event.listen(sa.engine.Engine, "before_cursor_execute", rewrite, retval=True)
    try:
        yield
    finally:
        sa.event.remove(sa.engine.Engine, "before_cursor_execute", rewrite)


def test_record_keeps_who_what_where_and_the_database_time_and_reads_newest_first(
    backend: Backend, queue_name: str
) -> None:
    engine = backend.engine
    with engine.connect() as conn:
        before = database_now(conn)
    audit.record(engine, TABLES, "pause", actor="ann", source="web", queue=queue_name)
    audit.record(
        engine,
        TABLES,
        "cancel",
        actor="bob",
        source="cli",
        queue=queue_name,
        filter={"prefix": "a/", "tag": None},
        count=3,
    )
    with engine.connect() as conn:
        after = database_now(conn)
    newest, oldest = entries(engine, queue=queue_name)
    assert (newest.actor, newest.source, newest.action, newest.filter, newest.count) == (
        "bob",
        "cli",
        "cancel",
        {"prefix": "a/"},
        3,
    )
    assert (oldest.actor, oldest.action, oldest.filter, oldest.count) == ("ann", "pause", {}, None)
    assert before <= oldest.at <= newest.at <= after and newest.id > oldest.id

    clock = ManualClock(dt.datetime(2031, 5, 6, 7, 8, 9, tzinfo=dt.UTC))
    audit.record(engine, TABLES, "resume", actor="ann", source="web", queue=queue_name, clock=clock)
    assert entries(engine, queue=queue_name, limit=1)[0].at == clock.now()

    # In the caller's transaction: the entry commits, or not, with it.
    with engine.connect() as conn:
        audit.record(conn, TABLES, "purge", actor="cy", source="api", queue=queue_name, count=1)
        conn.rollback()
    assert [e.action for e in entries(engine, queue=queue_name)] == ["resume", "cancel", "pause"]
    # Stored as given, cut to fit: an identity never refuses an action already done.
    audit.record(engine, TABLES, "pause", actor="z\x00" + "é" * 300, source="web", queue=queue_name)
    assert entries(engine, queue=queue_name, limit=1)[0].actor == "z" + "é" * 199


def test_entries_go_by_keyset_pages_and_filter_by_queue_action_and_actor(backend: Backend, queue_name: str) -> None:
    engine = backend.engine
    other = f"{queue_name}-other"
    for i in range(7):
        audit.record(engine, TABLES, "pause" if i % 2 else "resume", actor=f"u{i % 3}", source="cli", queue=queue_name)
    audit.record(engine, TABLES, "pause", actor="u0", source="cli", queue=other)
    everything = entries(engine, queue=queue_name)
    assert len(everything) == 7 and [e.id for e in everything] == sorted((e.id for e in everything), reverse=True)
    first = entries(engine, queue=queue_name, limit=3)
    second = entries(engine, queue=queue_name, limit=3, before=first[-1].id)
    third = entries(engine, queue=queue_name, limit=3, before=second[-1].id)
    assert [*first, *second, *third] == everything
    assert [e.actor for e in entries(engine, queue=queue_name, actor="u0")] == ["u0"] * 3
    assert {e.action for e in entries(engine, queue=queue_name, action="pause")} == {"pause"}
    assert len(entries(engine, queue=queue_name, action="pause")) == 3
    assert [e.queue for e in entries(engine, actor="u0", limit=1)] == [other]  # every queue's, newest first

    for bad in ({"before": 0}, {"before": 2**63}, {"limit": 0}, {"limit": audit.MAX_PAGE + 1}, {"queue": "a\x00"}):
        with pytest.raises(InvalidInputError):
            entries(engine, **bad)


def test_every_dashboard_action_is_recorded_once_with_its_actor_filter_and_count(
    backend: Backend, queue_name: str
) -> None:
    engine = backend.engine
    q = DelayedQueue(engine, queue_name)
    for key in ("bad-1", "bad-2", "bad-3", "worse-1"):
        dead_letter(q, key)
    q.offer("later", 1, at=dt.timedelta(hours=2))
    q.offer("doomed", 2, at=dt.timedelta(hours=2))
    c = client(engine, "alice@example.com")

    assert post(c, "run-now", queue=queue_name, key="later").status_code == 303
    assert post(c, "reschedule", queue=queue_name, key="later", in_seconds="60").status_code == 303
    assert post(c, "cancel", queue=queue_name, key="doomed").status_code == 303
    assert post(c, "cancel", queue=queue_name, key="doomed").status_code == 303  # (gone: nothing done, 0)
    assert post(c, "pause", queue=queue_name).status_code == 303
    assert post(c, "resume", queue=queue_name).status_code == 303
    assert post(c, "limits", queue=queue_name, concurrency="3", rate="", per_seconds="1").status_code == 303
    assert post(c, "requeue", queue=queue_name, key="worse-1").status_code == 303
    assert post(c, "purge", queue=queue_name, key="bad-3").status_code == 303
    assert post(c, "requeue-all", queue=queue_name, prefix="bad-").status_code == 200  # the confirmation: not done
    assert post(c, "requeue-all", queue=queue_name, prefix="bad-", confirmed="yes").status_code == 303
    assert post(c, "purge-all", queue=queue_name, confirmed="yes").status_code == 303
    assert post(c, "limits", queue=queue_name, concurrency="many").status_code == 400  # refused: not recorded

    found = list(reversed(entries(engine, queue=queue_name)))
    assert {(e.actor, e.source) for e in found} == {("alice@example.com", "web")}
    assert [(e.action, e.filter, e.count) for e in found] == [
        ("run-now", {"key": "later"}, 1),
        ("reschedule", {"key": "later", "in_seconds": "60"}, 1),
        ("cancel", {"key": "doomed"}, 1),
        ("cancel", {"key": "doomed"}, 0),
        ("pause", {}, None),
        ("resume", {}, None),
        ("limits", {"concurrency": "3", "per_seconds": "1"}, None),
        ("requeue", {"key": "worse-1"}, 1),
        ("purge", {"key": "bad-3"}, 1),
        ("requeue-all", {"prefix": "bad-"}, 2),
        ("purge-all", {}, 0),
    ]
    page = c.get("/audit", params={"queue": queue_name})
    assert page.status_code == 200 and page.text.count("alice@example.com") >= len(found)
    assert "requeue-all" in page.text and "prefix=bad-" in page.text


def test_a_failed_record_says_the_action_was_done_on_the_web_and_the_command_line(
    backend: Backend, queue_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    engine = make_engine(backend.url)
    try:
        q = DelayedQueue(engine, queue_name)
        q.offer("k", 1)
        c = client(engine, "alice")
        with audit_table_gone():
            done = post(c, "pause", queue=queue_name)
            paused = cli(backend, "cancel", queue_name, "k")
        assert done.status_code == 303 and q.flow().paused
        notice = c.get("/").text
        assert "paused (done, but not recorded in the audit:" in notice
        assert "was done but not recorded in the audit" in caplog.text
        assert paused.exit_code == 0 and q.get("k") is None
        assert "cancelled queued message k" in paused.stdout
        assert re.search(r"warning: cancel on '.*' was done, but not recorded in the audit: ", paused.stderr)
        assert entries(backend.engine, queue=queue_name) == []
    finally:
        engine.dispose()


def test_the_command_line_records_its_actions_as_the_os_user_and_delayq_audit_lists_them(
    backend: Backend, queue_name: str
) -> None:
    q = DelayedQueue(backend.engine, queue_name)
    for key in ("a/1", "a/2", "b/1"):
        q.offer(key, 1, at=dt.timedelta(hours=1))
    for key in ("d/1", "d/2", "e/1"):
        dead_letter(q, key)
    steps = [
        ("pause", queue_name),
        ("resume", queue_name),
        ("limit", queue_name, "--concurrency", "2"),
        ("run-now", queue_name, "b/1"),
        ("reschedule", queue_name, "b/1", "--in", "5m"),
        ("cancel", queue_name, "b/1"),
        ("cancel", queue_name, "--key-prefix", "a/", "--yes"),
        ("dead", "requeue", queue_name, "--key", "e/1", "--yes"),
        ("dead", "purge", queue_name, "--key-prefix", "d/", "--yes"),
    ]
    for step in steps:
        out = cli(backend, *step)
        assert out.exit_code == 0, out.output
    found = list(reversed(entries(backend.engine, queue=queue_name)))
    assert {(e.actor, e.source) for e in found} == {(getpass.getuser(), "cli")}
    assert [(e.action, e.filter, e.count) for e in found] == [
        ("pause", {}, None),
        ("resume", {}, None),
        ("limits", {"concurrency": "2", "per": "1s"}, None),
        ("run-now", {"key": "b/1"}, 1),
        ("reschedule", {"key": "b/1", "due": "in 5m"}, 1),
        ("cancel", {"key": "b/1"}, 1),
        ("cancel", {"prefix": "a/"}, 2),
        ("requeue", {"key": "e/1"}, 1),
        ("purge-all", {"prefix": "d/", "state": "dead"}, 2),
    ]

    listed = cli(backend, "audit", "--queue", queue_name, "--json")
    assert listed.exit_code == 0
    rows = json.loads(listed.stdout)
    assert [r["action"] for r in rows] == [e.action for e in reversed(found)]
    assert rows[0]["source"] == "cli" and rows[0]["filter"]["prefix"] == "d/" and rows[0]["count"] == 2
    dt.datetime.fromisoformat(rows[0]["at"])  # ISO 8601, as every --json time
    table = cli(backend, "audit", "--queue", queue_name, "--limit", "2")
    assert table.exit_code == 0 and "ACTOR" in table.stdout and "purge-all" in table.stdout
    assert "pause" not in table.stdout and f"--before {rows[1]['id']}" in table.stdout
    older = cli(backend, "audit", "--queue", queue_name, "--limit", "1", "--before", str(rows[1]["id"]), "--json")
    assert [r["id"] for r in json.loads(older.stdout)] == [rows[2]["id"]]
    bad = cli(backend, "audit", "--queue", "")
    assert bad.exit_code == 2 and len(bad.output.strip().splitlines()) == 1


def test_the_audit_page_goes_by_keyset_pages_filters_and_refuses_bad_input_in_one_line(
    backend: Backend, queue_name: str
) -> None:
    engine = backend.engine
    actor = f"op-{uuid.uuid4().hex[:8]}"
    for i in range(53):
        audit.record(engine, TABLES, "pause", actor=actor, source="web", queue=queue_name, filter={"n": i})
    audit.record(engine, TABLES, "resume", actor=actor, source="cli", queue=queue_name)
    c = TestClient(app(engine))
    first = c.get("/audit", params={"queue": queue_name})
    assert first.status_code == 200 and first.text.count("data-audit=") == 50
    assert first.text.index("resume") < first.text.index("n=52")  # newest first
    link = re.search(r'<a rel="next" href="([^"]+)"', first.text)
    assert link is not None
    second = c.get(link.group(1).replace("&amp;", "&"))
    assert second.text.count("data-audit=") == 4 and "n=0<" in second.text and 'rel="next"' not in second.text
    by_action = c.get("/audit", params={"actor": actor, "action": "resume"})
    assert by_action.text.count("data-audit=") == 1
    nobody = c.get("/audit", params={"actor": f"{actor}-x"})
    assert nobody.status_code == 200 and "No action recorded that matches" in nobody.text
    for params in (
        {"before": "x"},
        {"before": "99999999999999999999"},
        {"before": "-1"},
        {"queue": "a\x00"},
        {"actor": "z" * 10_000},
        {"action": "\x00"},
    ):
        refused = c.get("/audit", params=params)
        assert refused.status_code == 400, params
