"""CronService keeps schedules installed from a background thread; ScheduleRunner does it for the
schedules that handlers declare (``schedules_for``), one service per queue."""

from __future__ import annotations

import datetime as dt
import logging
import re
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy.engine import Connection

from delayq.clock import require_aware, to_ms
from delayq.cron._store import Installed, _Store, install_schedule, uninstall
from delayq.cron.schedule import Payload, Schedule, check_name
from delayq.errors import InvalidInputError
from delayq.messages import OfferOutcome
from delayq.queue import DelayedQueue
from delayq.serializers import encode
from delayq.transactions import check_api

log = logging.getLogger("delayq.cron")


class CronService:
    """Installs and refreshes recurring messages in ``queue``.

    ``install(schedule)`` (or ``install_periodic`` / ``install_daily`` / ``install_cron``) registers a
    schedule and installs its next runs at once; ``declare(schedule)`` only registers it. ``start()``
    keeps the registered schedules installed from a background thread (each at a quarter of its period,
    at least every ``max_refresh``); ``refresh()`` does one round by hand.
    """

    def __init__(self, queue: DelayedQueue, *, max_refresh: dt.timedelta = dt.timedelta(minutes=15)) -> None:
        check_api(queue, "CronService")
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
