"""A handler for the flow-control process tests, configured by environment variables.

DELAYQ_TEST_QUEUE names the queue; DELAYQ_TEST_HISTORY a directory where each process appends, to a file of its
own, ``start KEY NS`` as a handler starts and ``end KEY NS`` as it returns (NS: ``time.monotonic_ns()``, one
clock for every process of the machine); DELAYQ_TEST_HANDLER_SECONDS how long a call takes.
"""

from __future__ import annotations

import datetime as dt
import os
import threading
import time
from pathlib import Path

from delayq import Delivery, Handler

_lock = threading.Lock()


def record(event: str, key: str) -> None:
    line = f"{event} {key} {time.monotonic_ns()}\n"
    with _lock, open(Path(os.environ["DELAYQ_TEST_HISTORY"]) / f"{os.getpid()}.log", "a") as f:
        f.write(line)


class Recording(Handler):
    queue = os.environ.get("DELAYQ_TEST_QUEUE", "unset")
    visibility_timeout = dt.timedelta(seconds=float(os.environ.get("DELAYQ_TEST_VISIBILITY", "30")))

    def handle(self, delivery: Delivery, conn: object = None) -> None:
        record("start", delivery.key)
        time.sleep(float(os.environ.get("DELAYQ_TEST_HANDLER_SECONDS", "0")))
        record("end", delivery.key)


handlers = [Recording]
