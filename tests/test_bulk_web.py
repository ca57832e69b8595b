"""The dashboard's bulk actions on the queue page's filter (state, key prefix, tag): a confirmation page states the
count the same filter gives, nothing changes before it is confirmed, then the action runs in batches; on every
backend."""

from __future__ import annotations

import datetime as dt
import html
import re
import warnings
from typing import Any

import sqlalchemy as sa
from conftest import Backend

from delayq import DelayedQueue
from delayq.audit import entries
from delayq.schema import make_tables
from delayq.web import app

with warnings.catch_warnings():  # (Starlette 1.x prefers httpx2 under its TestClient; httpx works)
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

HOUR = dt.timedelta(hours=1)


def client(engine: sa.Engine, **kwargs: Any) -> TestClient:
    c = TestClient(app(engine, **kwargs))
    c.get("/cron")  # (any page: sets the CSRF cookie)
    return c


def post(c: TestClient, action: str, **form: str) -> Any:
    return c.post(f"/act/{action}", data={**form, "csrf": c.cookies.get("delayq_csrf")}, follow_redirects=False)


def confirmed_form(page: str) -> dict[str, str]:
    """The hidden fields of a confirmation page's form: what its "yes" posts."""
    found = re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', page)
    return {name: html.unescape(value) for name, value in found}


def test_the_queue_page_offers_the_bulk_actions_of_its_filter(backend: Backend, queue_name: str) -> None:
    q = DelayedQueue(backend.engine, queue_name)
    q.offer("a/1", 1)
    page = client(backend.engine, actions=True).get(f"/queue?queue={queue_name}&state=ready&prefix=a/").text
    assert 'action="/act/bulk-cancel"' in page and 'action="/act/bulk-purge"' in page
    assert 'name="prefix" value="a/"' in page
    assert "bulk-cancel" not in client(backend.engine).get(f"/queue?queue={queue_name}").text  # read-only
    dead = client(backend.engine, actions=True).get(f"/queue?queue={queue_name}&state=dead").text
    assert "bulk-purge" in dead and "bulk-cancel" not in dead


def test_a_bulk_cancel_states_the_count_first_then_cancels_in_batches(backend: Backend, queue_name: str) -> None:
    q = DelayedQueue(backend.engine, queue_name)
    q.offer_many([(f"a/{i:03}", i, None) for i in range(120)], tags=["eu"])
    q.offer_many([("a/x", 0, None), ("b/1", 0, None)])
    c = client(backend.engine, actions=True)
    here = f"/queue?queue={queue_name}&prefix=a/&tag=eu"
    asked = post(c, "bulk-cancel", queue=queue_name, state="", prefix="a/", tag="eu", next=here)
    assert asked.status_code == 200 and q.count_matching() == 122  # nothing changed yet
    assert f"Cancel 120 message(s) of <code>{queue_name}</code>" in asked.text
    assert 'data-count="120"' in asked.text and "tagged <code>eu</code>" in asked.text
    done = c.post("/act/bulk-cancel", data=confirmed_form(asked.text), follow_redirects=False)
    assert done.status_code == 303 and done.headers["location"] == here
    assert sorted(m.key for m in [q.get("a/x"), q.get("b/1")] if m) == ["a/x", "b/1"] and q.count_matching() == 2
    assert "120 message(s) cancelled" in c.get(here).text
    with backend.engine.connect() as conn:
        [entry] = entries(conn, make_tables(), queue=queue_name)
    assert (entry.action, entry.count, entry.filter) == ("bulk-cancel", 120, {"prefix": "a/", "tag": "eu"})


def test_bulk_purge_and_reschedule_use_the_filters_state_and_leave_running_messages(
    backend: Backend, queue_name: str
) -> None:
    q = DelayedQueue(backend.engine, queue_name)
    q.offer("run", 0, -HOUR)
    [held] = q.try_poll_many(1)
    q.offer_many([(f"r/{i}", i, None) for i in range(3)] + [("s/1", 0, HOUR)])
    c = client(backend.engine, actions=True)
    asked = post(c, "bulk-reschedule", queue=queue_name, state="ready", prefix="", tag="", in_seconds="600", next="/")
    assert (
        "Reschedule 3 message(s)" in asked.text and "due in 600s" in asked.text and q.count_matching(state="ready") == 3
    )
    assert c.post("/act/bulk-reschedule", data=confirmed_form(asked.text)).status_code == 200
    assert q.count_matching(state="scheduled") == 4
    asked = post(c, "bulk-purge", queue=queue_name, state="", prefix="", tag="", next="/")
    assert "Purge 4 message(s)" in asked.text and "every live one not running" in asked.text
    assert c.post("/act/bulk-purge", data=confirmed_form(asked.text)).status_code == 200
    assert q.count_matching() == 1 and held.ack()  # the running one stayed, under its holder
    for form in (
        {"state": "in-flight"},  # never purged
        {"state": "nope"},
        {"state": "ready", "tag": "NOT A TAG"},
        {"state": "ready", "prefix": "a\x00"},
    ):
        bad = post(c, "bulk-purge", queue=queue_name, next="/", **form)
        assert bad.status_code == 400, (form, bad.text)
    bad = post(c, "bulk-reschedule", queue=queue_name, in_seconds="inf", next="/")
    assert bad.status_code == 400 and "100 years" in bad.text
    bad = post(c, "bulk-cancel", queue=queue_name, state="dead", next="/")
    assert bad.status_code == 400 and "purge them" in bad.text
