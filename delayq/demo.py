"""``delayq demo``: a tour of delayq on the embedded default, in well under a minute.

It runs for at least ``--seconds`` (for the cron ticks), then until every email is settled (sent or
dead-lettered), at most ``MAX_EXTRA_SECONDS`` more: what it shows never depends on how fast the
machine is.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import shlex
import shutil
import sys
import threading
import time
from collections import Counter
from typing import Any

import click
import sqlalchemy as sa

from delayq import migrations
from delayq.cron import CronService
from delayq.engines import create_engine
from delayq.handler import DeadLetter, Handler
from delayq.messages import Delivery
from delayq.queue import DelayedQueue
from delayq.retry import RetryPolicy
from delayq.worker import Worker

EMAILS, TICKS, SCHEDULE = "demo-emails", "demo-ticks", "every-3s"
MAX_EXTRA_SECONDS = 60.0
"""How long past ``--seconds`` the demo waits for its emails to settle."""
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
        last = self.retry.gives_up_after(delivery.attempts)
        if payload["to"].endswith("@invalid"):
            note("dead-lettered" if last else "retried")
            raise ValueError(f"mailbox {payload['to']} does not exist")
        if payload["n"] % 4 == 0 and delivery.attempts == 1:
            note("retried")
            raise TimeoutError("smtp timeout")
        if payload["to"] == "nobody":
            note("dead-lettered")
            raise DeadLetter("no address")
        note("sent")
        click.echo(f"  sent   {delivery.key:<10} to {payload['to']:<22} attempt {delivery.attempts}")


class Tick(Handler):
    queue = TICKS

    def handle(self, delivery: Delivery, conn: Any = None) -> None:
        note("ticks")
        click.echo(f"  tick   {delivery.scheduled_at:%H:%M:%S}")


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def settled(emails: DelayedQueue) -> bool:
    """Every email sent or dead-lettered: nothing ready, scheduled or held."""
    s = emails.stats()
    return s.ready + s.scheduled + s.in_flight + s.expired_locks == 0


def next_steps(url: str) -> str:
    """The commands to look further, runnable as printed: ``delayq`` when that is on PATH and the one running,
    else the path of the one running (``.venv/bin/delayq`` after ``scripts/demo``), with how to put it on PATH."""
    command, hint = this_delayq()
    if url != "sqlite:///delayq.db":
        command += " --url " + shlex.quote(sa.engine.make_url(url).render_as_string())  # password masked
    steps = (f"  {command} stats", f"  {command} ls {EMAILS} --state dead", f"  {command} dead requeue {EMAILS} --all")
    return "\n".join(steps) + hint


def this_delayq() -> tuple[str, str]:
    """How to run this delayq again from the current directory, and a hint to put it on PATH (or "")."""
    me = sys.argv[0] if sys.argv else ""
    if os.path.basename(me) == "delayq" and os.path.isfile(me):
        script = me
    else:  # python -m delayq.cli, or run_demo called from Python: the script of this interpreter's environment
        script = os.path.join(os.path.dirname(sys.executable), "delayq")
        if not os.path.isfile(script):
            return f"{shlex.quote(sys.executable)} -m delayq.cli", ""
    on_path = shutil.which("delayq")
    if on_path is not None and os.path.samefile(on_path, script):
        return "delayq", ""
    relative = os.path.relpath(script)
    shown = os.path.abspath(script) if relative.startswith("..") else relative
    if os.sep not in shown:  # a bare name would be looked up on PATH
        shown = os.path.join(".", shown)
    activate = os.path.join(os.path.dirname(shown), "activate")
    hint = (
        f"\n(this delayq is not on your PATH: `source {shlex.quote(activate)}` puts it there)"
        if os.path.isfile(activate)
        else ""
    )
    return shlex.quote(shown), hint


def start_afresh(emails: DelayedQueue, cron: CronService) -> None:
    """Remove what an earlier run left (its emails, dead letters, schedule and ticks): a rerun shows the same tour."""
    emails.cancel_prefix("email-")
    emails.purge_dead(everything=True)
    cron.uninstall(SCHEDULE)
    cron.queue.purge_dead(everything=True)


def run_demo(url: str, seconds: float) -> None:
    """Migrate, offer, install a schedule, run a worker (at least ``seconds``, until the emails settle), summarise."""
    click.echo(f"delayq demo on {sa.engine.make_url(url).render_as_string()}\n")
    migrations.upgrade(url)
    engine = create_engine(url, pool_size=8)
    emails = DelayedQueue(engine, EMAILS)
    cron = CronService(DelayedQueue(engine, TICKS))
    start_afresh(emails, cron)
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
    if created == len(keys):
        click.echo(f"offered {len(keys)} emails due over the next 6 s")
    else:
        click.echo(
            f"offered {len(keys)} emails due over the next 6 s: {created} new, "
            f"{len(keys) - created} still queued from an earlier run (same keys: not offered twice)"
        )
    cron.install_periodic(SCHEDULE, every=dt.timedelta(seconds=3))
    click.echo("installed a cron schedule: a tick every 3 s\n")

    logging.getLogger("delayq").setLevel(logging.ERROR)
    worker = Worker(engine, [SendEmail, Tick], concurrency=4, poll_interval=dt.timedelta(milliseconds=200))
    worker.start()
    cron.start()
    start = time.monotonic()
    deadline = start + seconds + MAX_EXTRA_SECONDS
    while True:
        time.sleep(1)
        s = emails.stats()
        click.echo(
            f"  [{time.monotonic() - start:4.0f}s] emails: ready {s.ready}, scheduled {s.scheduled}, in flight "
            f"{s.in_flight}, dead {s.dead} | sent {events['sent']}, retried {events['retried']}, "
            f"ticks {events['ticks']}"
        )
        now = time.monotonic()
        if now >= deadline or (now - start >= seconds and settled(emails)):
            break
    cron.stop()
    worker.stop()
    cron.uninstall(SCHEDULE)  # no process keeps it installed now: left behind, `cron ls` would call it STALLED
    s = emails.stats()
    left = s.ready + s.scheduled + s.in_flight + s.expired_locks
    click.echo(
        f"\nsummary: {plural(events['sent'], 'email')} sent, {plural(events['retried'], 'failed attempt')} "
        f"retried, {plural(s.dead, 'dead letter')}, {plural(events['ticks'], 'cron tick')}, "
        f"{plural(left, 'email')} still queued"
    )
    for d in emails.dead_letters():
        click.echo(f"  dead letter {d.key}: {d.last_error} after {plural(d.attempts, 'attempt')}")
    click.echo(f"\nnext, to look at what it left in the database:\n{next_steps(url)}")
    engine.dispose()
