"""Issue 13: cron runs never duplicate or delete what they should not, run where the worker runs, and show
what they will do. One test per row of the issue's table, on every backend, and a simulated day of several
services refreshing the same schedules while consumers take the runs."""

from __future__ import annotations

import collections
import contextlib
import datetime as dt
import json
import logging
import threading
import time
import types
import zoneinfo
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from conftest import START, Backend
from test_concurrency import run_together

import delayq.cron._store
import delayq.cron._views
import delayq.cron.schedule
import delayq.cron.service
from delayq import CronService, DelayedQueue, Handler, ManualClock
from delayq.cli import main
from delayq.clock import to_ms
from delayq.cron import NAMESPACE, Schedule, ScheduleRunner, parse_run_key, run_key, schedules_for

BERLIN = zoneinfo.ZoneInfo("Europe/Berlin")
SECOND = dt.timedelta(seconds=1)
MINUTE = dt.timedelta(minutes=1)


def keys(queue: DelayedQueue) -> list[str]:
    m = queue.tables.messages
    with queue.engine.connect() as conn:
        return sorted(conn.execute(sa.select(m.c.key).where(m.c.queue == queue.name)).scalars())


def runs_of(queue: DelayedQueue, name: str) -> list[dt.datetime]:
    found = []
    for key in keys(queue):
        parsed = parse_run_key(key)
        if parsed is not None and parsed[0] == name and key.startswith(NAMESPACE):
            found.append(START + dt.timedelta(milliseconds=parsed[2] - to_ms(START)))
    return sorted(found)


def consume(queue: DelayedQueue) -> list[str]:
    """Claim and ack everything due now; the keys taken."""
    taken = []
    while batch := queue.try_poll_many(50):
        for delivery in batch:
            assert delivery.ack()
            taken.append(delivery.key)
    return taken


def skew_installer(monkeypatch: pytest.MonkeyPatch, now: Callable[[], dt.datetime], offset: dt.timedelta) -> None:
    """Make the installing process's own notion of time ``offset`` off ``now()`` (the database's).

    Both places a process keeps its time: the service's clock as cron read it before issue 13
    (``CronService._now``), and the wall clock ``datetime.now`` as every module of delayq.cron sees it.
    """

    class Skewed(dt.datetime):
        @classmethod
        def now(cls, tz: dt.tzinfo | None = None) -> Skewed:  # type: ignore[override]
            return now() + offset  # type: ignore[return-value]

    monkeypatch.setattr(CronService, "_now", lambda self: now() + offset, raising=False)
    skewed = types.SimpleNamespace(**{**vars(dt), "datetime": Skewed})
    for module in (delayq.cron.schedule, delayq.cron._store, delayq.cron.service, delayq.cron._views):
        monkeypatch.setattr(module, "dt", skewed)


# -- row 1: runs come from the database's clock -----------------------------------------------------------
@pytest.mark.parametrize("offset_s", [-2.0, -0.5, 0.5, 2.0], ids=["lag2s", "lag0.5s", "lead0.5s", "lead2s"])
def test_row1_a_skewed_installer_neither_duplicates_nor_loses_runs(
    queue: DelayedQueue, clock: ManualClock, monkeypatch: pytest.MonkeyPatch, offset_s: float
) -> None:
    """The issue's reproduction: a 1 s periodic schedule refreshed every quarter period while a consumer
    takes the due runs; the installer's clock lags or leads the (manual) database clock."""
    skew_installer(monkeypatch, clock.now, dt.timedelta(seconds=offset_s))
    cron = CronService(queue)
    cron.install_periodic("tick", every=SECOND)
    taken: list[str] = []
    for _ in range(40):  # ten seconds, a quarter period at a time
        clock.advance(SECOND / 4)
        cron.refresh()
        taken += consume(queue)
    dues = [parse_run_key(k)[2] for k in taken]  # type: ignore[index]
    duplicated = [due for due, n in collections.Counter(dues).items() if n > 1]
    assert duplicated == []
    assert sorted(dues) == [to_ms(START + SECOND * i) for i in range(1, 11)]  # none lost either


@pytest.mark.parametrize("offset_s", [-2.0, 2.0], ids=["lag2s", "lead2s"])
def test_row1_on_the_real_database_clock_a_skewed_installer_creates_no_due_run(
    make_queue: Callable[..., DelayedQueue], monkeypatch: pytest.MonkeyPatch, offset_s: float
) -> None:
    """No manual clock: the database's own. A lagging installer used to offer runs that were already due,
    which a consumer took at once and the next refresh offered again."""
    queue = make_queue(clock=None)
    skew_installer(monkeypatch, lambda: dt.datetime.fromtimestamp(time.time(), dt.UTC), offset_s * SECOND)
    cron = CronService(queue)
    cron.install_periodic("tick", every=SECOND)
    taken: list[str] = []
    for _ in range(3):
        cron.refresh()
        taken += consume(queue)
    counts = collections.Counter(taken)
    assert [k for k, n in counts.items() if n > 1] == []
    # Every installed run is in the database's future (or became due during the test, and was taken once).
    assert len(runs_of(queue, "tick")) + len(taken) >= 4


# -- row 2: installs delete only their own runs -------------------------------------------------------------
def test_row2_installing_and_uninstalling_leave_ordinary_keys_under_the_name_alone(
    queue: DelayedQueue, clock: ManualClock
) -> None:
    ordinary = ["digest/user-42", "digest/0123456789ab", "digest/0123456789ab/x", "digest", "digest2/a"]
    queue.offer_many([(k, {"k": k}, START + dt.timedelta(days=1)) for k in ordinary])
    cron = CronService(queue)
    cron.install_periodic("digest", every=MINUTE, payload={"v": 1})
    cron.install_periodic("digest", every=MINUTE, payload={"v": 2})  # a changed configuration
    clock.advance(10 * MINUTE)
    cron.refresh()  # coalescing missed runs
    assert len(runs_of(queue, "digest")) == 5  # the latest missed run, and 4 ahead
    assert cron.uninstall("digest") == 5
    assert [k for k in keys(queue)] == sorted(ordinary)
    assert queue.get("digest/user-42") is not None


def test_row2_runs_installed_before_the_namespace_keep_working(queue: DelayedQueue, clock: ManualClock) -> None:
    """Runs in the old key shape ``{name}/{hash}/{due_ms}``: the first install in the new shape removes
    exactly those not yet due (and re-creates them); a due one is consumed once, as it is."""
    schedule = Schedule.periodic("digest", MINUTE, payload={"v": 1})
    old = [START + MINUTE * i for i in range(0, 4)]  # the first is due now
    queue.offer_many([(f"digest/{schedule.config_hash}/{to_ms(t)}", {"v": 1}, t) for t in old])
    queue.offer("digest/user-42", {}, START)
    queue.offer(f"digest/{schedule.config_hash}/soon", {}, START)  # not the old shape: an ordinary key
    cron = CronService(queue)
    cron.install(schedule)
    assert keys(queue) == sorted(
        [f"digest/{schedule.config_hash}/{to_ms(START)}", "digest/user-42", f"digest/{schedule.config_hash}/soon"]
        + [run_key("digest", schedule.config_hash, START + MINUTE * i) for i in range(1, 5)]
    )
    taken = []
    for _ in range(5):
        taken += [k for k in consume(queue) if k.rsplit("/", 1)[1].isdigit()]
        clock.advance(MINUTE)
        cron.refresh()
    assert [parse_run_key(k)[2] for k in taken] == [to_ms(START + MINUTE * i) for i in range(5)]  # type: ignore[index]


# -- row 3: schedules whose names differ in case are different schedules ------------------------------------
def test_row3_names_that_differ_only_in_case_do_not_touch_each_other(queue: DelayedQueue) -> None:
    queue.offer_many([(k, {}, START + dt.timedelta(days=1)) for k in ("REPORT/1", "Report/2", "report/3")])
    cron = CronService(queue)
    cron.install_periodic("Report", every=MINUTE, payload={"v": "upper"})
    cron.install_periodic("report", every=MINUTE, payload={"v": "lower"})
    cron.install_periodic("report", every=MINUTE, payload={"v": "lower, changed"})
    assert len(runs_of(queue, "Report")) == 4 and len(runs_of(queue, "report")) == 4
    assert cron.uninstall("report") == 4
    assert len(runs_of(queue, "Report")) == 4
    assert [k for k in keys(queue) if not k.startswith(NAMESPACE)] == ["REPORT/1", "Report/2", "report/3"]
    assert cron.uninstall("REPORT") == 0
    assert len(runs_of(queue, "Report")) == 4


# -- row 4: schedules declared next to the handlers; what cron ls shows --------------------------------------
class Reports(Handler):
    queue = "reports"
    schedules = (
        Schedule.cron("weekday-9am", "0 9 * * MON-FRI", tz="Europe/Berlin", payload={"kind": "sales"}),
        Schedule.periodic("heartbeat", dt.timedelta(minutes=10), ahead=dt.timedelta(hours=1)),
    )


class MoreReports(Handler):
    queue = "reports"
    schedules = (Schedule.periodic("heartbeat", dt.timedelta(minutes=10), ahead=dt.timedelta(hours=1)),)


def cli_json(backend: Backend, *args: str) -> Any:
    out = CliRunner().invoke(main, ["--url", backend.url, *args], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    return json.loads(out.output)


def test_row4_declared_schedules_run_where_the_worker_runs_and_cron_ls_tells_when_they_stall(
    backend: Backend, make_queue: Callable[..., DelayedQueue], clock: ManualClock, queue_name: str
) -> None:
    declared = schedules_for([Reports, MoreReports()])  # several handlers may repeat one schedule
    assert [(q, s.name) for q, s in declared] == [("reports", "weekday-9am"), ("reports", "heartbeat")]
    queue = make_queue()  # where the worker's queue for "reports" would be (a queue of this test's own)
    runners = [ScheduleRunner([queue], [(queue.name, s) for _, s in declared]) for _ in range(3)]
    for runner in runners:  # three workers: each schedule installed once
        runner.refresh()
    assert len(runs_of(queue, "heartbeat")) == 6 and len(runs_of(queue, "weekday-9am")) == 4

    clock.advance(25 * MINUTE)
    views = {
        v["name"]: v
        for v in cli_json(backend, "cron", "ls", "--queue", queue.name, "--json", "--at", clock.now().isoformat())
    }
    beat = views["heartbeat"]
    assert beat["definition"] == {"kind": "periodic", "every_ms": 600_000, "tz": "UTC", "ahead_ms": 3_600_000}
    assert beat["next_run"] == (START + 30 * MINUTE).isoformat()  # not the two overdue ones
    assert beat["next_due"][0] == beat["next_run"]
    assert beat["last_run"] == {
        "due": (START + 20 * MINUTE).isoformat(),
        "state": "due",
        "key": run_key("heartbeat", beat["config"], START + 20 * MINUTE),
    }
    assert not beat["stalled"] and not views["weekday-9am"]["stalled"]
    assert views["weekday-9am"]["definition"]["cron"] == ["0 9 * * MON-FRI"]
    assert views["weekday-9am"]["next_run"] == dt.datetime(2030, 1, 1, 8, tzinfo=dt.UTC).isoformat()

    consume(queue)
    clock.advance(MINUTE * 50)  # nobody refreshed for longer than the heartbeat's hour of look-ahead
    views = {
        v["name"]: v
        for v in cli_json(backend, "cron", "ls", "--queue", queue.name, "--json", "--at", clock.now().isoformat())
    }
    assert views["heartbeat"]["stalled"] and not views["weekday-9am"]["stalled"]
    assert views["heartbeat"]["next_run"] is None
    assert views["heartbeat"]["last_run"]["state"] in ("due", "done")
    table = (
        CliRunner()
        .invoke(main, ["--url", backend.url, "cron", "ls", "--queue", queue.name, "--at", clock.now().isoformat()])
        .output
    )
    assert "STALLED" in table and "0 9 * * MON-FRI Europe/Berlin" in table
    runners[0].refresh()  # a worker is back
    views = {
        v["name"]: v
        for v in cli_json(backend, "cron", "ls", "--queue", queue.name, "--json", "--at", clock.now().isoformat())
    }
    assert not views["heartbeat"]["stalled"]


def test_row4_the_runner_installs_from_the_background_and_stops(make_queue: Callable[..., DelayedQueue]) -> None:
    queue = make_queue()
    runner = ScheduleRunner([queue], [(queue.name, s) for _, s in schedules_for([Reports])])
    runner.start()
    try:
        for _ in range(200):
            if len(runs_of(queue, "weekday-9am")) == 4:
                break
            threading.Event().wait(0.02)
        assert len(runs_of(queue, "weekday-9am")) == 4
    finally:
        runner.stop(timeout=10)
    assert all(s._thread is None for s in runner.services.values())


# -- row 5: uninstall wins over a refresh under way, and a process that still declares it says so ---------
def test_row5_uninstall_does_not_race_the_refresh_thread_into_resurrecting_it(queue: DelayedQueue) -> None:
    cron = CronService(queue)
    cron.install_periodic("report", every=MINUTE)
    entered, go = threading.Event(), threading.Event()
    real_run = queue.run

    def paused_run(op: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == "refresher" and not entered.is_set():
            entered.set()
            go.wait(10)
        return real_run(op, **kwargs)

    queue.run = paused_run  # type: ignore[method-assign]
    refresher = threading.Thread(target=cron.refresh, name="refresher")
    refresher.start()
    assert entered.wait(10)  # the refresh has read its schedules and is about to install
    uninstaller = threading.Thread(target=cron.uninstall, args=("report",))
    uninstaller.start()
    uninstaller.join(0.5)  # give an uninstall that does not wait for the refresh the time to finish
    go.set()
    refresher.join(10)
    uninstaller.join(10)
    assert runs_of(queue, "report") == []
    with queue.engine.connect() as conn:
        s = queue.tables.schedules
        assert conn.execute(sa.select(s.c.name).where(s.c.queue == queue.name)).all() == []


def test_row5_a_process_that_still_declares_an_uninstalled_schedule_reinstalls_it_with_a_warning(
    backend: Backend, queue: DelayedQueue, caplog: pytest.LogCaptureFixture
) -> None:
    still_declaring = CronService(queue)
    still_declaring.install_periodic("report", every=MINUTE)
    out = CliRunner().invoke(main, ["--url", backend.url, "cron", "uninstall", queue.name, "report", "--yes"])
    assert out.exit_code == 0 and "4 pending run(s) deleted" in out.output, out.output
    assert runs_of(queue, "report") == []
    with caplog.at_level(logging.WARNING, logger="delayq.cron"):
        still_declaring.refresh()
    assert "was uninstalled, but this process still declares it: re-installing" in caplog.text
    assert len(runs_of(queue, "report")) == 4


# -- seed 001's generator form and the look-ahead ------------------------------------------------------------
def test_payload_computed_per_run_and_a_configurable_look_ahead(queue: DelayedQueue, clock: ManualClock) -> None:
    def digest_of(due: dt.datetime) -> dict[str, str]:
        return {"day": due.date().isoformat(), "zone": str(due.tzinfo)}

    cron = CronService(queue)
    cron.install(Schedule.daily("digest", [dt.time(0, 30)], tz="Europe/Berlin", payload=digest_of, ahead=2))
    cron.install(Schedule.periodic("beat", MINUTE * 10, ahead=dt.timedelta(hours=1)))
    runs = runs_of(queue, "digest")
    assert len(runs) == 2 and len(runs_of(queue, "beat")) == 6
    digest = Schedule.daily("digest", [dt.time(0, 30)], tz="Europe/Berlin", payload=digest_of)
    assert [queue.get(run_key("digest", digest.config_hash, t)).payload for t in runs] == [  # type: ignore[union-attr]
        {"day": "2030-01-02", "zone": "Europe/Berlin"},
        {"day": "2030-01-03", "zone": "Europe/Berlin"},
    ]


# -- must be true #2: several services, three schedules, a simulated day across DST --------------------------
@pytest.fixture
def services(make_queue: Callable[..., DelayedQueue]) -> Iterator[list[CronService]]:
    found = [CronService(make_queue()) for _ in range(3)]
    yield found
    for s in found:
        s.stop(5)


def test_several_services_over_a_simulated_day_across_dst_make_each_run_exactly_once(
    services: list[CronService], make_queue: Callable[..., DelayedQueue], clock: ManualClock
) -> None:
    start = dt.datetime(2030, 3, 30, 12, tzinfo=BERLIN).astimezone(dt.UTC)  # the night of the spring change
    end = start + dt.timedelta(hours=26)
    clock.set(start)
    schedules = [
        Schedule.periodic("half-hourly", MINUTE * 30, payload=lambda due: {"at": due.isoformat()}),
        Schedule.daily("nightly", [dt.time(2, 30)], tz="Europe/Berlin", payload={"kind": "nightly"}),
        Schedule.cron("every-3h", "15 */3 * * *", tz="Europe/Berlin", payload={"kind": "3h"}),
    ]
    for service in services:
        for schedule in schedules:
            service.declare(schedule)
    consumers = [make_queue() for _ in range(2)]
    taken: list[str] = []
    taken_lock = threading.Lock()
    alive = list(services)

    def killed_mid_install(service: CronService) -> None:
        """Its next install fails inside the transaction, after all its statements: rolled back, as a kill."""
        real_run = service.queue.run

        def run(op: Any, **kwargs: Any) -> Any:
            def dying(conn: Any) -> Any:
                op(conn)
                raise RuntimeError("killed")

            return real_run(dying, **kwargs)

        service.queue.run = run  # type: ignore[method-assign]

    step = 0
    while clock.now() < end:
        clock.advance(MINUTE * 10)
        step += 1
        if step == 40:  # one dies in the middle of an install
            killed_mid_install(alive[0])
        if step == 100:  # another stops between rounds
            alive.pop(1)

        def refresh(i: int) -> None:
            with contextlib.suppress(RuntimeError):
                alive[i].refresh()

        run_together(len(alive), refresh)
        if step == 40:
            alive.pop(0)

        def take(i: int) -> None:
            got = consume(consumers[i])
            with taken_lock:
                taken.extend(got)

        run_together(len(consumers), take)

    expected = []
    for schedule in schedules:
        expected += [(schedule.name, to_ms(t)) for t in schedule.runs_after(start, 100) if t <= clock.now()]
    got = [(p[0], p[2]) for p in map(parse_run_key, taken) if p is not None]
    assert collections.Counter(got) == collections.Counter(expected)  # each exactly once
    nightly = sorted(t for name, t in got if name == "nightly")
    assert [dt.datetime.fromtimestamp(t / 1000, BERLIN).strftime("%d %H:%M %Z") for t in nightly] == ["31 03:00 CEST"]
    assert len([1 for name, _ in got if name == "half-hourly"]) == 52
