"""The worker's watchdog beside other threads that use the same engine."""

from __future__ import annotations

import threading

import sqlalchemy as sa
from conftest import Backend

from delayq.watchdog import Watchdog


def test_watchdogs_started_and_stopped_beside_busy_checkouts_never_break_them(backend: Backend) -> None:
    # A worker started or stopped while others run on the same engine: its watchdog must not change the
    # pool's listener lists under their checkouts ("deque mutated during iteration" in a fetch or LISTEN).
    engine = backend.make_engine(pool_size=4, max_overflow=0)
    errors: list[BaseException] = []
    done = threading.Event()

    def checkouts() -> None:
        while not done.is_set():
            try:
                with engine.connect() as conn:
                    conn.execute(sa.select(1))
            except BaseException as exc:  # what a checkout raised: the test's history
                errors.append(exc)
                return

    threads = [threading.Thread(target=checkouts) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        for _ in range(300):
            dog = Watchdog(engine, 60.0, set)
            dog.start()
            dog.stop()
    finally:
        done.set()
        for t in threads:
            t.join(10)
        engine.dispose()
    assert not errors, errors[:3]
