"""CronService: recurring messages kept installed in a DelayedQueue, safely from any number of processes.

The database rows are the schedule. Each run of a schedule is a message keyed
``{prefix}/{config_hash}/{due_ms}``: processes that install the same schedule offer the same keys, so a
run exists once however many install it, and none is lost when one of them dies. The config hash comes
from the schedule's definition; installing a changed definition deletes the old configuration's pending
runs and offers the new ones in one transaction.

Missed runs coalesce: when runs were missed (no consumer, or no scheduler, for a while), a refresh keeps
only the latest overdue run of a schedule and cancels the older ones that nobody has started, so a long
outage yields one catch-up run, not a flood.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import threading
import zoneinfo
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import cronsim
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

from delayq.clock import EPOCH, require_aware, to_ms
from delayq.errors import DelayqError, InvalidInputError
from delayq.messages import OfferOutcome
from delayq.queue import DelayedQueue, check_key
from delayq.serializers import encode

log = logging.getLogger("delayq.cron")

AHEAD = 4
"""How many upcoming runs of each schedule are kept installed."""
HASH_LENGTH = 12
MAX_PREFIX_LENGTH = 150


@dataclass(frozen=True)
class Schedule:
    """A recurring message: a prefix, a payload, and when it runs. Built by the ``install_*`` methods."""

    prefix: str
    payload: Any
    every: dt.timedelta | None = None
    expressions: tuple[str, ...] = ()
    tz: str = "UTC"
    ahead: int = AHEAD
    definition: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def config_hash(self) -> str:
        """Stable across processes and restarts; changes when the definition or payload does."""
        canonical = json.dumps(
            {
                "every_ms": None if self.every is None else self.every // dt.timedelta(milliseconds=1),
                "cron": list(self.expressions),
                "tz": self.tz,
                "payload": self.payload,
            },
            sort_keys=True,
            separators=(",", ":"),
            default=str,
        )
        return hashlib.sha256(canonical.encode()).hexdigest()[:HASH_LENGTH]

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

    def period(self, now: dt.datetime) -> dt.timedelta:
        """The gap between the next two runs: the refresh interval is a quarter of it."""
        first, second = self.runs_after(now, 2)
        return second - first


class CronService:
    """Installs and refreshes recurring messages in ``queue``.

    ``install_periodic`` / ``install_daily`` / ``install_cron`` register a schedule and install its next
    runs at once; ``start()`` keeps them installed from a background thread (refreshing each at a quarter
    of its period, at least every ``max_refresh``), ``refresh()`` does one round by hand.
    """

    def __init__(self, queue: DelayedQueue, *, max_refresh: dt.timedelta = dt.timedelta(minutes=15)) -> None:
        self.queue = queue
        self.max_refresh = max_refresh
        self._schedules: dict[str, Schedule] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the primitives (seed 001) --------------------------------------------------------------
    def install_tick(
        self, prefix: str, config_hash: str, messages: Sequence[tuple[dt.datetime, Any]]
    ) -> list[OfferOutcome]:
        """In one transaction: delete the prefix's messages of other configurations, offer these."""
        check_prefix(prefix)
        items = [(run_key(prefix, config_hash, due), payload, require_aware(due, "due")) for due, payload in messages]

        def op(conn: Connection) -> list[OfferOutcome]:
            self.queue.cancel_prefix(f"{prefix}/", keep_prefix=f"{prefix}/{config_hash}/", using=conn)
            return self.queue.offer_many(items, using=conn)

        return self.queue.run(op)

    def uninstall(self, prefix: str, config_hash: str | None = None) -> int:
        """Delete a configuration's pending runs (every configuration's without a hash); returns how many."""
        check_prefix(prefix)
        with self._lock:
            self._schedules.pop(prefix, None)
        return self.queue.cancel_prefix(f"{prefix}/" if config_hash is None else f"{prefix}/{config_hash}/")

    # -- schedules ------------------------------------------------------------------------------
    def install_periodic(self, prefix: str, *, every: dt.timedelta, payload: Any = None) -> Schedule:
        """Run every ``every``, aligned to the epoch (so every process computes the same times)."""
        if not isinstance(every, dt.timedelta) or every < dt.timedelta(seconds=1):
            raise InvalidInputError("every must be a timedelta of at least one second")
        return self._install(Schedule(prefix, payload, every=every))

    def install_daily(self, prefix: str, *, at: Iterable[dt.time], tz: str = "UTC", payload: Any = None) -> Schedule:
        """Run every day at the wall-clock times ``at`` in time zone ``tz``.

        A time that does not exist on a spring-forward day runs at the first minute after the gap;
        one that occurs twice on a fall-back day runs once, at the first occurrence.
        """
        times = sorted(set(at))
        if not times or any(t.second or t.microsecond or t.tzinfo for t in times):
            raise InvalidInputError("at takes one or more naive times with whole minutes, e.g. time(2, 30)")
        return self._install(
            Schedule(prefix, payload, expressions=tuple(f"{t.minute} {t.hour} * * *" for t in times), tz=check_zone(tz))
        )

    def install_cron(self, prefix: str, expression: str, *, tz: str = "UTC", payload: Any = None) -> Schedule:
        """Run on a cron expression (five fields, parsed by cronsim) in time zone ``tz``."""
        try:
            cronsim.CronSim(expression, dt.datetime.now(dt.UTC))
        except cronsim.CronSimError as exc:
            raise InvalidInputError(f"bad cron expression {expression!r}: {exc}") from None
        return self._install(Schedule(prefix, payload, expressions=(expression,), tz=check_zone(tz)))

    def schedules(self) -> list[Schedule]:
        """The schedules this service keeps installed."""
        with self._lock:
            return list(self._schedules.values())

    def refresh(self) -> None:
        """Install every registered schedule's upcoming runs now (what the background thread does)."""
        for schedule in self.schedules():
            self._refresh(schedule)

    # -- the background thread ------------------------------------------------------------------
    def start(self) -> None:
        """Refresh the schedules from a background thread until ``stop()``."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="delayq-cron", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
            except (DBAPIError, DelayqError) as exc:
                log.warning("cron refresh failed (%s); trying again at the next round", exc)
            self._stop.wait(self._refresh_interval().total_seconds())

    def _refresh_interval(self) -> dt.timedelta:
        now = self._now()
        periods = [s.period(now) / 4 for s in self.schedules()]
        return max(dt.timedelta(seconds=1), min([self.max_refresh, *periods]))

    # -- internals ------------------------------------------------------------------------------
    def _install(self, schedule: Schedule) -> Schedule:
        check_prefix(schedule.prefix)
        encode(self.queue.serializer, schedule.payload)  # fail now, not in the background thread
        self._refresh(schedule)
        with self._lock:
            self._schedules[schedule.prefix] = schedule
        return schedule

    def _refresh(self, schedule: Schedule) -> None:
        now = self._now()
        config = schedule.config_hash
        runs = [(due, schedule.payload) for due in schedule.runs_after(now, schedule.ahead)]
        self.install_tick(schedule.prefix, config, runs)
        dropped = self.queue.coalesce_overdue(f"{schedule.prefix}/{config}/", now)
        if dropped:
            log.info("cron %s: %d missed run(s) coalesced into the latest", schedule.prefix, dropped)

    def _now(self) -> dt.datetime:
        return self.queue.clock.now() if self.queue.clock is not None else dt.datetime.now(dt.UTC)


def run_key(prefix: str, config_hash: str, due: dt.datetime) -> str:
    """The key of one run: ``{prefix}/{config_hash}/{due_ms}``."""
    return check_key(f"{prefix}/{config_hash}/{to_ms(due)}")


def check_prefix(prefix: object) -> str:
    if not isinstance(prefix, str) or not prefix or "/" in prefix or len(prefix) > MAX_PREFIX_LENGTH:
        raise InvalidInputError(
            f"a cron prefix is a non-empty string of at most {MAX_PREFIX_LENGTH} characters without '/', got {prefix!r}"
        )
    return prefix


def check_zone(tz: str) -> str:
    try:
        zoneinfo.ZoneInfo(tz)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise InvalidInputError(f"unknown time zone {tz!r}") from None
    return tz
