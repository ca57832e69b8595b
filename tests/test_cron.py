"""CronService: one message per run however many install it, atomic replacement, DST, missed runs."""

from __future__ import annotations

import datetime as dt
import itertools
import os
import subprocess
import sys
import zoneinfo
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from conftest import REPO_ROOT, START, Backend
from test_concurrency import run_together
from test_worker import handler_for

from delayq import CronService, DelayedQueue, Delivery, ManualClock, RetryPolicy, Worker
from delayq.cron import parse_run_key, run_key, run_prefix
from delayq.errors import InvalidInputError

BERLIN = zoneinfo.ZoneInfo("Europe/Berlin")
MINUTE = dt.timedelta(minutes=1)


def installed(queue: DelayedQueue) -> list[tuple[str, dt.datetime]]:
    """(key, due) of the queue's messages, by due time, read straight from the table."""
    m = queue.tables.messages
    with queue.engine.connect() as conn:
        rows = conn.execute(
            sa.select(m.c.key, m.c.scheduled_at_initially)
            .where(m.c.queue == queue.name)
            .order_by(m.c.scheduled_at_initially)
        ).all()
    return [(k, dt.datetime.fromtimestamp(ms / 1000, dt.UTC)) for k, ms in rows]


def dues(queue: DelayedQueue, prefix: str = "") -> list[dt.datetime]:
    return [due for key, due in installed(queue) if key.startswith(prefix)]


def test_concurrent_installs_from_threads_make_one_message_per_run(queue: DelayedQueue, clock: ManualClock) -> None:
    def install(_: int) -> None:
        CronService(queue).install_periodic("heartbeat", every=10 * MINUTE, payload={"ping": 1})

    run_together(8, install)
    assert dues(queue) == [START + 10 * MINUTE * i for i in range(1, 5)]


INSTALL_IN_A_PROCESS = """
import datetime as dt, sys, sqlalchemy as sa
from delayq import CronService, DelayedQueue, ManualClock
clock = ManualClock(dt.datetime.fromisoformat(sys.argv[3]))
engine = sa.create_engine(sys.argv[1], connect_args={"timeout": 30} if sys.argv[1].startswith("sqlite") else {})
cron = CronService(DelayedQueue(engine, sys.argv[2], clock=clock))
for _ in range(5):
    cron.install_cron("weekday-9am", "0 9 * * MON-FRI", tz="Europe/Berlin", payload={"report": 1})
"""


def test_concurrent_installs_from_processes_make_one_message_per_run(
    backend: Backend, queue_name: str, clock: ManualClock
) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", INSTALL_IN_A_PROCESS, backend.url, queue_name, START.isoformat()],
            cwd=REPO_ROOT,
            env=os.environ.copy(),
        )
        for _ in range(4)
    ]
    assert [p.wait(120) for p in procs] == [0] * 4
    queue = DelayedQueue(backend.engine, queue_name, clock=clock)
    # 2030-01-01 is a Tuesday: the next four weekdays at 09:00 Berlin (08:00 UTC).
    assert dues(queue) == [dt.datetime(2030, 1, d, 8, tzinfo=dt.UTC) for d in (1, 2, 3, 4)]


def test_a_changed_schedule_replaces_its_pending_runs(queue: DelayedQueue) -> None:
    cron = CronService(queue)
    old = cron.install_periodic("report", every=MINUTE * 30, payload={"v": 1})
    new = cron.install_periodic("report", every=MINUTE * 30, payload={"v": 2})
    assert old.config_hash != new.config_hash
    keys = [k for k, _ in installed(queue)]
    assert len(keys) == 4 and all(k.startswith(run_prefix("report", new.config_hash)) for k in keys)
    assert queue.get(keys[0]).payload == {"v": 2}
    assert CronService(queue).install_periodic("report", every=MINUTE * 30, payload={"v": 2}).config_hash == (
        new.config_hash
    )  # stable across services (and processes)
    assert cron.uninstall("report", new.config_hash) == 4
    assert installed(queue) == []


def test_install_tick_and_prefixes_with_like_wildcards(queue: DelayedQueue) -> None:
    cron = CronService(queue)
    for prefix in ("a_b", "axb", "a%", "ab"):
        cron.install_tick(prefix, "h1", [(START + MINUTE, {"p": prefix})])
    cron.install_tick("a_b", "h2", [(START + 2 * MINUTE, {"p": "a_b"})])  # replaces a_b/h1 only
    assert sorted(k for k, _ in installed(queue)) == sorted(
        [run_key("a_b", "h2", START + 2 * MINUTE)] + [run_key(p, "h1", START + MINUTE) for p in ("axb", "a%", "ab")]
    )
    assert cron.uninstall("a%") == 1
    assert cron.uninstall("a_b") == 1
    assert sorted(parse_run_key(k)[0] for k, _ in installed(queue)) == ["ab", "axb"]  # type: ignore[index]
    with pytest.raises(InvalidInputError):
        cron.install_tick("a/b", "h", [])


def test_daily_runs_across_dst_in_berlin(queue: DelayedQueue, clock: ManualClock) -> None:
    cron = CronService(queue)
    clock.set(dt.datetime(2030, 3, 29, 12, tzinfo=BERLIN))
    cron.install_daily("digest", at=[dt.time(2, 30)], tz="Europe/Berlin", payload={})
    assert [d.astimezone(BERLIN).strftime("%m-%d %H:%M %Z") for d in dues(queue)] == [
        "03-30 02:30 CET",
        "03-31 03:00 CEST",
        "04-01 02:30 CEST",
        "04-02 02:30 CEST",
    ]  # 02:30 did not exist
    cron.uninstall("digest")
    clock.set(dt.datetime(2030, 10, 25, 12, tzinfo=BERLIN))
    cron.install_daily("digest", at=[dt.time(2, 30)], tz="Europe/Berlin", payload={})
    assert [d.astimezone(BERLIN).strftime("%m-%d %H:%M %Z") for d in dues(queue)] == [
        "10-26 02:30 CEST",
        "10-27 02:30 CEST",
        "10-28 02:30 CET",
        "10-29 02:30 CET",
    ]  # once on the doubled day


@pytest.mark.parametrize(
    ("start", "hours"),
    [
        (dt.datetime(2030, 3, 31, 0, 30, tzinfo=BERLIN), ["01:00 CET", "03:00 CEST", "04:00 CEST"]),
        (dt.datetime(2030, 10, 27, 1, 30, tzinfo=BERLIN), ["02:00 CEST", "02:00 CET", "03:00 CET"]),
    ],
)
def test_hourly_cron_runs_every_real_hour_across_dst(
    make_queue: Callable[..., DelayedQueue], clock: ManualClock, start: dt.datetime, hours: list[str]
) -> None:
    clock.set(start)
    queue = make_queue()
    CronService(queue).install_cron("hourly", "0 * * * *", tz="Europe/Berlin")
    runs = dues(queue)
    assert [d.astimezone(BERLIN).strftime("%H:%M %Z") for d in runs[:3]] == hours
    assert all(b - a == dt.timedelta(hours=1) for a, b in itertools.pairwise(runs))


def test_missed_runs_coalesce_into_the_latest(queue: DelayedQueue, clock: ManualClock) -> None:
    cron = CronService(queue)
    cron.install_periodic("tick", every=MINUTE)
    clock.advance(10 * MINUTE + dt.timedelta(seconds=30))  # no scheduler, no consumer for ten minutes
    cron.refresh()
    runs = dues(queue)
    assert runs[0] == START + 4 * MINUTE  # the latest installed run that is overdue; the three before it are gone
    assert runs[1:] == [START + (11 + i) * MINUTE for i in range(4)]


def test_cron_runs_are_ordinary_messages_and_a_failed_run_is_retried(
    engine: sa.Engine, queue_name: str, clock: ManualClock
) -> None:
    seen: list[tuple[str, int]] = []

    def body(d: Delivery, _: object) -> None:
        seen.append((d.key.rsplit("/", 1)[1], d.attempts))
        if len(seen) == 1:
            raise RuntimeError("report server down")

    worker = Worker(engine, [handler_for(queue_name, body, retry=RetryPolicy.fixed(2 * MINUTE))], clock=clock)
    queue = worker.queues[0]
    cron = CronService(queue)
    cron.install_periodic("report", every=MINUTE, payload={"r": 1})
    first, second, third = (str(int((START + i * MINUTE).timestamp() * 1000)) for i in (1, 2, 3))
    clock.advance(MINUTE)
    assert worker.run_once() == 1  # fails
    clock.advance(MINUTE)
    cron.refresh()  # must not coalesce away the run awaiting its retry
    assert worker.run_once() == 1  # the next run, on time
    clock.advance(MINUTE)
    assert worker.run_once() == 2  # the retry, and the third run
    assert seen[:2] == [(first, 1), (second, 1)]
    assert sorted(seen[2:]) == sorted([(first, 2), (third, 1)])
