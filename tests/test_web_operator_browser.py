"""The operator's view in a real browser (Debian's Chromium through Playwright), on every backend: finished work
is listed and opens on its result, a bulk cancel by key prefix confirms the count the database has and cancels
exactly those, every action leaves an audit entry, and a ``read`` user sees no form and is refused a forged POST.
Slow: the full profile runs it."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import Backend
from test_web_browser import Served, browser  # noqa: F401  (the module's Chromium, and the server in a thread)

from delayq import DelayedQueue, Delivery, Handler, Worker
from delayq.audit import entries
from delayq.schema import make_tables
from delayq.web import Access

pytestmark = pytest.mark.slow

BULK = 10_000
"""Messages a bulk cancel acts on."""


def _audit(engine: sa.Engine, queue: str) -> list[tuple[str, int | None]]:
    with engine.connect() as conn:
        return [(e.action, e.count) for e in entries(conn, make_tables("delayq_"), queue=queue, limit=100)]


def test_a_completed_job_is_listed_and_opens_on_its_result(backend: Backend, queue_name: str, browser: Any) -> None:  # noqa: F811
    class Invoice(Handler):
        queue = queue_name
        retention = dt.timedelta(days=1)

        def handle(self, delivery: Delivery) -> Any:
            return {"invoice": delivery.payload["order"], "total": "42.00"}

    q = DelayedQueue(backend.engine, queue_name, retention=dt.timedelta(days=1))
    q.offer("order-7", {"order": 7})
    Worker(backend.engine, [Invoice()], listen=False).run_once()
    got = q.get("order-7")
    assert got is not None and got.state == "completed"
    with Served(backend.engine) as served:
        page = browser.new_page()
        page.goto(f"{served.url}/queue?queue={queue_name}")
        page.select_option('select[name="state"]', "completed")
        with page.expect_navigation(url="**state=completed**"):
            page.locator('form.filters button[type="submit"]').click()
        page.wait_for_load_state("load")
        page.locator('a:text-is("order-7")').click()
        assert '"total": "42.00"' in page.locator("pre.payload-full").last.inner_text()
        assert "completed" in page.locator("dl.facts").inner_text()
        page.close()


def test_a_bulk_cancel_by_prefix_confirms_the_databases_count_and_is_audited(
    backend: Backend,
    queue_name: str,
    browser: Any,  # noqa: F811
) -> None:
    q = DelayedQueue(backend.engine, queue_name)
    q.offer_many([(f"bulk/{i:05}", {"i": i}, dt.timedelta(hours=1)) for i in range(BULK)])
    q.offer_many([(f"keep/{i}", {"i": i}, dt.timedelta(hours=1)) for i in range(20)])
    with Served(backend.engine, actions=True) as served:
        page = browser.new_page()
        page.goto(f"{served.url}/queue?queue={queue_name}&prefix=bulk/")
        page.locator('button[data-action="bulk-cancel"]').click()
        confirm = page.locator("p.confirm")
        assert int(confirm.get_attribute("data-count") or -1) == BULK == q.stats().scheduled - 20
        page.locator('button[data-action="confirm"]').click()
        page.wait_for_selector(".notice")
        assert q.stats().scheduled == 20 and q.get("keep/3") is not None and q.get("bulk/00003") is None

        page.locator('button[data-action="pause"]').click()
        page.wait_for_selector('button[data-action="resume"]')
        page.goto(f"{served.url}/audit?queue={queue_name}")
        shown = page.locator("table").inner_text()
        assert "bulk-cancel" in shown and "pause" in shown
        page.close()
    assert _audit(backend.engine, queue_name) == [("pause", None), ("bulk-cancel", BULK)]


def test_a_read_user_sees_no_form_and_is_refused_a_forged_post(backend: Backend, queue_name: str, browser: Any) -> None:  # noqa: F811
    q = DelayedQueue(backend.engine, queue_name)
    q.offer("keep", 1, at=dt.timedelta(hours=1))
    with Served(backend.engine, actions=True, authorize=lambda request: Access("read", "auditor")) as served:
        page = browser.new_page()
        for path in (f"/queue?queue={queue_name}", f"/message?queue={queue_name}&key=keep", "/"):
            page.goto(served.url + path)
            assert page.locator("form[method=post]").count() == 0, path
        status = page.evaluate(
            """async (queue) => (await fetch("act/cancel", {method: "POST",
                headers: {"content-type": "application/x-www-form-urlencoded"},
                body: new URLSearchParams({queue, key: "keep"})})).status""",
            queue_name,
        )
        assert status == 403 and q.get("keep") is not None
        page.close()
    assert _audit(backend.engine, queue_name) == []
