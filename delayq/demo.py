"""``delayq demo``: a tour of delayq on the embedded default, in well under a minute."""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections import Counter
from typing import Any

import click
import sqlalchemy as sa

from delayq import migrations
from delayq.cron import CronService
from delayq.handler import DeadLetter, Handler
from delayq.messages import Delivery
from delayq.queue import DelayedQueue
from delayq.retry import RetryPolicy
from delayq.worker import Worker

EMAILS, TICKS = "demo-emails", "demo-ticks"
events: Counter[str] = Counter()
lock = threading.Lock()


def note(what: str) -> None:
    with lock:
        events[what] += 1


class SendEmail(Handler):
    """Fails now and then, to show retries; one address is hopeless, to show a dead letter."""

    queue = EMAILS
    retry = RetryPolicy.fixed(dt.timedelta(seconds=1), max_attempts=3)
    visibility_timeout = dt.timedelta(seconds=10)

    def handle(self, delivery: Delivery, conn: Any = None) -> None:
        payload = delivery.payload
        if payload["to"].endswith("@invalid"):
            note("failed")
            raise ValueError(f"mailbox {payload['to']} does not exist")
        if payload["n"] % 4 == 0 and delivery.attempts == 1:
            note("failed")
            raise TimeoutError("smtp timeout")
        if payload["to"] == "nobody":
            raise DeadLetter("no address")
        note("sent")
        click.echo(f"  sent   {delivery.key:<10} to {payload['to']:<22} attempt {delivery.attempts}")


class Tick(Handler):
    queue = TICKS

    def handle(self, delivery: Delivery, conn: Any = None) -> None:
        note("ticks")
        click.echo(f"  tick   {delivery.scheduled_at:%H:%M:%S}")


def run_demo(url: str, seconds: float) -> None:
    """Migrate, offer, install a schedule, run a worker for ``seconds`` with a live view, summarise."""
    click.echo(f"delayq demo on {sa.engine.make_url(url).render_as_string()}\n")
    migrations.upgrade(url)
    engine = sa.create_engine(url)
    emails = DelayedQueue(engine, EMAILS)
    keys = [f"email-{n}" for n in range(12)]
    outcomes = emails.offer_many(
        [
            (
                k,
                {"n": n, "to": {7: "bounce@invalid", 10: "nobody"}.get(n, f"user{n}@example.com")},
                dt.timedelta(seconds=n * 0.5),
            )
            for n, k in enumerate(keys)
        ]
    )
    created = sum(o.value == "created" for o in outcomes)
    click.echo(f"offered {len(keys)} emails due over the next 6 s ({created} new, the rest already queued)")
    cron = CronService(DelayedQueue(engine, TICKS))
    cron.install_periodic("every-3s", every=dt.timedelta(seconds=3))
    click.echo("installed a cron schedule: a tick every 3 s\n")

    logging.getLogger("delayq").setLevel(logging.ERROR)
    worker = Worker(engine, [SendEmail, Tick], concurrency=4, poll_interval=dt.timedelta(milliseconds=200))
    worker.start()
    cron.start()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(1)
        s = emails.stats()
        click.echo(
            f"  [{seconds - (deadline - time.monotonic()):4.0f}s] emails: ready {s.ready}, scheduled "
            f"{s.scheduled}, in flight {s.in_flight}, dead {s.dead} | sent {events['sent']}, failed attempts "
            f"{events['failed']}, ticks {events['ticks']}"
        )
    cron.stop()
    worker.stop()
    s = emails.stats()
    click.echo(
        f"\nsummary: {events['sent']} emails sent, {events['failed']} failed attempts retried, {s.dead} dead "
        f"letter(s), {events['ticks']} cron ticks, {s.ready + s.scheduled} email(s) still queued"
    )
    for d in emails.dead_letters():
        click.echo(f"  dead letter {d.key}: {d.last_error} after {d.attempts} attempts")
    click.echo("\nnext: delayq stats | delayq ls demo-emails --state dead | delayq dead requeue demo-emails --all")
    engine.dispose()
