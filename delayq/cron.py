"""CronService: recurring messages kept installed in a DelayedQueue, safely from any number of processes.

The database rows are the schedule. Each run of a schedule is a message keyed
``\\x1fcron/{name}/{config_hash}/{due_ms}`` (see ``NAMESPACE``): processes that install the same schedule
offer the same keys, so a run exists once however many install it, and none is lost when one of them dies.

Every install is one transaction that locks the schedule's record (``{prefix}schedules``: definition,
config hash, how far runs are installed, refreshed when and by whom), reads "now" from the database (or
from the queue's injected clock) and computes the runs from it, and inserts only those due strictly after
that now and after what the previous install of the same configuration covered: an installer whose own
clock lags or leads, or a retry after a backoff, cannot re-create a run that was already consumed. The
install also deletes the schedule's runs of other configurations and coalesces missed runs. The records
are what ``delayq cron ls`` shows.

Missed runs coalesce: when runs were missed (no consumer, or no scheduler, for a while), a refresh keeps
only the latest overdue run of a schedule and cancels the older ones that nobody has started, so a long
outage yields one catch-up run, not a flood.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
import re
import socket
import threading
import zoneinfo
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import cronsim
import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from delayq.clock import EPOCH, from_ms, require_aware, to_ms
from delayq.dialects import Dialect, Statements, dialect_for
from delayq.dialects.base import prefix_bounds
from delayq.errors import InvalidInputError
from delayq.messages import OfferOutcome
from delayq.queue import DelayedQueue
from delayq.schema import MAX_SCHEDULE_NAME_LENGTH, Tables
from delayq.serializers import encode

log = logging.getLogger("delayq.cron")

AHEAD = 4
"""How many upcoming runs of each schedule are kept installed, unless the schedule says otherwise."""
MAX_AHEAD_RUNS = 1000
"""The most runs a look-ahead window installs at once."""
HASH_LENGTH = 12
MAX_PREFIX_LENGTH = MAX_SCHEDULE_NAME_LENGTH
NAMESPACE = "\x1fcron/"
"""The start of every run's key. U+001F (the ASCII unit separator) is a control character that no text a
person types or a program prints by accident contains, so no ordinary key falls under it; JSON and
``repr`` show it as ``\\u001f`` / ``\\x1f``, so a run's key is recognisable wherever it is listed."""
LEGACY_KEY = re.compile(rf"(?P<name>[^/]+)/(?P<config>[0-9a-f]{{{HASH_LENGTH}}})/(?P<due>\d+)")
"""The key of a run installed by delayq before ``NAMESPACE``: ``{name}/{config_hash}/{due_ms}``."""
RUN_KEY = re.compile(re.escape(NAMESPACE) + r"(?P<name>[^/]+)/(?P<config>[0-9A-Za-z_-]{1,32})/(?P<due>\d+)")

Payload = Any
"""A run's payload: a value, or a callable that receives the run's due time and returns one."""


def _host() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"[:200]


@dataclass(frozen=True)
class Schedule:
    """A recurring message: a name, a payload, and when it runs.

    Build one with ``Schedule.periodic``, ``Schedule.daily`` or ``Schedule.cron`` and declare it on a
    ``Handler`` (``schedules = [...]``), or install it with a ``CronService``.

    ``payload`` is a value, or a callable that receives the run's due time (aware, in ``tz``) and returns
    the payload of that run. ``ahead`` is the look-ahead: how many upcoming runs are kept installed (an
    int, 4 by default), or a ``timedelta``: every run due within that window (at least one).
    """

    name: str
    payload: Payload = None
    every: dt.timedelta | None = None
    expressions: tuple[str, ...] = ()
    tz: str = "UTC"
    ahead: int | dt.timedelta = AHEAD
    kind: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        check_name(self.name)
        if (self.every is None) == (not self.expressions):
            raise InvalidInputError("a schedule runs either every period or on cron expressions")
        every = self.every
        if every is not None and (not isinstance(every, dt.timedelta) or every < dt.timedelta(seconds=1)):
            raise InvalidInputError("every must be a timedelta of at least one second")
        check_zone(self.tz)
        for expression in self.expressions:
            try:
                cronsim.CronSim(expression, dt.datetime.now(dt.UTC))
            except cronsim.CronSimError as exc:
                raise InvalidInputError(f"bad cron expression {expression!r}: {exc}") from None
        ahead = self.ahead
        if isinstance(ahead, bool) or not (
            (isinstance(ahead, int) and 1 <= ahead <= MAX_AHEAD_RUNS)
            or (isinstance(ahead, dt.timedelta) and ahead > dt.timedelta(0))
        ):
            raise InvalidInputError(f"ahead is a number of runs (1 to {MAX_AHEAD_RUNS}) or a positive timedelta")
        if not self.kind:
            object.__setattr__(self, "kind", "periodic" if self.every is not None else "cron")

    # -- the ways to build one --------------------------------------------------------------------
    @classmethod
    def periodic(
        cls, name: str, every: dt.timedelta, *, payload: Payload = None, ahead: int | dt.timedelta = AHEAD
    ) -> Schedule:
        """Run every ``every``, aligned to the Unix epoch (so every process computes the same times)."""
        return cls(name, payload, every=every, ahead=ahead, kind="periodic")

    @classmethod
    def daily(
        cls,
        name: str,
        at: Iterable[dt.time],
        *,
        tz: str = "UTC",
        payload: Payload = None,
        ahead: int | dt.timedelta = AHEAD,
    ) -> Schedule:
        """Run every day at the wall-clock times ``at`` in time zone ``tz``.

        A time that does not exist on a spring-forward day runs at the first minute after the gap;
        one that occurs twice on a fall-back day runs once, at the first occurrence.
        """
        times = sorted(set(at))
        if not times or any(t.second or t.microsecond or t.tzinfo for t in times):
            raise InvalidInputError("at takes one or more naive times with whole minutes, e.g. time(2, 30)")
        expressions = tuple(f"{t.minute} {t.hour} * * *" for t in times)
        return cls(name, payload, expressions=expressions, tz=tz, ahead=ahead, kind="daily")

    @classmethod
    def cron(
        cls, name: str, expression: str, *, tz: str = "UTC", payload: Payload = None, ahead: int | dt.timedelta = AHEAD
    ) -> Schedule:
        """Run on a cron expression (five fields, parsed by cronsim) in time zone ``tz``."""
        return cls(name, payload, expressions=(expression,), tz=tz, ahead=ahead, kind="cron")

    @classmethod
    def from_definition(cls, name: str, definition: Mapping[str, Any]) -> Schedule:
        """The timing of a recorded schedule (its payload is not recorded)."""
        every = definition.get("every_ms")
        ahead = definition.get("ahead_ms")
        return cls(
            name,
            None,
            every=None if every is None else dt.timedelta(milliseconds=every),
            expressions=tuple(definition.get("cron", ())),
            tz=definition.get("tz", "UTC"),
            ahead=dt.timedelta(milliseconds=ahead) if ahead is not None else int(definition.get("ahead", AHEAD)),
            kind=definition.get("kind", ""),
        )

    # -- what it is -------------------------------------------------------------------------------
    @property
    def prefix(self) -> str:
        """The schedule's name (what delayq before 0.2 called its prefix)."""
        return self.name

    @property
    def definition(self) -> dict[str, Any]:
        """What the schedule's record shows: kind, period or expressions, time zone, look-ahead."""
        found: dict[str, Any] = {"kind": self.kind, "tz": self.tz}
        if self.every is not None:
            found["every_ms"] = self.every // dt.timedelta(milliseconds=1)
        else:
            found["cron"] = list(self.expressions)
        if isinstance(self.ahead, dt.timedelta):
            found["ahead_ms"] = self.ahead // dt.timedelta(milliseconds=1)
        else:
            found["ahead"] = self.ahead
        if callable(self.payload):
            found["payload"] = f"computed by {_qualname(self.payload)}"
        return found

    @property
    def config_hash(self) -> str:
        """Stable across processes and restarts; changes when the timing or the payload does.

        A computed payload is known by its function's qualified name: changing its body keeps the
        installed runs (each carries the payload computed when it was installed).
        """
        payload = f"computed by {_qualname(self.payload)}" if callable(self.payload) else self.payload
        canonical = json.dumps(
            {
                "every_ms": None if self.every is None else self.every // dt.timedelta(milliseconds=1),
                "cron": list(self.expressions),
                "tz": self.tz,
                "payload": payload,
            },
            sort_keys=True,
            separators=(",", ":"),
            default=str,
        )
        return hashlib.sha256(canonical.encode()).hexdigest()[:HASH_LENGTH]

    def payload_for(self, due: dt.datetime) -> Any:
        """The payload of the run due at ``due``."""
        if callable(self.payload):
            return self.payload(due.astimezone(zoneinfo.ZoneInfo(self.tz)))
        return self.payload

    # -- when it runs -----------------------------------------------------------------------------
    def runs_after(self, after: dt.datetime, count: int) -> list[dt.datetime]:
        """The next ``count`` due times strictly after ``after`` (aware, UTC)."""
        if self.every is not None:
            step = self.every
            first = EPOCH + step * ((after - EPOCH) // step + 1)
            return [first + step * i for i in range(count)]
        zone = zoneinfo.ZoneInfo(self.tz)
        found: set[dt.datetime] = set()
        for expression in self.expressions:
            it = cronsim.CronSim(expression, after.astimezone(zone))
            for _ in range(count):
                found.add(next(it).astimezone(dt.UTC))
        return sorted(t for t in found if t > after)[:count]

    def run_before(self, before: dt.datetime) -> dt.datetime | None:
        """The latest due time at or before ``before`` (aware, UTC)."""
        if self.every is not None:
            return EPOCH + self.every * ((before - EPOCH) // self.every)
        zone = zoneinfo.ZoneInfo(self.tz)
        start = (before + dt.timedelta(seconds=1)).astimezone(zone)
        found = [next(cronsim.CronSim(e, start, reverse=True)).astimezone(dt.UTC) for e in self.expressions]
        return max((t for t in found if t <= before), default=None)

    def upcoming(self, now: dt.datetime) -> list[dt.datetime]:
        """The runs the look-ahead keeps installed at ``now``: strictly after it."""
        if isinstance(self.ahead, int):
            return self.runs_after(now, self.ahead)
        runs = self.runs_after(now, MAX_AHEAD_RUNS)
        within = [t for t in runs if t <= now + self.ahead]
        return within or runs[:1]

    def period(self, now: dt.datetime) -> dt.timedelta:
        """The gap between the next two runs: the refresh interval is a quarter of it (or of the look-ahead)."""
        first, second = self.runs_after(now, 2)
        gap = second - first
        return min(gap, self.ahead) if isinstance(self.ahead, dt.timedelta) else gap


def _qualname(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


class Installed(NamedTuple):
    """What one install did."""

    now: dt.datetime
    """The database's time in the install transaction."""
    outcomes: list[OfferOutcome]
    """One per run offered: CREATED, or IGNORED (it existed, or was not strictly in the future)."""
    coalesced: int
    """Missed runs deleted in favour of the latest."""
    reinstalled: bool
    """The schedule's record was gone although this service had installed it: someone uninstalled it."""


class CronService:
    """Installs and refreshes recurring messages in ``queue``.

    ``install(schedule)`` (or ``install_periodic`` / ``install_daily`` / ``install_cron``) registers a
    schedule and installs its next runs at once; ``declare(schedule)`` only registers it. ``start()``
    keeps the registered schedules installed from a background thread (each at a quarter of its period,
    at least every ``max_refresh``); ``refresh()`` does one round by hand.
    """

    def __init__(self, queue: DelayedQueue, *, max_refresh: dt.timedelta = dt.timedelta(minutes=15)) -> None:
        self.queue = queue
        self.max_refresh = max_refresh
        self.min_refresh = dt.timedelta(seconds=1)
        self._schedules: dict[str, Schedule] = {}
        self._installed: set[str] = set()  # names whose record this service wrote and has not uninstalled
        self._lock = threading.Lock()  # guards the two above
        self._install_lock = threading.Lock()  # one install or uninstall of this service at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_now: dt.datetime | None = None
        self._failed = False

    # -- the primitives (seed 001) --------------------------------------------------------------
    def install_tick(
        self, prefix: str, config_hash: str, messages: Sequence[tuple[dt.datetime, Any]]
    ) -> list[OfferOutcome]:
        """In one transaction: delete the schedule ``prefix``'s runs of other configurations, offer these.

        A run is created only if its due time is strictly after the database's now (else IGNORED).
        """
        check_name(prefix)
        if not re.fullmatch(r"[0-9A-Za-z_-]{1,32}", config_hash):
            raise InvalidInputError("a config hash is 1 to 32 letters, digits, '-' or '_'")
        runs = [(to_ms(require_aware(due, "due"), "due"), payload) for due, payload in messages]
        encoded = [(due, encode(self.queue.serializer, payload)) for due, payload in runs]

        def op(conn: Connection) -> list[OfferOutcome]:
            store = _Store(self.queue, conn)
            now = store.now_ms()
            store.delete_other_configs(prefix, config_hash)
            return store.offer_runs(prefix, config_hash, encoded, now)

        return self.queue.run(op)

    def uninstall(self, prefix: str, config_hash: str | None = None) -> int:
        """Delete a schedule's record and its pending runs (only one configuration's, given its hash),
        in one transaction; returns how many runs. This service stops refreshing it."""
        name = check_name(prefix)
        with self._install_lock:
            with self._lock:
                self._schedules.pop(name, None)
                self._installed.discard(name)
            return uninstall(self.queue, name, config_hash)

    # -- schedules ------------------------------------------------------------------------------
    def install(self, schedule: Schedule) -> Schedule:
        """Register ``schedule`` and install its upcoming runs now (errors are raised here)."""
        with self._install_lock:
            self._install(schedule)
            with self._lock:
                self._schedules[schedule.name] = schedule
        return schedule

    def declare(self, schedule: Schedule) -> Schedule:
        """Register ``schedule``; the next ``refresh()`` (the background thread's first) installs it."""
        check_name(schedule.name)
        with self._lock:
            self._schedules[schedule.name] = schedule
        return schedule

    def install_periodic(self, prefix: str, *, every: dt.timedelta, payload: Payload = None) -> Schedule:
        """``install(Schedule.periodic(...))``: run every ``every``, aligned to the epoch."""
        return self.install(Schedule.periodic(prefix, every, payload=payload))

    def install_daily(
        self, prefix: str, *, at: Iterable[dt.time], tz: str = "UTC", payload: Payload = None
    ) -> Schedule:
        """``install(Schedule.daily(...))``: run every day at the wall-clock times ``at`` in ``tz``."""
        return self.install(Schedule.daily(prefix, at, tz=tz, payload=payload))

    def install_cron(self, prefix: str, expression: str, *, tz: str = "UTC", payload: Payload = None) -> Schedule:
        """``install(Schedule.cron(...))``: run on a cron expression in time zone ``tz``."""
        return self.install(Schedule.cron(prefix, expression, tz=tz, payload=payload))

    def schedules(self) -> list[Schedule]:
        """The schedules this service keeps installed."""
        with self._lock:
            return list(self._schedules.values())

    def refresh(self) -> None:
        """Install every registered schedule's upcoming runs now (what the background thread does)."""
        for schedule in self.schedules():
            with self._install_lock:
                with self._lock:  # uninstalled meanwhile (by this service): leave it uninstalled
                    if self._schedules.get(schedule.name) is not schedule:
                        continue
                self._install(schedule)

    # -- the background thread ------------------------------------------------------------------
    def start(self) -> None:
        """Refresh the schedules from a background thread until ``stop()``; the first round at once."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="delayq-cron", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the background thread (after the install under way, if any)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
                self._failed = False
            except Exception as exc:  # a background loop survives anything: log, try again soon
                self._failed = True
                log.warning("cron refresh of queue %s failed (%s); trying again soon", self.queue.name, exc)
            self._stop.wait(self.refresh_interval().total_seconds())

    def refresh_interval(self) -> dt.timedelta:
        """How long the background thread waits between rounds: a quarter of the shortest period or
        look-ahead, between ``min_refresh`` and ``max_refresh`` (``min_refresh`` after a failure)."""
        if self._failed:
            return self.min_refresh
        now = self._last_now
        periods = [s.period(now) / 4 for s in self.schedules()] if now is not None else []
        return max(self.min_refresh, min([self.max_refresh, *periods]))

    # -- internals ------------------------------------------------------------------------------
    def _install(self, schedule: Schedule) -> Installed:
        with self._lock:
            known = schedule.name in self._installed
        installed = install_schedule(self.queue, schedule, known=known)
        with self._lock:
            self._installed.add(schedule.name)
        self._last_now = installed.now
        if installed.reinstalled:
            log.warning(
                "cron %s in queue %s was uninstalled, but this process still declares it: re-installing it "
                "(remove it from the declarations to keep it uninstalled)",
                schedule.name,
                self.queue.name,
            )
        if installed.coalesced:
            log.info("cron %s: %d missed run(s) coalesced into the latest", schedule.name, installed.coalesced)
        return installed


# -- the install and uninstall transactions -----------------------------------------------------------
def install_schedule(queue: DelayedQueue, schedule: Schedule, *, known: bool = False) -> Installed:
    """Install ``schedule``'s upcoming runs in ``queue``, in one transaction on the database's clock.

    ``known``: the caller installed it before, so a missing record means someone uninstalled it.
    """
    config = schedule.config_hash
    definition = json.dumps(schedule.definition, sort_keys=True)

    def op(conn: Connection) -> Installed:
        store = _Store(queue, conn)
        record = store.lock_record(schedule.name)  # first: serialises with uninstall and other refreshers
        now_ms = store.now_ms()
        now = from_ms(now_ms)
        runs = schedule.upcoming(now)
        encoded = [(to_ms(due), encode(queue.serializer, schedule.payload_for(due))) for due in runs]
        store.delete_other_configs(schedule.name, config)
        store.delete_legacy_runs(schedule.name, now_ms)
        covered = record.installed_until if record is not None and record.config_hash == config else None
        outcomes = store.offer_runs(schedule.name, config, encoded, now_ms, covered)
        coalesced = queue.coalesce_overdue(run_prefix(schedule.name, config), now, using=conn)
        until = max(encoded[-1][0], covered or 0)
        store.save_record(schedule.name, record, definition, config, now_ms, until)
        return Installed(now, outcomes, coalesced, record is None and known)

    attempt = 0
    while True:
        try:
            return queue.run(op)
        except IntegrityError as exc:  # two first installs raced to create the record: again, as an update
            attempt += 1
            if attempt >= 3 or not dialect_for(queue.engine).is_duplicate_key(exc):
                raise


def uninstall(queue: DelayedQueue, name: str, config_hash: str | None = None) -> int:
    """Delete schedule ``name``'s record and runs in ``queue`` (one configuration's runs, given its hash).

    One transaction: the record goes first, so an install under way elsewhere either finished before
    (and its runs are deleted here) or starts after (and finds the record gone: it logs a warning).
    """
    check_name(name)

    def op(conn: Connection) -> int:
        store = _Store(queue, conn)
        record = store.lock_record(name)
        if record is not None and (config_hash is None or record.config_hash == config_hash):
            store.delete_record(name)
        prefix = schedule_prefix(name) if config_hash is None else run_prefix(name, config_hash)
        deleted = queue.cancel_prefix(prefix, using=conn)
        return deleted + store.delete_legacy_runs(name, None, config_hash)

    return queue.run(op)


class _Store:
    """The statements of one install or uninstall, on the caller's connection."""

    def __init__(self, queue: DelayedQueue, conn: Connection) -> None:
        self.queue = queue
        self.conn = conn
        self.dialect: Dialect = dialect_for(queue.engine)
        self.stmts: Statements = self.dialect.statements(queue.tables, queue.clock is not None, queue.notify)

    def now_ms(self) -> int:
        """Now, read in this transaction: the queue's clock if it has one, else the database's."""
        if self.queue.clock is not None:
            return to_ms(self.queue.clock.now())
        return int(self.conn.execute(self.stmts.now_select).scalar_one())

    def lock_record(self, name: str) -> Any:
        return self.conn.execute(self.stmts.memo(_record_for_update), self._keyed(name)).first()

    def save_record(self, name: str, record: Any, definition: str, config: str, now_ms: int, until: int | None) -> None:
        values = {
            **self._keyed(name),
            "definition": definition,
            "config_hash": config,
            "refreshed_at": now_ms,
            "refreshed_by": _host(),
            "installed_until": until,
        }
        if record is None:
            self.conn.execute(self.stmts.memo(_record_insert), {**values, "installed_at": now_ms})
        else:
            since = record.installed_at if record.config_hash == config else now_ms
            self.conn.execute(self.stmts.memo(_record_update), {**values, "installed_at": since})

    def delete_record(self, name: str) -> None:
        self.conn.execute(self.stmts.memo(_record_delete), self._keyed(name))

    def delete_other_configs(self, name: str, config: str) -> int:
        return self.queue.cancel_prefix(schedule_prefix(name), keep_prefix=run_prefix(name, config), using=self.conn)

    def offer_runs(
        self, name: str, config: str, runs: Sequence[tuple[int, bytes]], now_ms: int, floor_ms: int | None = None
    ) -> list[OfferOutcome]:
        """Insert the runs whose keys do not exist and that are due strictly after ``now_ms`` (read in
        this transaction) and after ``floor_ms`` (what an earlier install of this configuration covered:
        a run up to there was installed once already, so if it is missing it was consumed or cancelled)."""
        keys = [run_key_ms(name, config, due) for due, _ in runs]
        if not keys:
            return []
        floor = max(now_ms, floor_ms if floor_ms is not None else now_ms)
        params = {"queue_name": self.queue.name, "keys": keys}
        existing = set(self.conn.execute(self.stmts.existing_keys, params).scalars())
        outcomes = []
        for key, (due, payload) in zip(keys, runs, strict=True):
            created = False
            if key not in existing and due > floor:
                row = {
                    "queue_name": self.queue.name,
                    "msg_key": key,
                    "payload": payload,
                    "payload_type": self.queue.serializer.type_tag,
                    "due_at": due,
                    "due_in": None,
                    **self._now_param(now_ms),
                }
                created = self.dialect.insert_if_absent(self.conn, self.stmts, row)
            outcomes.append(OfferOutcome.CREATED if created else OfferOutcome.IGNORED)
        return outcomes

    def delete_legacy_runs(self, name: str, now_ms: int | None, config: str | None = None) -> int:
        """Delete runs of ``name`` in the key shape before ``NAMESPACE`` (``{name}/{hash}/{due_ms}``).

        Matched exactly by that shape, never by bare prefix: an ordinary ``{name}/user-42`` stays.
        With ``now_ms``, only those due after it that nobody has started (an install re-creates them
        in the new shape); the others are consumed as they are.
        """
        m = self.queue.tables.messages
        params = {"queue_name": self.queue.name, **_legacy_bounds(name)}
        ids = []
        for row in self.conn.execute(self.stmts.memo(_legacy_candidates), params):
            match = LEGACY_KEY.fullmatch(row.key)
            if match is None or match["name"] != name or (config is not None and match["config"] != config):
                continue
            if now_ms is not None and not (int(match["due"]) > now_ms and row.lock_token is None and row.attempts == 0):
                continue
            ids.append(row.id)
        if not ids:
            return 0
        return int(self.conn.execute(sa.delete(m).where(m.c.id.in_(ids))).rowcount)

    def _keyed(self, name: str) -> dict[str, Any]:
        return {"queue_name": self.queue.name, "schedule_name": name}

    def _now_param(self, now_ms: int) -> dict[str, int]:
        return {"now": now_ms} if self.queue.clock is not None else {}


def _legacy_bounds(name: str) -> dict[str, str]:
    # A legacy run's key continues "{name}/" with a hex digit: "{name}/0" <= key < "{name}/g".
    return {"legacy_lo": f"{name}/0", "legacy_hi": f"{name}/g"}


# -- statements, built once per table set and clock mode (Statements.memo) ------------------------------
def _bp(name: str, type_: Any = sa.String) -> Any:
    return sa.bindparam(name, type_=type_)


def _record_where(tables: Tables) -> sa.ColumnElement[bool]:
    s = tables.schedules
    return sa.and_(s.c.queue == _bp("queue_name"), s.c.name == _bp("schedule_name"))


def _record_for_update(stmts: Statements) -> sa.Select[Any]:
    s = stmts.tables.schedules
    columns = (s.c.config_hash, s.c.installed_at, s.c.installed_until)
    return sa.select(*columns).where(_record_where(stmts.tables)).with_for_update()


def _record_values() -> dict[str, Any]:
    return {
        "definition": _bp("definition", sa.Text),
        "config_hash": _bp("config_hash"),
        "installed_at": _bp("installed_at", sa.BigInteger),
        "refreshed_at": _bp("refreshed_at", sa.BigInteger),
        "refreshed_by": _bp("refreshed_by"),
        "installed_until": _bp("installed_until", sa.BigInteger),
    }


def _record_insert(stmts: Statements) -> sa.Insert:
    values = {"queue": _bp("queue_name"), "name": _bp("schedule_name"), **_record_values()}
    return sa.insert(stmts.tables.schedules).values(values)


def _record_update(stmts: Statements) -> sa.Update:
    return sa.update(stmts.tables.schedules).where(_record_where(stmts.tables)).values(_record_values())


def _record_delete(stmts: Statements) -> sa.Delete:
    return sa.delete(stmts.tables.schedules).where(_record_where(stmts.tables))


def _legacy_candidates(stmts: Statements) -> sa.Select[Any]:
    m = stmts.tables.messages
    return sa.select(m.c.id, m.c.key, m.c.lock_token, m.c.attempts).where(
        m.c.queue == _bp("queue_name"), stmts.starts_with(m.c.key, "legacy")
    )


# -- declared next to the handlers ------------------------------------------------------------------
def schedules_for(handlers: Iterable[object]) -> list[tuple[str, Schedule]]:
    """The ``(queue, schedule)`` pairs that handlers declare in their ``schedules`` attribute.

    A schedule's runs go to its handler's queue, encoded with its handler's serializer. A name
    declared twice on one queue must be the same schedule (several handlers of one queue may
    repeat it); otherwise ``InvalidInputError``.
    """
    found: dict[tuple[str, str], Schedule] = {}
    for handler in handlers:
        declared = getattr(handler, "schedules", None) or ()
        if isinstance(declared, Schedule):
            declared = (declared,)
        for schedule in declared:
            if not isinstance(schedule, Schedule):
                raise InvalidInputError(f"{handler!r}.schedules holds {schedule!r}, not a delayq Schedule")
            queue = getattr(handler, "queue", None)
            if not isinstance(queue, str):
                raise InvalidInputError(f"{handler!r} declares schedules but no queue")
            other = found.setdefault((queue, schedule.name), schedule)
            if other != schedule:
                raise InvalidInputError(f"two different schedules named {schedule.name!r} in queue {queue!r}")
    return [(queue, schedule) for (queue, _), schedule in found.items()]


class ScheduleRunner:
    """Keeps declared schedules installed, one ``CronService`` per queue, from background threads.

    ``queues`` are the queues the schedules' runs go to (each run encoded with its queue's serializer);
    ``schedules`` the ``(queue name, schedule)`` pairs of ``schedules_for(handlers)``. ``start()``
    returns at once: the first round of installs runs in the background (a database that is down
    delays the schedules, not the worker), and is retried every ``min_refresh`` until it succeeds.
    """

    def __init__(
        self,
        queues: Iterable[DelayedQueue],
        schedules: Iterable[tuple[str, Schedule]],
        *,
        max_refresh: dt.timedelta = dt.timedelta(minutes=15),
    ) -> None:
        by_name: dict[str, DelayedQueue] = {}
        for queue in queues:
            by_name.setdefault(queue.name, queue)
        self.services: dict[str, CronService] = {}
        for queue_name, schedule in schedules:
            if queue_name not in by_name:
                raise InvalidInputError(f"schedule {schedule.name!r} is for queue {queue_name!r}, which is not given")
            service = self.services.get(queue_name)
            if service is None:
                service = self.services[queue_name] = CronService(by_name[queue_name], max_refresh=max_refresh)
            service.declare(schedule)

    def refresh(self) -> None:
        """One round of installs for every queue."""
        for service in self.services.values():
            service.refresh()

    def start(self) -> None:
        """Keep the schedules installed from background threads (one per queue) until ``stop()``."""
        for service in self.services.values():
            service.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop refreshing; installed runs stay, and other processes declaring them keep them going."""
        for service in self.services.values():
            service.stop(timeout)


# -- what is installed (delayq cron ls) ------------------------------------------------------------------
def schedule_views(
    engine: sa.Engine, conn: Connection, tables: Tables, *, queue: str | None = None, now: dt.datetime | None = None
) -> list[dict[str, Any]]:
    """Every recorded schedule (of ``queue``, or all), as ``delayq cron ls`` shows it, judged at ``now``
    (the database's time by default): definition, next runs (future ones only), last run and its state,
    who refreshed it when, and ``stalled`` when nobody did for longer than its look-ahead window."""
    s, m, dead = tables.schedules, tables.messages, tables.dead_letters
    dialect = dialect_for(engine)
    now_ms = to_ms(now) if now is not None else int(conn.execute(sa.select(dialect.now_ms())).scalar_one())
    records = sa.select(s).order_by(s.c.queue, s.c.name)
    bounds = namespace_bounds()
    runs_stmt = sa.select(m.c.queue, m.c.key, m.c.scheduled_at, m.c.lock_token, m.c.attempts).where(
        dialect.starts_with(m.c.key)
    )
    if queue is not None:
        records = records.where(s.c.queue == queue)
        runs_stmt = runs_stmt.where(m.c.queue == queue)
    runs: dict[tuple[str, str], dict[int, Any]] = {}
    for row in conn.execute(runs_stmt, bounds):
        parsed = parse_run_key(row.key)
        if parsed is not None:
            runs.setdefault((row.queue, run_prefix(parsed[0], parsed[1])), {})[parsed[2]] = row
    views = []
    for record in conn.execute(records).all():
        definition = json.loads(record.definition)
        schedule = Schedule.from_definition(record.name, definition)
        mine = runs.get((record.queue, run_prefix(record.name, record.config_hash)), {})
        future = sorted(due for due in mine if due > now_ms)
        until = record.installed_until if record.installed_until is not None else record.refreshed_at
        last_run = None
        before = schedule.run_before(from_ms(min(now_ms, until)))
        if before is not None and to_ms(before) > record.installed_at:
            due = to_ms(before)
            key = run_key_ms(record.name, record.config_hash, due)
            run = mine.get(due)
            if run is None:
                found = conn.execute(
                    sa.select(sa.func.count()).where(dead.c.queue == record.queue, dead.c.key == key)
                ).scalar_one()
                state = "dead" if found else "done"
            elif run.lock_token is not None and run.scheduled_at > now_ms:
                state = "in flight"
            else:
                state = "retrying" if run.attempts else "due"
            last_run = {"due": from_ms(due).isoformat(), "state": state, "key": key}
        views.append(
            {
                "queue": record.queue,
                "name": record.name,
                "prefix": record.name,
                "config": record.config_hash,
                "definition": definition,
                "summary": _summary(schedule),
                "next_run": from_ms(future[0]).isoformat() if future else None,
                "next_due": [from_ms(due).isoformat() for due in future[:3]],
                "last_run": last_run,
                "installed_at": from_ms(record.installed_at).isoformat(),
                "refreshed_at": from_ms(record.refreshed_at).isoformat(),
                "refreshed_by": record.refreshed_by,
                "installed_until": from_ms(until).isoformat(),
                "lookahead_s": max(0, until - record.refreshed_at) / 1000,
                "stalled": now_ms - record.refreshed_at > max(0, until - record.refreshed_at),
            }
        )
    return views


def _summary(schedule: Schedule) -> str:
    ahead = schedule.ahead if isinstance(schedule.ahead, int) else f"{schedule.ahead}"
    if schedule.every is not None:
        return f"every {schedule.every} (ahead {ahead})"
    if schedule.kind == "daily":
        times = ", ".join(f"{int(e.split()[1]):02d}:{int(e.split()[0]):02d}" for e in schedule.expressions)
        return f"daily at {times} {schedule.tz} (ahead {ahead})"
    return f"cron {' | '.join(schedule.expressions)} {schedule.tz} (ahead {ahead})"


# -- keys ---------------------------------------------------------------------------------------------
def schedule_prefix(name: str) -> str:
    """The start of every run key of schedule ``name``, of any configuration."""
    return f"{NAMESPACE}{name}/"


def run_prefix(name: str, config_hash: str) -> str:
    """The start of the run keys of one configuration of schedule ``name``."""
    return f"{NAMESPACE}{name}/{config_hash}/"


def run_key(prefix: str, config_hash: str, due: dt.datetime) -> str:
    """The key of one run: ``\\x1fcron/{name}/{config_hash}/{due_ms}``."""
    return run_key_ms(prefix, config_hash, to_ms(due))


def run_key_ms(name: str, config_hash: str, due_ms: int) -> str:
    return f"{run_prefix(name, config_hash)}{due_ms}"


def parse_run_key(key: str) -> tuple[str, str, int] | None:
    """``(name, config_hash, due_ms)`` of a run's key (either shape), or None for another key."""
    match = RUN_KEY.fullmatch(key) or LEGACY_KEY.fullmatch(key)
    return None if match is None else (match["name"], match["config"], int(match["due"]))


def namespace_bounds() -> dict[str, str]:
    """``prefix_bounds`` of ``NAMESPACE``: every run key, of every schedule."""
    return prefix_bounds(NAMESPACE)


def check_name(name: object) -> str:
    if not isinstance(name, str) or not name or "/" in name or len(name) > MAX_PREFIX_LENGTH:
        raise InvalidInputError(
            f"a cron schedule's name is a non-empty string of at most {MAX_PREFIX_LENGTH} characters "
            f"without '/', got {name!r}"
        )
    return name


check_prefix = check_name


def check_zone(tz: str) -> str:
    try:
        zoneinfo.ZoneInfo(tz)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, TypeError):
        raise InvalidInputError(f"unknown time zone {tz!r}") from None
    return tz
