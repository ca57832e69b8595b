"""Bulk actions on a filter: cancel, requeue, purge or reschedule the rows of one queue that match a state, a key
prefix and a tag, in bounded batches; and count them.

The state names the table (``STATES``): a live state (``ready``, ``scheduled``, ``in-flight``, ``expired-lock``;
``all``: every live message not running; None: every live message) the messages, ``dead`` the dead letters,
``completed`` and ``cancelled`` the kept finished rows. The key prefix compares byte for byte (``starts_with``),
the tag as ``stats(tag=)`` does.

An action walks the matching rows by keyset in key order (the (queue, key) indexes; the newest id first within a
key), one batch per transaction:

1. the next ``batch_size`` matching rows after the last one seen: their ids, read without a lock;
2. those that still match, locked ``FOR UPDATE SKIP LOCKED``: a row another transaction holds (a worker's claim
   under way, an operator's open transaction) is skipped, never waited for;
3. the action on the rows locked, by id;
4. of the rows left, those that still match are counted as skipped (``BulkOutcome.skipped``: held by another
   transaction; run the action again once it ends).

No statement reaches past its batch, and each batch commits before the next begins: an action interrupted
half-way leaves its done batches done, and running it again finishes the rest. SQLite locks no rows: a batch
begins with ``BEGIN IMMEDIATE``, waits for the database's one writer (its busy timeout, then delayq's transient
retries), and raises when that writer holds on longer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from delayq.dialects import Dialect, Statements
from delayq.dialects.base import prefix_bounds
from delayq.errors import InvalidInputError
from delayq.queue import _cancel as cancel_sql
from delayq.queue import _views
from delayq.queue._checks import At, _due, check_prefix
from delayq.queue._dead import _DeadLetters
from delayq.queue._lifecycle import lifecycle_sql
from delayq.queue._queued import _Queued
from delayq.tags import tag_pattern
from delayq.transactions import Using

BULK_BATCH = 500
"""Rows per batch (and per transaction) of a bulk action, by default."""
MAX_BATCH = 10_000
"""The largest ``batch_size`` a bulk action takes."""

LIVE_STATES = (*_views.STATES, "all")
"""The filter's states of live messages (the listing's); ``all`` is every one not running (ready, scheduled,
expired-lock)."""
KEPT_STATES = _views.KEPT_STATES
STATES = (*LIVE_STATES, "dead", *KEPT_STATES)
"""Every state a filter takes: the listing's (``delayq.browse.State``) and ``all``."""


@dataclass(frozen=True)
class BulkOutcome:
    """What a bulk action did (``DelayedQueue.cancel_matching``, ``purge``, ...): ``done`` rows acted on, and
    ``skipped`` rows that matched but another transaction held (a claim under way, an open transaction): they
    were left as they were; run the action again to act on them."""

    done: int
    skipped: int = 0


@dataclass(frozen=True)
class _Filter:
    """A checked filter: the table it reads (``live``, ``dead``, ``kept``), its state, prefix and tag."""

    table: str
    state: str | None
    key_prefix: str | None
    tag: str | None

    @property
    def shape(self) -> tuple[str, str | None, bool, bool]:
        """What its statements are built from (their bind values aside)."""
        return self.table, self.state, self.key_prefix is not None, self.tag is not None

    def params(self, queue: str) -> dict[str, Any]:
        found: dict[str, Any] = {"queue_name": queue}
        if self.key_prefix is not None:
            found.update(prefix_bounds(self.key_prefix))
        if self.tag is not None:
            found["tag_pattern"] = tag_pattern(self.tag)
        return found


def _check(
    state: str | None, key_prefix: str | None, tag: str | None, allowed: tuple[str | None, ...], refused: str = ""
) -> _Filter:
    """The filter of ``state``, ``key_prefix`` and ``tag`` when ``state`` is one of ``allowed``; else one line:
    ``refused`` for a known state the action does not take."""
    if state is not None and state not in STATES:
        raise InvalidInputError(f"no such state {str(state)[:40]!r}: use one of {', '.join(STATES)}")
    if state not in allowed:
        shown = "no state" if state is None else f"state {state!r}"
        raise InvalidInputError(refused or f"{shown} is not for this action: use one of {', '.join(map(str, allowed))}")
    prefix = None if key_prefix is None else check_prefix(key_prefix)
    if tag is not None:
        tag_pattern(tag)  # (raises on a bad tag)
    table = "dead" if state == "dead" else "kept" if state in KEPT_STATES else "live"
    return _Filter(table, state, prefix, tag)


BulkAction = Literal["cancel", "reschedule", "requeue", "purge"]
_TAKES: dict[str | None, tuple[tuple[str | None, ...], str]] = {
    None: ((None, *STATES), ""),
    "cancel": ((None, *LIVE_STATES), "{state} messages are not cancelled: purge them"),
    "reschedule": (
        (None, "ready", "scheduled", "expired-lock", "all"),
        "running messages are not rescheduled in bulk (their handlers would lose their locks): cancel them",
    ),
    "requeue": (("dead",), "only dead letters are requeued"),
    "purge": (
        tuple(s for s in STATES if s != "in-flight"),
        "running messages are not purged: cancel them (they are told), e.g. cancel_matching(state='in-flight')",
    ),
}
"""What each bulk action (None: a count) takes as its state, and the line that refuses another known state."""
_DEFAULT_STATE: dict[str | None, str] = {"reschedule": "all", "requeue": "dead"}
"""The state an action's filter means when given none (the others: every live message)."""


def _filter_for(action: str | None, state: str | None, key_prefix: str | None, tag: str | None) -> _Filter:
    """The checked filter of ``action`` (None: a count of any state)."""
    if action not in _TAKES:
        raise InvalidInputError(
            f"no such bulk action {str(action)[:40]!r}: use one of cancel, reschedule, requeue, purge"
        )
    allowed, refused = _TAKES[action]
    return _check(state or _DEFAULT_STATE.get(action or ""), key_prefix, tag, allowed, refused.format(state=state))


def _check_batch(batch_size: int) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= MAX_BATCH:
        raise InvalidInputError(f"batch_size must be a whole number from 1 to {MAX_BATCH}, got {batch_size!r}")
    return batch_size


# -- the statements, built once per shape (``Statements.memo``) ------------------------------------------------
def _table(stmts: Statements, table: str) -> sa.Table:
    t = stmts.tables
    return t.dead_letters if table == "dead" else t.finished if table == "kept" else t.messages


def _matching(stmts: Statements, table: str, state: str | None, by_prefix: bool, by_tag: bool) -> list[Any]:
    """The filter's conditions (bound: ``queue_name``, ``prefix_lo`` / ``prefix_hi``, ``tag_pattern``)."""
    t = _table(stmts, table)
    where: list[Any] = [t.c.queue == sa.bindparam("queue_name", type_=sa.String)]
    if table == "live" and state is not None:
        due, locked = t.c.scheduled_at <= stmts.now, t.c.lock_token.is_not(None)
        where.append(
            {
                "ready": sa.and_(due, ~locked),
                "scheduled": sa.and_(~due, ~locked),
                "in-flight": sa.and_(~due, locked),
                "expired-lock": sa.and_(due, locked),
                "all": sa.or_(due, ~locked),  # not running
            }[state]
        )
    if table == "kept":
        where.append(t.c.state == KEPT_STATES[state or ""])
    if by_prefix:
        where.append(stmts.starts_with(t.c.key))
    if by_tag:  # (``delayq.tags.tag_pattern``: ``_`` escaped with ``!``)
        where.append(t.c.tags.like(sa.bindparam("tag_pattern", type_=sa.String), escape="!"))
    return where


def _next_rows(stmts: Statements, shape: tuple[str, str | None, bool, bool], paged: bool) -> sa.Select[Any]:
    """Step 1: the ids and keys of the next ``:limit`` matching rows, in key order (after ``:after_key`` /
    ``:after_id`` when ``paged``)."""
    t = _table(stmts, shape[0])
    key = stmts.kind.bytewise(t.c.key)
    stmt = sa.select(t.c.id, t.c.key).where(*_matching(stmts, *shape))
    if paged:
        after_key, after_id = sa.bindparam("after_key", type_=sa.String), sa.bindparam("after_id", type_=sa.BigInteger)
        stmt = stmt.where(key >= after_key, sa.or_(key > after_key, t.c.id < after_id))
    return stmt.order_by(key, t.c.id.desc()).limit(sa.bindparam("limit", type_=sa.Integer))


def _lock_rows(stmts: Statements, dialect: Dialect, shape: tuple[str, str | None, bool, bool], full: bool) -> Any:
    """Step 2: of the rows ``:ids``, those that still match, locked unless another transaction holds them. ``full``:
    every column (and "now"), for an action that moves rows; else their ids."""
    t = _table(stmts, shape[0])
    if not full:
        columns: list[Any] = [t.c.id]
    elif shape[0] == "live":  # (what a cancel reads: ``delayq.queue._cancel``)
        columns = list(stmts.memo(cancel_sql.statements).lock_by_key.selected_columns)
    else:
        columns = [t]
    where = [dialect.id_in(t.c.id), *_matching(stmts, *shape)]
    return sa.select(*columns).where(*where).order_by(stmts.kind.bytewise(t.c.key), t.c.id.desc())


def _locking(stmts: Statements, dialect: Dialect, shape: tuple[str, str | None, bool, bool], full: bool) -> Any:
    return _lock_rows(stmts, dialect, shape, full).with_for_update(skip_locked=True)


def _still_matching(stmts: Statements, dialect: Dialect, shape: tuple[str, str | None, bool, bool]) -> Any:
    """Step 4: how many of the rows ``:ids`` (those not locked) still match: held by another transaction."""
    t = _table(stmts, shape[0])
    return sa.select(sa.func.count()).select_from(t).where(dialect.id_in(t.c.id), *_matching(stmts, *shape))


def _delete_ids(stmts: Statements, dialect: Dialect, table: str) -> sa.Delete:
    t = _table(stmts, table)
    return sa.delete(t).where(dialect.id_in(t.c.id))


def _reschedule_ids(stmts: Statements, dialect: Dialect) -> sa.Update:
    """Make the messages ``:ids`` due at ``:due_at`` (or ``:due_in`` from now), their locks cleared (as
    ``reschedule`` does by key)."""
    m = stmts.tables.messages
    due = sa.func.coalesce(sa.bindparam("due_at", type_=sa.BigInteger), stmts.now + sa.bindparam("due_in"))
    values = {"scheduled_at": due, "scheduled_at_initially": due, "lock_token": None}
    return sa.update(m).where(dialect.id_in(m.c.id)).values(values)


def _count(stmts: Statements, shape: tuple[str, str | None, bool, bool], bounded: bool) -> sa.Select[Any]:
    """How many rows match; ``bounded``: at most ``:at_most`` of them are read."""
    t = _table(stmts, shape[0])
    if not bounded:
        return sa.select(sa.func.count()).select_from(t).where(*_matching(stmts, *shape))
    picked = sa.select(t.c.id).where(*_matching(stmts, *shape)).limit(sa.bindparam("at_most", type_=sa.Integer))
    return sa.select(sa.func.count()).select_from(picked.subquery())


# -- the walk -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Batch:
    """What one batch did, and where the next starts (None: the walk is over)."""

    done: int
    skipped: int
    after: tuple[str, int] | None


Act = Callable[[Connection, Dialect, list[Any]], int]
"""An action on the rows a batch locked (in its transaction); how many it acted on."""


class Walk:
    """One bulk action's progress: ``batch`` runs one batch in a transaction (changing nothing here, so a retried
    transaction runs it again whole); ``advance`` takes its result once it committed."""

    def __init__(self, queue: _Bulk, flt: _Filter, act: Act, full: bool, batch_size: int) -> None:
        self.queue, self.filter, self.act, self.full = queue, flt, act, full
        self.batch_size = _check_batch(batch_size)
        self.after: tuple[str, int] | None = None
        self.outcome = BulkOutcome(0)
        self.finished = False

    def batch(self, conn: Connection, dialect: Dialect) -> _Batch:
        q, shape = self.queue, self.filter.shape
        stmts = q._statements(dialect)
        params = {**self.filter.params(q.name), **q._now_param(), "limit": self.batch_size}
        if self.after is not None:
            params.update(after_key=self.after[0], after_id=self.after[1])
        seen = conn.execute(stmts.memo(_next_rows, shape, self.after is not None), params).all()
        if not seen:
            return _Batch(0, 0, None)
        ids = [r.id for r in seen]
        locked = list(conn.execute(stmts.memo(_locking, dialect, shape, self.full), {**params, "ids": ids}))
        done = self.act(conn, dialect, locked) if locked else 0
        rest = sorted(set(ids) - {r.id for r in locked})
        skipped = 0
        if rest and dialect.row_locks:  # (SQLite's one writer locked every row of the batch)
            skipped = int(
                conn.execute(stmts.memo(_still_matching, dialect, shape), {**params, "ids": rest}).scalar_one()
            )
        last = seen[-1]
        return _Batch(done, skipped, (last.key, int(last.id)) if len(seen) == self.batch_size else None)

    def advance(self, b: _Batch) -> None:
        self.outcome = BulkOutcome(self.outcome.done + b.done, self.outcome.skipped + b.skipped)
        self.after = b.after
        self.finished = b.after is None


Progress = Callable[[BulkOutcome], None]
"""Called after each batch commits, with the totals so far."""


class _Bulk(_Queued, _DeadLetters):
    """``cancel_matching``, ``reschedule_matching``, ``requeue_dead_matching``, ``purge`` and ``count_matching`` of
    ``DelayedQueue`` (each ``*_walk`` checks its arguments and makes the walk that the sync and async twins run)."""

    def cancel_matching(
        self,
        *,
        state: str | None = None,
        key_prefix: str | None = None,
        tag: str | None = None,
        batch_size: int = BULK_BATCH,
        progress: Progress | None = None,
        using: Using = None,
    ) -> BulkOutcome:
        """Cancel every live message that matches (``state``: None for all of them; ``key_prefix``; ``tag``), as
        ``cancel_job`` cancels one: a queued one is deleted, a running one recorded as cancelled and its worker
        told. In batches of ``batch_size`` (500), each in its own transaction; a message another transaction
        holds is skipped and counted (``BulkOutcome.skipped``). ``progress`` is called after each batch with the
        totals so far."""
        return self._bulk(self._cancel_walk(state, key_prefix, tag, batch_size), progress, using)

    def _cancel_walk(self, state: str | None, key_prefix: str | None, tag: str | None, batch_size: int) -> Walk:
        flt = _filter_for("cancel", state, key_prefix, tag)
        return Walk(self, flt, self._cancel_rows, True, batch_size)

    def reschedule_matching(
        self,
        at: At = None,
        *,
        state: str | None = None,
        key_prefix: str | None = None,
        tag: str | None = None,
        batch_size: int = BULK_BATCH,
        progress: Progress | None = None,
        using: Using = None,
    ) -> BulkOutcome:
        """Make every matching live message that is not running due at ``at`` (None: now), as ``reschedule`` does
        by key (an expired lock is cleared); ``state`` None or ``all``: every one not running. In batches, as
        ``cancel_matching``."""
        return self._bulk(self._reschedule_walk(at, state, key_prefix, tag, batch_size), progress, using)

    def _reschedule_walk(
        self, at: At, state: str | None, key_prefix: str | None, tag: str | None, batch_size: int
    ) -> Walk:
        flt = _filter_for("reschedule", state, key_prefix, tag)
        due_at, due_in = _due(at)

        def act(conn: Connection, dialect: Dialect, rows: list[Any]) -> int:
            stmt = self._statements(dialect).memo(_reschedule_ids, dialect)
            conn.execute(stmt, {"ids": [r.id for r in rows], "due_at": due_at, "due_in": due_in, **self._now_param()})
            return len(rows)

        return Walk(self, flt, act, False, batch_size)

    def requeue_dead_matching(
        self,
        *,
        key_prefix: str | None = None,
        tag: str | None = None,
        batch_size: int = BULK_BATCH,
        progress: Progress | None = None,
        using: Using = None,
    ) -> BulkOutcome:
        """Move the matching dead letters back into the queue, due now, the newest of each key, as ``requeue_dead``
        does (a key a live message holds stays dead, and is not counted). In batches, as ``cancel_matching``."""
        return self._bulk(self._requeue_walk(key_prefix, tag, batch_size), progress, using)

    def _requeue_walk(self, key_prefix: str | None, tag: str | None, batch_size: int) -> Walk:
        flt = _filter_for("requeue", None, key_prefix, tag)

        def act(conn: Connection, dialect: Dialect, rows: list[Any]) -> int:
            return sum(self._requeue_row(conn, dialect, r) for r in rows)  # (newest first within a key)

        return Walk(self, flt, act, True, batch_size)

    def purge(
        self,
        *,
        state: str,
        key_prefix: str | None = None,
        tag: str | None = None,
        batch_size: int = BULK_BATCH,
        progress: Progress | None = None,
        using: Using = None,
    ) -> BulkOutcome:
        """Delete the matching rows, recording nothing: live messages (``state`` ``ready``, ``scheduled``,
        ``expired-lock``, or ``all``: every one not running), dead letters (``dead``) or kept finished messages
        (``completed``, ``cancelled``). A running message is never purged: ``cancel_matching`` cancels it and tells
        its handler. In batches, as ``cancel_matching``."""
        return self._bulk(self._purge_walk(state, key_prefix, tag, batch_size), progress, using)

    def _purge_walk(self, state: str, key_prefix: str | None, tag: str | None, batch_size: int) -> Walk:
        flt = _filter_for("purge", state, key_prefix, tag)

        def act(conn: Connection, dialect: Dialect, rows: list[Any]) -> int:
            conn.execute(self._statements(dialect).memo(_delete_ids, dialect, flt.table), {"ids": [r.id for r in rows]})
            return len(rows)

        return Walk(self, flt, act, False, batch_size)

    def count_matching(
        self,
        *,
        state: str | None = None,
        key_prefix: str | None = None,
        tag: str | None = None,
        at_most: int | None = None,
        action: BulkAction | None = None,
        using: Using = None,
    ) -> int:
        """How many rows the bulk actions' filter matches (``state`` None: every live message), in one read; with
        ``at_most``, reading at most that many (a confirmation's "at least"). With ``action`` (``cancel``,
        ``reschedule``, ``requeue``, ``purge``): what that action would act on now, its arguments checked as it
        checks them (a state it refuses raises here too; no state means what it means to it)."""
        flt = _filter_for(action, state, key_prefix, tag)
        if at_most is not None and (isinstance(at_most, bool) or not isinstance(at_most, int) or at_most < 0):
            raise InvalidInputError(f"at_most must be a whole number, zero or more, got {at_most!r}")
        params = {**flt.params(self.name), **self._now_param(), "at_most": at_most}

        def op(conn: Connection, dialect: Dialect) -> int:
            stmt = self._statements(dialect).memo(_count, flt.shape, at_most is not None)
            return int(conn.execute(stmt, params).scalar_one())

        return self._runner.run(using, op, "read")

    def _bulk(self, walk: Walk, progress: Progress | None, using: Using) -> BulkOutcome:
        while not walk.finished:
            self._bulk_batch(walk, using)
            if progress is not None:
                progress(walk.outcome)
        return walk.outcome

    def _bulk_batch(self, walk: Walk, using: Using) -> None:
        """Run the walk's next batch in a transaction (delayq's own, retried whole; or the caller's)."""
        walk.advance(self._runner.run(using, walk.batch, "transaction"))

    def _cancel_rows(self, conn: Connection, dialect: Dialect, rows: list[Any]) -> int:
        """Cancel the locked messages ``rows`` as ``cancel_job`` cancels one: each running one (or every one, where
        the queue keeps a history) recorded as cancelled, all deleted, the workers of those locked told."""
        stmts = self._statements(dialect)
        cs = stmts.memo(cancel_sql.statements)
        keeps, keep_ms = self._keeps_cancelled(), self._cancelled_retention_ms()
        recorded = [cancel_sql.cancelled_row(r, keep_ms) for r in rows if keeps or cancel_sql.running(r)]
        if recorded:
            conn.execute(cs.insert_finished, recorded)
            ls = lifecycle_sql(stmts, dialect)
            if ls.notify is not None and self.notify:  # (``wait(key)`` hears them finished)
                conn.execute(ls.notify, {"queue_name": self.name})
        conn.execute(stmts.memo(_delete_ids, dialect, "live"), {"ids": [r.id for r in rows]})
        if cs.notify is not None:  # (an expired lock's handler may run still)
            for r in rows:
                if r.lock_token is not None:
                    conn.execute(cs.notify, {"msg_id": r.id})
        return len(rows)
