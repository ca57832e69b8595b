"""Handlers with retries: a flaky handler retried with backoff, one that gives up, one that asks for later.

Run: python examples/retries.py [DATABASE_URL]   (SQLite file by default)
"""

from __future__ import annotations

import datetime as dt
import sys
from typing import Any

import sqlalchemy as sa

from delayq import DeadLetter, Delivery, Handler, ManualClock, Retry, RetryPolicy, Worker, migrations

# A manual clock lets the example show hours of backoff in no time; a real worker uses the database's clock.
clock = ManualClock(dt.datetime(2030, 1, 1, tzinfo=dt.UTC))


class ChargeCard(Handler):
    queue = "example-charges"
    retry = RetryPolicy(max_attempts=5, initial_delay=dt.timedelta(seconds=30), jitter=0)

    def handle(self, delivery: Delivery, conn: Any = None) -> None:
        card = delivery.payload["card"]
        if card == "expired":
            raise DeadLetter("card expired")  # no point in trying again
        if card == "busy-gateway" and delivery.attempts < 3:
            raise ConnectionError("payment gateway timeout")  # a failed attempt: backoff 30 s, 60 s, ...
        if card == "fraud-check" and delivery.attempts == 1:
            raise Retry(after=dt.timedelta(minutes=10), reason="waiting for the fraud check")
        print(f"{clock.now():%H:%M:%S} charged {delivery.key} on attempt {delivery.attempts}")


def main(url: str) -> None:
    migrations.upgrade(url)
    engine = sa.create_engine(url)
    worker = Worker(engine, [ChargeCard], clock=clock)
    charges = worker.queues[0]
    for outcome in charges.offer_many(
        [(f"order-{card}", {"card": card}, None) for card in ("ok", "busy-gateway", "expired", "fraud-check")]
    ):
        assert outcome.value in ("created", "ignored")
    for _ in range(12):  # one minute of (manual) time per round
        worker.run_once()
        clock.advance(dt.timedelta(minutes=1))
    for dead in charges.dead_letters():
        print(f"dead letter {dead.key}: {dead.last_error} (attempts: {dead.attempts})")
        charges.purge_dead(key=dead.key)
    print("left in the queue:", charges.stats().ready + charges.stats().scheduled)
    engine.dispose()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "sqlite:///delayq-examples.db")
