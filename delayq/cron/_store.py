"""The install and uninstall transactions: a schedule's record (``{prefix}schedules``) and its runs.

Each is one transaction that locks the record first, reads now in that transaction (the queue's clock if
it has one, else the database's) and offers or deletes runs by key. ``_Store`` runs the statements.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
from collections.abc import Sequence
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from delayq.clock import from_ms, to_ms
from delayq.cron.schedule import LEGACY_KEY, Schedule, check_name, run_key_ms, run_prefix, schedule_prefix
from delayq.dialects import Statements, dialect_for
from delayq.messages import OfferOutcome
from delayq.queue import DelayedQueue
from delayq.schema import Tables
from delayq.serializers import encode


def _host() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"[:200]


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
    """One install or uninstall, on the caller's connection: the schedule's record (cron's own table, its
    statements here) and its runs (the queue's messages, through the queue's operations)."""

    def __init__(self, queue: DelayedQueue, conn: Connection) -> None:
        self.queue = queue
        self.conn = conn
        self.stmts: Statements = dialect_for(queue.engine).statements(
            queue.tables, queue.clock is not None, queue.notify
        )

    def now_ms(self) -> int:
        """Now, read in this transaction: the queue's clock if it has one, else the database's."""
        return self.queue._now_in(self.conn)

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
        existing = self.queue._existing_keys(self.conn, keys)
        outcomes = []
        for key, (due, payload) in zip(keys, runs, strict=True):
            created = (
                key not in existing and due > floor and self.queue._offer_encoded(self.conn, key, due, payload, now_ms)
            )
            outcomes.append(OfferOutcome.CREATED if created else OfferOutcome.IGNORED)
        return outcomes

    def delete_legacy_runs(self, name: str, now_ms: int | None, config: str | None = None) -> int:
        """Delete runs of ``name`` in the key shape before ``NAMESPACE`` (``{name}/{hash}/{due_ms}``).

        Matched exactly by that shape, never by bare prefix: an ordinary ``{name}/user-42`` stays.
        With ``now_ms``, only those due after it that nobody has started (an install re-creates them
        in the new shape); the others are consumed as they are.
        """
        ids = []
        # A legacy run's key continues "{name}/" with a hex digit: "{name}/0" <= key < "{name}/g".
        for row in self.queue._keys_between(self.conn, f"{name}/0", f"{name}/g"):
            match = LEGACY_KEY.fullmatch(row.key)
            if match is None or match["name"] != name or (config is not None and match["config"] != config):
                continue
            if now_ms is not None and not (int(match["due"]) > now_ms and row.lock_token is None and row.attempts == 0):
                continue
            ids.append(row.id)
        return self.queue._delete_ids(self.conn, ids)

    def _keyed(self, name: str) -> dict[str, Any]:
        return {"queue_name": self.queue.name, "schedule_name": name}


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
