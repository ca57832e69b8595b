"""A cron schedule consumed by an ordinary handler: a report every weekday at 09:00 in Berlin.

Run: python examples/cron_schedule.py [DATABASE_URL]   (SQLite file by default)
"""

from __future__ import annotations

import datetime as dt
import sys
from typing import Any

import sqlalchemy as sa

from delayq import CronService, Delivery, Handler, ManualClock, Worker, migrations

# The manual clock walks through a week in a blink; in production leave it out and call cron.start().
clock = ManualClock(dt.datetime(2030, 1, 4, 12, tzinfo=dt.UTC))  # a Friday


class DailyReport(Handler):
    queue = "example-reports"

    def handle(self, delivery: Delivery, conn: Any = None) -> None:
        local = delivery.scheduled_at.astimezone(dt.timezone(dt.timedelta(hours=1)))
        print(f"report for {local:%a %d %b %H:%M} (+01:00), payload {delivery.payload}")


def main(url: str) -> None:
    migrations.upgrade(url)
    engine = sa.create_engine(url)
    worker = Worker(engine, [DailyReport], clock=clock)
    cron = CronService(worker.queues[0])
    schedule = cron.install_cron("weekday-report", "0 9 * * MON-FRI", tz="Europe/Berlin", payload={"kind": "sales"})
    print(f"installed {schedule.prefix} (configuration {schedule.config_hash})")
    for _ in range(7 * 24):  # a week, an hour at a time: refresh as the background thread would, then consume
        clock.advance(dt.timedelta(hours=1))
        cron.refresh()
        worker.run_once()
    cron.uninstall("weekday-report")
    engine.dispose()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "sqlite:///delayq-examples.db")
