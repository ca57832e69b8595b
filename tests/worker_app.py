"""Handlers for the worker-process tests, configured by environment variables.

DELAYQ_TEST_QUEUE names the queue; DELAYQ_TEST_MARKERS a directory where each handler call leaves
``{key}.{pid}.started`` and ``{key}.{pid}.done``; DELAYQ_TEST_HANDLER_SECONDS how long a call takes.
DELAYQ_TEST_DRIVER=asyncio makes the handler an ``AsyncHandler`` (for ``delayq worker --driver asyncio``).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import time
from pathlib import Path

from delayq import Delivery, Handler
from delayq.aio import AsyncDelivery, AsyncHandler


class Recording(Handler):
    queue = os.environ.get("DELAYQ_TEST_QUEUE", "unset")
    visibility_timeout = dt.timedelta(seconds=float(os.environ.get("DELAYQ_TEST_VISIBILITY", "2")))

    def handle(self, delivery: Delivery, conn: object = None) -> None:
        markers = Path(os.environ["DELAYQ_TEST_MARKERS"])
        stem = f"{delivery.key}.{os.getpid()}"
        (markers / f"{stem}.started").write_text(str(delivery.attempts))
        time.sleep(float(os.environ.get("DELAYQ_TEST_HANDLER_SECONDS", "0")))
        (markers / f"{stem}.done").write_text(str(delivery.attempts))


class AsyncRecording(AsyncHandler):
    queue = Recording.queue
    visibility_timeout = Recording.visibility_timeout

    async def handle(self, delivery: AsyncDelivery, conn: object = None) -> None:
        markers = Path(os.environ["DELAYQ_TEST_MARKERS"])
        stem = f"{delivery.key}.{os.getpid()}"
        (markers / f"{stem}.started").write_text(str(delivery.attempts))
        await asyncio.sleep(float(os.environ.get("DELAYQ_TEST_HANDLER_SECONDS", "0")))
        (markers / f"{stem}.done").write_text(str(delivery.attempts))


handlers = [AsyncRecording] if os.environ.get("DELAYQ_TEST_DRIVER") == "asyncio" else [Recording]
