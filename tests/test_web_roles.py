"""Roles on the dashboard: ``authorize`` answers each request with a role (``read`` / ``act``) and an identity, so
read-only and acting users share one dashboard; a ``read`` user sees no forms and their POSTs are refused (403,
one line, nothing changed). What ``authorize`` answered before roles (True / False) still works, as do
``actions=False`` and basic auth. Through the app with Starlette's TestClient, on every backend."""

from __future__ import annotations

import base64
import datetime as dt
import warnings
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import Backend
from starlette.requests import Request

from delayq import DelayedQueue, audit
from delayq.schema import make_tables
from delayq.web import Access, BasicAuth, app

with warnings.catch_warnings():  # (Starlette 1.x prefers httpx2 under its TestClient; httpx works)
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

TABLES = make_tables()
USERS = {"ann": Access("read", "ann"), "bob": Access("act", "bob")}
"""The application's own users (here: by a header its proxy sets) and their roles."""


def by_header(request: Request) -> Access | None:
    return USERS.get(request.headers.get("x-user", ""))


def as_user(engine: sa.Engine, user: str, **kwargs: Any) -> TestClient:
    c = TestClient(app(engine, **{"actions": True, "authorize": by_header, **kwargs}), headers={"x-user": user})
    c.get("/cron")  # (sets the CSRF cookie)
    return c


def post(c: TestClient, action: str, **form: str) -> Any:
    data = {**form, "csrf": c.cookies.get("delayq_csrf"), "next": "/"}
    return c.post(f"/act/{action}", data=data, follow_redirects=False)


def actors(engine: sa.Engine, queue: str) -> list[tuple[str, str]]:
    with engine.connect() as conn:
        return [(e.actor, e.action) for e in audit.entries(conn, TABLES, queue=queue)]


def pages(queue: str) -> list[tuple[str, dict[str, str]]]:
    return [
        ("/", {}),
        ("/queue", {"queue": queue}),
        ("/dead", {"queue": queue}),
        ("/message", {"queue": queue, "key": "later"}),
        ("/message", {"queue": queue, "key": "dead-1"}),
        ("/audit", {}),
    ]


def seed(engine: sa.Engine, queue: str) -> DelayedQueue:
    q = DelayedQueue(engine, queue)
    q.offer("later", 1, at=dt.timedelta(hours=1))
    q.offer("dead-1", 2)
    d = q.try_poll()
    assert d is not None and d.dead_letter("boom")
    return q


def test_a_read_user_sees_no_form_and_is_refused_an_act_user_acts(backend: Backend, queue_name: str) -> None:
    engine = backend.engine
    q = seed(engine, queue_name)
    ann, bob = as_user(engine, "ann"), as_user(engine, "bob")

    for path, params in pages(queue_name):
        seen = ann.get(path, params=params)
        assert seen.status_code == 200, path
        assert 'method="post"' not in seen.text and "read-only" in seen.text, path
    for path in ("/queue", "/dead"):
        assert 'method="post"' in bob.get(path, params={"queue": queue_name}).text, path
    for action, form in (
        ("pause", {}),
        ("cancel", {"key": "later"}),
        ("run-now", {"key": "later"}),
        ("requeue", {"key": "dead-1"}),
        ("purge-all", {"confirmed": "yes"}),
        ("limits", {"concurrency": "1"}),
    ):
        refused = post(ann, action, queue=queue_name, **form)
        assert refused.status_code == 403 and "your role is read" in refused.text, action
    assert not q.flow().paused and q.get("later") is not None and q.stats().dead == 1
    assert q.flow().concurrency is None and actors(engine, queue_name) == []

    assert post(bob, "pause", queue=queue_name).status_code == 303 and q.flow().paused
    assert post(bob, "cancel", queue=queue_name, key="later").status_code == 303 and q.get("later") is None
    assert actors(engine, queue_name) == [("bob", "cancel"), ("bob", "pause")]
    assert TestClient(app(engine, actions=True, authorize=by_header)).get("/").status_code == 403  # nobody


def test_what_authorize_answered_before_roles_still_works(backend: Backend, queue_name: str) -> None:
    engine = backend.engine
    q = seed(engine, queue_name)

    def team(request: Request) -> bool:
        return request.headers.get("x-team") == "ops"

    ops = TestClient(app(engine, actions=True, authorize=team), headers={"x-team": "ops"})
    ops.get("/cron")
    assert 'method="post"' in ops.get("/queue", params={"queue": queue_name}).text  # True: acts, as before
    assert post(ops, "pause", queue=queue_name).status_code == 303 and q.flow().paused
    assert TestClient(app(engine, actions=True, authorize=team)).get("/").status_code == 403
    assert actors(engine, queue_name) == [("anonymous", "pause")]

    for answer in ("read", "act"):
        c = TestClient(app(engine, actions=True, authorize=lambda _, a=answer: a))
        c.get("/cron")
        shown = c.get("/queue", params={"queue": queue_name}).text
        assert ('method="post"' in shown) is (answer == "act")
        assert post(c, "resume", queue=queue_name).status_code == (303 if answer == "act" else 403)
    assert not q.flow().paused

    # actions=False stays read-only whatever the role; a None answer is a refusal, as False was.
    c = TestClient(app(engine, authorize=lambda _: Access("act", "bob")))
    c.get("/cron")
    refused = post(c, "pause", queue=queue_name)
    assert refused.status_code == 403 and "read-only" in refused.text and not q.flow().paused
    assert TestClient(app(engine, authorize=lambda _: None)).get("/").status_code == 403

    # An answer that is none of those is the hook's bug: a loud failure, never a guess at someone's rights.
    with pytest.raises(TypeError, match="authorize returned 'admin'"):
        TestClient(app(engine, authorize=lambda _: "admin")).get("/")
    with pytest.raises(ValueError, match="'read' or 'act'"):
        Access("admin")  # type: ignore[arg-type]


def test_basic_auth_names_the_actor_when_authorize_does_not(backend: Backend, queue_name: str) -> None:
    engine = backend.engine
    q = seed(engine, queue_name)
    good = base64.b64encode(b"ops:s3cret").decode()
    c = TestClient(BasicAuth(app(engine, actions=True), "ops:s3cret"), headers={"authorization": f"Basic {good}"})
    c.get("/cron")
    assert post(c, "pause", queue=queue_name).status_code == 303 and q.flow().paused
    anyone = TestClient(app(engine, actions=True, authorize=lambda _: Access("act", "carol")))
    wrapped = TestClient(BasicAuth(anyone.app, "ops:s3cret"), headers={"authorization": f"Basic {good}"})
    wrapped.get("/cron")
    assert post(wrapped, "resume", queue=queue_name).status_code == 303 and not q.flow().paused
    assert actors(engine, queue_name) == [("carol", "resume"), ("ops", "pause")]  # the hook's identity first
