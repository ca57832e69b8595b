"""Handlers for the worker shutdown process tests, configured by environment variables.

DELAYQ_TEST_KIND is ``queue`` (a ``Handler`` of DELAYQ_TEST_NAME) or ``topic`` (a ``TopicHandler``
of topic DELAYQ_TEST_NAME, group ``g``). Each call leaves ``{id}.{pid}.started`` and
``{id}.{pid}.done`` in DELAYQ_TEST_MARKERS, holding ``time.time()`` when written; a call takes
DELAYQ_TEST_HANDLER_SECONDS. DELAYQ_TEST_EXIT_DELAY seconds pass at exit, after ``run()`` returned
(an application's own clean-up), while the handler threads still run; then it leaves
``process.{pid}.exit``. DELAYQ_TEST_DRIVER=asyncio makes the handlers coroutines (for
``delayq worker --driver asyncio``); a coroutine cancelled at the worker's exit leaves
``{id}.{pid}.cancelled`` as it ends.
"""

from __future__ import annotations

import asyncio
import atexit
import datetime as dt
import os
import time
from pathlib import Path

from delayq import Delivery, Handler, TopicDelivery, TopicHandler
from delayq.aio import AsyncDelivery, AsyncHandler

NAME = os.environ.get("DELAYQ_TEST_NAME", "unset")
SECOND = dt.timedelta(seconds=1)


def mark(name: str) -> None:
    """Leave the marker ``{name}.{pid}.{what}`` holding the time now (written whole, then renamed)."""
    markers = Path(os.environ["DELAYQ_TEST_MARKERS"])
    message, what = name.rsplit(".", 1)
    path = markers / f"{message}.{os.getpid()}.{what}"
    path.with_suffix(".tmp").write_text(repr(time.time()))
    path.with_suffix(".tmp").replace(path)


def record(message: str) -> None:
    mark(f"{message}.started")
    time.sleep(float(os.environ.get("DELAYQ_TEST_HANDLER_SECONDS", "0")))
    mark(f"{message}.done")


def exit_slowly() -> None:
    time.sleep(float(os.environ.get("DELAYQ_TEST_EXIT_DELAY", "0")))
    mark("process.exit")  # the last thing the application does


class Jobs(Handler):
    queue = NAME
    visibility_timeout = SECOND

    def handle(self, delivery: Delivery, conn: object = None) -> None:
        record(delivery.key)


class Events(TopicHandler):
    topic = NAME
    group = "g"
    visibility_timeout = SECOND
    lease_duration = 1.5 * SECOND

    def handle(self, delivery: TopicDelivery, conn: object = None) -> None:
        record(delivery.message_id)


async def record_async(message: str) -> None:
    mark(f"{message}.started")
    try:
        await asyncio.sleep(float(os.environ.get("DELAYQ_TEST_HANDLER_SECONDS", "0")))
    except asyncio.CancelledError:
        mark(f"{message}.cancelled")  # when the coroutine stopped running: it runs no more after this
        raise
    mark(f"{message}.done")


class AsyncJobs(AsyncHandler):
    queue = NAME
    visibility_timeout = SECOND

    async def handle(self, delivery: AsyncDelivery, conn: object = None) -> None:
        await record_async(delivery.key)


class AsyncEvents(TopicHandler):
    topic = NAME
    group = "g"
    visibility_timeout = SECOND
    lease_duration = 1.5 * SECOND

    async def handle(self, delivery: TopicDelivery, conn: object = None) -> None:  # type: ignore[override]
        await record_async(delivery.message_id)


if os.environ.get("DELAYQ_TEST_DRIVER") == "asyncio":
    handlers: list[type[Handler]] = [AsyncJobs] if os.environ.get("DELAYQ_TEST_KIND") == "queue" else [AsyncEvents]
else:
    handlers = [Jobs] if os.environ.get("DELAYQ_TEST_KIND") == "queue" else [Events]
atexit.register(exit_slowly)
