"""delayq in one file: migrate, offer (also inside your own ORM transaction), poll, ack, retry.

Run it with `python examples/quickstart.py [DATABASE_URL]` where delayq is installed (after
`scripts/demo`, which installs it into `.venv`: `.venv/bin/python examples/quickstart.py`). It uses
SQLite (delayq-quickstart.db) unless given another URL. `scripts/demo` runs `delayq demo`, a tour with
a worker, retries and a cron schedule.
"""

from __future__ import annotations

import datetime as dt
import sys

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from delayq import DelayedQueue, migrations


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "quickstart_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    item: Mapped[str] = mapped_column(sa.String(100))


def main(url: str) -> None:
    migrations.upgrade(url)  # what `delayq migrate --url URL` does
    engine = sa.create_engine(url)
    Base.metadata.create_all(engine)
    emails = DelayedQueue(engine, "emails", visibility_timeout=dt.timedelta(seconds=30))

    print("offer:", emails.offer("welcome-42", {"user": 42}).value)
    print("again:", emails.offer("welcome-42", {"user": 42}).value)
    print("later:", emails.offer("reminder-42", {"user": 42}, at=dt.timedelta(days=3)).value)

    # The transactional outbox: the order and its message commit (or roll back) together.
    with Session(engine) as session, session.begin():
        order = Order(item="a book")
        session.add(order)
        session.flush()
        emails.offer(f"order-{order.id}", {"order": order.id}, using=session)

    while (delivery := emails.try_poll()) is not None:
        print(f"deliver {delivery.key} {delivery.payload} (attempt {delivery.attempts})")
        if delivery.key.startswith("order-") and delivery.attempts == 1:
            delivery.retry(delay=dt.timedelta(0), error="smtp timeout")  # at once, for the demo
        else:
            delivery.ack()

    stats = emails.stats()
    print(f"ready={stats.ready} scheduled={stats.scheduled} in_flight={stats.in_flight} dead={stats.dead}")
    emails.cancel("reminder-42")
    engine.dispose()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "sqlite:///delayq-quickstart.db")
