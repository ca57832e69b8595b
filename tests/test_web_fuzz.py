"""The dashboard's answer to bad input: a 4xx page with one line, never a 500.

The defects found by hand (issue 42) each have a test of their own on every backend; then every route (found
in the app's routing table) and every action (``_actions.ACTIONS``) takes a generated fuzz set in every query
parameter and form field the dashboard's code reads (found in its source), on every backend (full profile).
"""

from __future__ import annotations

import datetime as dt
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import quote

import pytest
import sqlalchemy as sa
from conftest import Backend
from starlette.datastructures import QueryParams
from starlette.routing import Route

from delayq import DelayedQueue
from delayq.web import _actions, app

with warnings.catch_warnings():  # (Starlette 1.x prefers httpx2 under its TestClient; httpx works)
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

WEB = Path(__file__).parent.parent / "delayq" / "web"

FUZZ = (
    "",
    "\x00",
    "a\x00b",
    "ключ-🙂-\u202e",
    "x" * 10_240,
    "99999999999999999999",
    "-99999999999999999999",
    "-1",
    "inf",
    "nan",
    "1e400",
    "99999999999999999999.1.x",
    "1.-99999999999999999999.k",
    "..",
    "%zz",
)
"""Values every parameter gets: empty, NUL, unicode, 10 KB, huge and negative numbers, inf/nan, garbage cursors."""
RAW = ("%ED%A0%80", "%FF%FE", "%")
"""Values sent as they are in the query string or form body: bytes that are not UTF-8, a lone escape."""


def _names(pattern: str) -> list[str]:
    found: set[str] = set()
    for source in WEB.glob("*.py"):
        found.update(re.findall(pattern, source.read_text()))
    return sorted(found | {"queue"})


QUERY_NAMES = _names(r'query_params\.get\(\s*"([a-z_]+)"')
FORM_NAMES = _names(r'form\.get\(\s*"([a-z_]+)"')


def _client(engine: sa.Engine, **kwargs: Any) -> TestClient:
    c = TestClient(app(engine, **kwargs))  # (raises what the app does not handle: a 500 fails the test)
    c.get("/cron")  # (sets the CSRF cookie)
    return c


def _encoded(fields: dict[str, str]) -> str:
    """A query string or form body: RAW values as they are, the others percent-encoded."""
    return "&".join(f"{k}={v if v in RAW else quote(v, safe='')}" for k, v in fields.items())


def _post(c: TestClient, action: str, **form: str) -> Any:
    return c.post(
        f"/act/{action}",
        content=_encoded({**form, "csrf": c.cookies.get("delayq_csrf", "")}),
        headers={"content-type": "application/x-www-form-urlencoded"},
        follow_redirects=False,
    )


def _one_line(response: Any) -> str:
    """The error page's message (the element the error template puts it in)."""
    found = re.search(r'<p class="error">(.*?)</p>', response.text, re.S)
    assert found is not None, response.text[:500]
    assert "\n" not in found.group(1).strip() and "Traceback" not in response.text
    return found.group(1).strip()


def test_a_page_cursor_with_out_of_range_numbers_is_a_400(backend: Backend, queue_name: str) -> None:
    DelayedQueue(backend.engine, queue_name).offer("k", {"n": 1})
    c = _client(backend.engine)
    for after in ("99999999999999999999.1.x", "1.99999999999999999999.x", "-99999999999999999999.1.x", "1.1.a\x00"):
        r = c.get("/queue", params={"queue": queue_name, "after": after})
        assert r.status_code == 400, (after, r.status_code)
        assert "cursor" in _one_line(r)


def test_a_nul_in_a_key_or_a_prefix_is_a_400(backend: Backend, queue_name: str) -> None:
    DelayedQueue(backend.engine, queue_name).offer("a", {"n": 1})
    c = _client(backend.engine)
    for path, params in (
        ("/message", {"key": "a\x00b"}),
        ("/queue", {"prefix": "a\x00"}),
        ("/dead", {"prefix": "\x00"}),
    ):
        r = c.get(path, params={"queue": queue_name, **params})
        assert r.status_code == 400, (path, params, r.status_code)
        assert "NUL" in _one_line(r)


@pytest.mark.parametrize("per", ["inf", "-inf", "nan", "1e400", "0", "-5", "99999999999999999999"])
def test_limits_with_a_period_no_timedelta_holds_are_a_400_and_change_nothing(
    backend: Backend, queue_name: str, per: str
) -> None:
    q = DelayedQueue(backend.engine, queue_name)
    q.set_rate_limit(7, per=dt.timedelta(seconds=60))
    before = q.flow()
    c = _client(backend.engine, actions=True)
    r = _post(c, "limits", queue=queue_name, concurrency="3", rate="5", per_seconds=per)
    assert r.status_code == 400
    assert "period" in _one_line(r)
    assert q.flow() == before


def _get_routes(engine: sa.Engine) -> list[str]:
    routes = [r for r in app(engine).routes if isinstance(r, Route) and "GET" in (r.methods or ())]  # type: ignore[attr-defined]
    return sorted(r.path for r in routes if "{" not in r.path)


def _fuzzed(baseline: dict[str, str], names: list[str]) -> Iterator[dict[str, str]]:
    """Each name in turn set to each fuzz value, the others at their baseline."""
    for name in names:
        for value in FUZZ + RAW:
            yield {**baseline, name: value}


class _SpyDict(dict[str, str]):
    """A form that notes every field the action reads."""

    read: ClassVar[set[str]] = set()

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        _SpyDict.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> str:
        _SpyDict.read.add(key)
        return super().__getitem__(key)


def _query_names_read(c: TestClient, path: str, baseline: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The query parameters ``path`` reads, for a baseline request (the names it fuzzes: every one it reads)."""
    seen: set[str] = set()
    original = QueryParams.__getitem__

    def spy(self: QueryParams, key: str) -> str:
        seen.add(key)
        return original(self, key)

    with monkeypatch.context() as m:
        m.setattr(QueryParams, "__getitem__", spy)
        c.get(f"{path}?{_encoded(baseline)}")
    return seen


def _form_names_read(c: TestClient, action: str, baseline: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The form fields ``action`` reads, for a baseline POST (its confirmation page included)."""
    _SpyDict.read = set()
    with monkeypatch.context() as m:
        m.setattr(_actions, "dict", _SpyDict, raising=False)  # (the module's ``dict(parse_qsl(...))`` of the form)
        _post(c, action, **baseline)
    return _SpyDict.read - {"csrf"}


@pytest.mark.slow
def test_every_page_answers_every_fuzzed_parameter_with_a_4xx_line_or_a_page(
    backend: Backend, queue_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each route takes the fuzz set in every query parameter it reads (found by reading a baseline request)."""
    q = DelayedQueue(backend.engine, queue_name)
    q.offer("k-1", {"n": 1})
    q.offer("k-2", {"n": 2}, tags=["t"])
    c = _client(backend.engine)
    baseline = {"queue": queue_name, "key": "k-1"}
    routes = _get_routes(backend.engine)
    assert "/queue" in routes and "/message" in routes
    for path in routes:
        names = sorted(_query_names_read(c, path, baseline, monkeypatch))
        assert set(names) <= set(QUERY_NAMES), (path, names)  # (every name read is one the source shows)
        for params in _fuzzed(baseline, names):
            try:
                r = c.get(f"{path}?{_encoded(params)}")
            except Exception as exc:  # (the app raised: it would have been a 500)
                pytest.fail(f"GET {path} {params!r:.200}: {type(exc).__name__}: {exc}")
            assert r.status_code < 500, (path, params)
            if r.status_code >= 400 and "text/html" in r.headers.get("content-type", ""):
                _one_line(r)


@pytest.mark.slow
def test_every_action_answers_every_fuzzed_field_with_a_4xx_line_or_a_redirect(
    backend: Backend, queue_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each action takes the fuzz set in every form field it reads (found by a baseline POST), with and without
    its confirmation."""
    q = DelayedQueue(backend.engine, queue_name)
    for n in range(3):
        q.offer(f"k-{n}", {"n": n})
    c = _client(backend.engine, actions=True)
    baseline = {"queue": queue_name, "key": "k-1"}
    for action in sorted(_actions.ACTIONS):
        names = _form_names_read(c, action, baseline, monkeypatch) | _form_names_read(
            c, action, {**baseline, "confirmed": "yes"}, monkeypatch
        )
        assert "queue" in names, (action, names)
        for form in _fuzzed(baseline, sorted(names)):
            try:
                r = _post(c, action, **form)
            except Exception as exc:
                pytest.fail(f"POST {action} {form!r:.200}: {type(exc).__name__}: {exc}")
            assert r.status_code < 500, (action, form)
            if r.status_code >= 400:
                _one_line(r)
