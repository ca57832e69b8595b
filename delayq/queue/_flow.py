"""Flow control of a queue, kept in the database: pause and resume, and claims by priority.

Each queue whose flow was ever set has a row in ``{prefix}queue_flow``: whether it is paused, and whether
it was ever offered a priority. A claimer reads that row at most once per ``flow_refresh`` (1 s by default)
and keeps it meanwhile, so a queue that never had either costs its claims nothing: they send the same one
statement as before (docs/workers.md, "Flow control"). A paused queue's claims return nothing without a
statement, and read the row again each time, so a resume counts at the next claim.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from delayq.clock import duration_ms
from delayq.dialects import ClaimedRow, Dialect, Mode, Statements
from delayq.dialects.base import Level, at_level, candidate_rows, claim_limit
from delayq.errors import InvalidInputError
from delayq.messages import FlowState
from delayq.queue._base import _QueueBase
from delayq.queue._checks import check_text
from delayq.schema import MAX_KEY_LENGTH
from delayq.transactions import Using


def _check_limit(limit: object, what: str, none: str = "no limit") -> int | None:
    """``limit`` when None (what ``none`` says it means) or a positive integer; else ``InvalidInputError``."""
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidInputError(f"a {what} must be a positive integer or None ({none}), got {limit!r}")
    if limit > 2**31 - 1:
        raise InvalidInputError(f"a {what} must be at most {2**31 - 1}, got {limit}")
    return limit


MIN_PRIORITY = -1000
MAX_PRIORITY = 1000
"""The range of a message's priority; 0 unless an offer sets one. Higher is claimed first."""


def check_group(group: object) -> str | None:
    """Return a valid group name (or None) or raise ``InvalidInputError``."""
    if group is None:
        return None
    return check_text(group, "group", MAX_KEY_LENGTH, InvalidInputError)


def check_priority(priority: object) -> int:
    """Return a valid priority or raise ``InvalidInputError``."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidInputError(f"priority must be an int, got {type(priority).__name__}")
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidInputError(f"priority must be from {MIN_PRIORITY} to {MAX_PRIORITY}, got {priority}")
    return priority


class _FlowStatements:
    """The statements over ``{prefix}queue_flow`` and the priority claim's, built once per ``Statements``."""

    def __init__(self, stmts: Statements) -> None:
        flow, m = stmts.tables.flow, stmts.tables.messages
        queue = sa.bindparam("queue_name", type_=sa.String)
        settings = (
            flow.c.paused,
            flow.c.priorities,
            flow.c.concurrency,
            flow.c.rate,
            flow.c.rate_period_ms,
            flow.c.grouped,
            flow.c.group_concurrency,
        )
        self.read = sa.select(*settings).where(flow.c.queue == queue)
        # A limited queue's claim: its row locked (claims of the queue take turns here), with its bucket and now.
        bucket = (flow.c.tokens, flow.c.tokens_at, stmts.now.label("now"))
        self.lock = sa.select(*settings, *bucket).where(flow.c.queue == queue).with_for_update()
        self.bucket = sa.select(*settings, *bucket).where(flow.c.queue == queue)
        self.spend = (
            sa.update(flow)
            .where(flow.c.queue == queue)
            .values(tokens=sa.bindparam("new_tokens", type_=sa.Double()), tokens_at=sa.bindparam("at"))
        )
        # The queue's messages held under a lock that has not expired (an expired one no longer counts): through
        # the lock-token index, whose non-NULL entries are the held messages of all queues (a few: each is a
        # running handler's, or one whose consumer died and whose next claim is due).
        held_where = (
            m.c.lock_token.is_not(None),
            m.c.lock_token > "",  # (SQLite uses an index for a range, not for IS NOT NULL)
            # (wrapped: no index on the queue or the due time may serve this, whatever the statistics)
            sa.func.coalesce(m.c.queue, m.c.queue) == queue,
            sa.func.coalesce(m.c.scheduled_at, m.c.scheduled_at) > stmts.now,
        )
        lock_hint = f"FORCE INDEX ({m.name}_lock_ix)"
        self.running = (
            sa.select(sa.func.count().label("running"), sa.func.min(m.c.scheduled_at).label("first_expiry"))
            .with_hint(m, lock_hint, dialect_name="mysql")
            .where(*held_where)
        )
        # Per group: its messages held under an unexpired lock (the same walk of the lock-token index).
        self.running_groups = (
            sa.select(m.c.group_key, sa.func.count().label("running"))
            .with_hint(m, lock_hint, dialect_name="mysql")
            .where(*held_where, m.c.group_key.is_not(None))
            .group_by(m.c.group_key)
        )
        self.set_group = (
            sa.update(m)
            .where(m.c.queue == queue, m.c.key.in_(sa.bindparam("keys", expanding=True)))
            .values(group_key=sa.bindparam("new_group", type_=sa.String))
        )
        # The highest priority below :below among the queue's messages: one probe of the priority index (as an
        # ORDER BY … LIMIT 1, not max(): PostgreSQL's planner on stale statistics answers max() from a scan of
        # the queue's rows, while the claim's transaction, its sorting off, must walk the index for this).
        # (Priority 0 is not in the partial index: the level loop visits it between the positive and negative ones.)
        self.top_level = (
            sa.select(m.c.priority)
            .with_hint(m, f"FORCE INDEX ({m.name}_priority_ix)", dialect_name="mysql")
            .where(m.c.queue == queue, m.c.priority < sa.bindparam("below", type_=sa.Integer), m.c.priority != 0)
            .order_by(m.c.priority.desc())
            .limit(1)
        )
        # Whether any message of one level is due (held by a claim in flight or not): one probe of the index.
        self.due_at_level = {
            kind: sa.select(m.c.id)
            .with_hint(m, f"FORCE INDEX ({m.name}_priority_ix)", dialect_name="mysql")
            .where(m.c.queue == queue, m.c.scheduled_at <= stmts.now, *at_level(m, kind))
            .limit(1)
            for kind in ("zero", "nonzero")
        }
        self.set_priority = (
            sa.update(m)
            .where(m.c.queue == queue, m.c.key.in_(sa.bindparam("keys", expanding=True)))
            .values(priority=sa.bindparam("new_priority", type_=sa.Integer))
        )

    @staticmethod
    def upsert(dialect: Dialect, stmts: Statements, columns: tuple[str, ...]) -> sa.Executable:
        """Insert the queue's flow row with each of ``columns`` set to ``:v_{column}``, or set them in the row
        that exists (``ON CONFLICT … DO UPDATE`` / ``ON DUPLICATE KEY UPDATE``: one statement, no race)."""
        flow = stmts.tables.flow
        values: dict[str, Any] = {c: sa.bindparam(f"v_{c}", type_=flow.c[c].type) for c in columns}
        defaults: dict[str, Any] = {"paused": 0, "priorities": 0, **values}
        return dialect.topic_upsert(flow, ["queue"], {**values, "updated_at": stmts.now}).values(
            queue=sa.bindparam("queue_name", type_=sa.String), updated_at=stmts.now, **defaults
        )


def _flow_statements(stmts: Statements) -> _FlowStatements:
    return _FlowStatements(stmts)


def _upsert(stmts: Statements, dialect: Dialect, columns: tuple[str, ...]) -> sa.Executable:
    return _FlowStatements.upsert(dialect, stmts, columns)


def _state(row: Any) -> FlowState:
    period = None if row.rate_period_ms is None else dt.timedelta(milliseconds=int(row.rate_period_ms))
    per_group = int(row.group_concurrency or 1)
    return FlowState(
        bool(row.paused), bool(row.priorities), row.concurrency, row.rate, period, bool(row.grouped), per_group
    )


GROUP_SCAN = 500
"""How many due messages a grouped queue's claim reads (per priority level) to find those whose group has room."""


def _group_candidates(stmts: Statements, level: Level) -> sa.Select[Any]:
    """The first ``GROUP_SCAN`` due messages of ``:queue_name`` (of one priority level with ``level``), read without
    locks, in claim order: their ids and groups."""
    m = stmts.tables.messages
    index = f"{m.name}_priority_ix" if level else f"{m.name}_due_ix"
    return (
        sa.select(m.c.id, m.c.group_key)
        .with_hint(m, f"FORCE INDEX ({index})", dialect_name="mysql")
        .where(m.c.queue == sa.bindparam("queue_name", type_=sa.String), m.c.scheduled_at <= stmts.now)
        .where(*at_level(m, level))
        .order_by(m.c.scheduled_at, m.c.id)
        .limit(claim_limit(GROUP_SCAN))
    )


def _lock_picked(stmts: Statements) -> sa.Select[Any]:
    """The picked messages ``:ids`` that are still due, locked by primary key, skipping those locked elsewhere."""
    m = stmts.tables.messages
    return (
        candidate_rows(stmts)
        .where(m.c.id.in_(sa.bindparam("ids", expanding=True)), m.c.scheduled_at <= stmts.now)
        .with_for_update(skip_locked=True)
    )


def _refilled(row: Any) -> float:
    """The tokens of a rate-limited queue's bucket now: what it held at ``tokens_at``, plus ``rate`` per period
    since, at most ``rate`` (one period's worth)."""
    rate, period = int(row.rate), max(1, int(row.rate_period_ms))
    elapsed = max(0, int(row.now) - int(row.tokens_at if row.tokens_at is not None else row.now))
    return min(float(rate), float(row.tokens or 0.0) + elapsed * rate / period)


class _Flow(_QueueBase):
    """``pause``, ``resume`` and ``flow`` of ``DelayedQueue``, and the cached flow state its claims consult."""

    _flow_state: FlowState | None = None
    _flow_read_at = 0.0

    def pause(self, *, using: Using = None) -> None:
        """Pause the queue: every claimer's claims take nothing within its ``flow_refresh`` (1 s by default).

        Stored in the database (it outlives every process). Offers are still accepted; messages held
        already run to their end. ``resume`` ends it.
        """
        self._set_flow({"paused": 1}, using)

    def resume(self, *, using: Using = None) -> None:
        """End a pause: claimers take messages again at their next claim (on PostgreSQL, listening
        workers are woken at once)."""
        self._set_flow({"paused": 0}, using, wake=True)

    def set_concurrency_limit(self, limit: int | None, *, using: Using = None) -> None:
        """At most ``limit`` of this queue's messages held at once across every claimer (None: no limit).

        Counted from the database at each claim: messages held under a lock that has not expired (a
        consumer that died stops counting once its lock expires). Stored (it outlives every process);
        claimers take it up within their ``flow_refresh``. Messages held already are not taken back.
        """
        self._set_flow({"concurrency": _check_limit(limit, "concurrency limit")}, using, wake=True)

    def set_group_concurrency(self, limit: int | None, *, using: Using = None) -> None:
        """How many messages of one group (``offer(..., group=)``) may be held at once across every claimer;
        1 by default, when a group's messages run one at a time in due order. None sets that default again
        (a group is never unlimited: a message without a group is not limited)."""
        self._set_flow(
            {"group_concurrency": _check_limit(limit, "group concurrency", "the default, 1")}, using, wake=True
        )

    def set_rate_limit(
        self, limit: int | None, per: dt.timedelta = dt.timedelta(seconds=1), *, using: Using = None
    ) -> None:
        """At most ``limit`` claims of this queue's messages per ``per``, across every claimer (None: no limit).

        A token bucket in the database: ``limit`` tokens per ``per``, refilled from the database's clock
        (or the injected one), holding at most ``limit``; each claimed message takes one. Setting it
        empties the bucket, so the first ``per`` after it gives ``limit`` claims, not more.
        """
        n = _check_limit(limit, "rate limit")
        period = duration_ms(per, "per")
        if period <= 0:
            raise InvalidInputError("a rate limit's per must be positive")
        values = {"rate": n, "rate_period_ms": None if n is None else period, "tokens": 0.0}
        self._set_flow(values, using, wake=True, stamp_tokens=True)

    def flow(self, *, using: Using = None) -> FlowState:
        """The queue's flow settings as stored now (no cache)."""
        params = {"queue_name": self.name}

        def op(conn: Connection, dialect: Dialect) -> FlowState:
            row = conn.execute(self._statements(dialect).memo(_flow_statements).read, params).first()
            return FlowState() if row is None else _state(row)

        state = self._runner.run(using, op, "read")
        self._remember_flow(state)
        return state

    def _set_flow(self, values: dict[str, Any], using: Using, wake: bool = False, stamp_tokens: bool = False) -> None:
        columns = tuple(values)
        params = {"queue_name": self.name, **{f"v_{c}": v for c, v in values.items()}, **self._now_param()}

        def op(conn: Connection, dialect: Dialect) -> None:
            stmts = self._statements(dialect)
            if stamp_tokens:  # the bucket is empty as of now (database time)
                params["v_tokens_at"] = self._now_ms(conn, stmts)
            conn.execute(stmts.memo(_upsert, dialect, columns + (("tokens_at",) if stamp_tokens else ())), params)
            if wake and stmts.notify is not None:
                conn.execute(stmts.notify, params)  # wake listening workers now

        self._runner.run(using, op, "transaction")
        self._flow_state = None  # read afresh at the next claim

    def _remember_flow(self, state: FlowState) -> None:
        self._flow_state, self._flow_read_at = state, time.monotonic()

    def _cached_flow(self, using: Using = None) -> FlowState:
        """The flow state, read at most once per ``flow_refresh`` (through ``using``); while paused, at every call."""
        state = self._flow_state
        if state is None or state.paused or time.monotonic() - self._flow_read_at >= self._flow_refresh_s:
            state = self.flow(using=using)
        return state

    def _set_groups(self, conn: Connection, dialect: Dialect, keys: list[str], group: str) -> None:
        """Put the messages just offered under ``keys`` in ``group``, and mark the queue as grouped (once per
        queue object: the mark is never taken back)."""
        stmts = self._statements(dialect)
        fs = stmts.memo(_flow_statements)
        for start in range(0, len(keys), 500):
            params = {"queue_name": self.name, "keys": keys[start : start + 500], "new_group": group}
            conn.execute(fs.set_group, params)
        if not self._groups_marked:
            mark = {"queue_name": self.name, "v_grouped": 1, **self._now_param()}
            conn.execute(stmts.memo(_upsert, dialect, ("grouped",)), mark)

    _groups_marked = False
    _groups_full = False
    """The last claim found due messages, all of groups that had no room."""

    def _groups_set(self, group: str | None, using: Using) -> None:
        """After an offer in delayq's own transaction committed with ``group``: the queue's mark is stored."""
        if group is not None and not self._groups_marked and (using is None or isinstance(using, Engine)):
            self._groups_marked = True
            self._flow_state = None

    def _set_priorities(self, conn: Connection, dialect: Dialect, keys: list[str], priority: int) -> None:
        """Give the messages just offered under ``keys`` their priority, and mark the queue as having priorities
        (once per queue object: the mark is never taken back)."""
        stmts = self._statements(dialect)
        fs = stmts.memo(_flow_statements)
        for start in range(0, len(keys), 500):
            params = {"queue_name": self.name, "keys": keys[start : start + 500], "new_priority": priority}
            conn.execute(fs.set_priority, params)
        if priority and not self._priorities_marked:
            params = {"queue_name": self.name, "v_priorities": 1, **self._now_param()}
            conn.execute(stmts.memo(_upsert, dialect, ("priorities",)), params)

    _priorities_marked = False

    def _priorities_set(self, priority: int, using: Using) -> None:
        """After an offer in delayq's own transaction committed with ``priority``: the queue's mark is stored
        (see ``_set_priorities``); in the caller's, it may yet roll back, so later offers mark it again."""
        if priority and not self._priorities_marked and (using is None or isinstance(using, Engine)):
            self._priorities_marked = True
            self._flow_state = None  # this object's own claims take priorities into account at once

    def _claim_levels(
        self, conn: Connection, dialect: Dialect, stmts: Statements, params: dict[str, Any]
    ) -> list[ClaimedRow]:
        """Claim up to ``params['limit']`` due messages highest priority first: for each priority level present,
        from the top, the backend's claim restricted to that level (an index range scan of the priority index),
        until enough were claimed or no level is left."""
        fs = stmts.memo(_flow_statements)
        limit, below = params["limit"], MAX_PRIORITY + 1
        claimed: list[ClaimedRow] = []
        while len(claimed) < limit:
            level = self._next_level(conn, fs, below)
            if level is None:
                break
            kind: Level = "nonzero" if level else "zero"
            level_params = {**params, "limit": limit - len(claimed), "at_priority": level}
            got = dialect.claim(conn, stmts, level_params, self._visibility_ms, level=kind)
            claimed += got
            if len(got) < level_params["limit"] and conn.execute(fs.due_at_level[kind], level_params).first():
                # Due messages of this level are left that the claim passed by: locked by a claim running now,
                # or (MySQL/MariaDB) beyond the reads a claim makes. None of a lower level before them.
                break
            below = int(level)
        return claimed

    def _claim_flowing(
        self, conn: Connection, dialect: Dialect, stmts: Statements, params: dict[str, Any], flow: FlowState
    ) -> list[ClaimedRow]:
        """The claim of a queue with flow settings (as cached): with limits, under its flow row's lock."""
        if not flow.limited:
            return self._claim_at(conn, dialect, stmts, params, flow.priorities)
        fs = stmts.memo(_flow_statements)
        row = conn.execute(fs.lock, {"queue_name": self.name, **self._now_param()}).first()
        if row is None:
            return self._claim_at(conn, dialect, stmts, params, flow.priorities)
        if row.paused:
            return []
        n = params["limit"]
        if row.concurrency is not None:
            n = min(n, int(row.concurrency) - int(conn.execute(fs.running, params).one().running))
        tokens = _refilled(row) if row.rate is not None else 0.0
        if row.rate is not None:
            n = min(n, int(tokens))
        if n <= 0:
            return []
        if row.grouped:
            claimed = self._claim_grouped(conn, dialect, stmts, {**params, "limit": n}, row)
        else:
            claimed = self._claim_at(conn, dialect, stmts, {**params, "limit": n}, bool(row.priorities))
        if row.rate is not None:
            conn.execute(fs.spend, {"queue_name": self.name, "new_tokens": tokens - len(claimed), "at": row.now})
        return claimed

    def _claim_grouped(
        self, conn: Connection, dialect: Dialect, stmts: Statements, params: dict[str, Any], row: Any
    ) -> list[ClaimedRow]:
        """A grouped queue's claim, under its flow row's lock: due messages in claim order (each priority level
        from the top, where priorities were offered), at most ``group_concurrency`` held per group, counting those
        held already; the earliest of each group first, so with 1 a group's messages run in due order."""
        fs = stmts.memo(_flow_statements)
        per_group = int(row.group_concurrency or 1)
        room: dict[str, int] = {}
        for group, running in conn.execute(fs.running_groups, params):
            room[group] = per_group - int(running)
        limit, below = params["limit"], MAX_PRIORITY + 1
        picked: list[int] = []
        passed_by = False
        while len(picked) < limit:
            level: int | None = None
            if row.priorities:
                level = self._next_level(conn, fs, below)
                if level is None:
                    break
                below = level
            kind: Level = "" if level is None else "nonzero" if level else "zero"
            found = conn.execute(stmts.memo(_group_candidates, kind), {**params, "at_priority": level}).all()
            for msg_id, group in found:
                if group is not None:
                    if room.setdefault(group, per_group) <= 0:
                        passed_by = True
                        continue
                    room[group] -= 1
                picked.append(int(msg_id))
                if len(picked) == limit:
                    break
            if level is None:
                break
        self._groups_full = passed_by and not picked  # (``next_due``: wait for a held lock, not poll)
        if not picked:
            return []
        order = {msg_id: i for i, msg_id in enumerate(picked)}
        locked = conn.execute(stmts.memo(_lock_picked), {**params, "ids": picked}).all()
        rows = sorted(locked, key=lambda r: order[r[0]])
        return dialect.mark_claimed(conn, stmts, params, rows, self._visibility_ms)

    def _next_level(self, conn: Connection, fs: _FlowStatements, below: int) -> int | None:
        """The highest priority level below ``below`` that the queue's messages may have: a probe of the priority
        index among the levels other than 0, and 0 itself when the probe has gone past it (its messages are not
        in the partial index; a level-0 claim that finds none costs one statement)."""
        found = conn.execute(fs.top_level, {"queue_name": self.name, "below": below}).scalar()
        if below > 0 and (found is None or int(found) < 0):
            return 0
        return None if found is None else int(found)

    def _claim_at(
        self, conn: Connection, dialect: Dialect, stmts: Statements, params: dict[str, Any], levels: bool
    ) -> list[ClaimedRow]:
        """By priority level (``_claim_levels``) or the backend's one claim."""
        if levels:
            return self._claim_levels(conn, dialect, stmts, params)
        return dialect.claim(conn, stmts, params, self._visibility_ms)

    def _until_limit_frees(self, using: Using) -> dt.timedelta | None:
        """For a limited queue (as cached): how long until a claim could take a message if the limit holds it
        back now (its first held lock's expiry; the bucket's next token); None when the limit holds nothing back."""
        params = {"queue_name": self.name, **self._now_param()}

        def op(conn: Connection, dialect: Dialect) -> dt.timedelta | None:
            fs = self._statements(dialect).memo(_flow_statements)
            row = conn.execute(fs.bucket, params).first()
            if row is None or row.paused:
                return None
            waits: list[float] = []
            if row.concurrency is not None or (row.grouped and self._groups_full):
                held = conn.execute(fs.running, params).one()
                full = row.concurrency is not None and int(held.running) >= int(row.concurrency)
                if held.first_expiry is not None and (full or (row.grouped and self._groups_full)):
                    waits.append(max(0, int(held.first_expiry) - int(row.now)))
            if row.rate is not None:
                tokens = _refilled(row)
                if tokens < 1:
                    waits.append((1 - tokens) * int(row.rate_period_ms) / int(row.rate))
            return dt.timedelta(milliseconds=max(waits)) if waits else None

        return self._runner.run(using, op, "read")

    @staticmethod
    def _levels_mode(dialect: Dialect, limit: int) -> Mode:
        """A priority claim is several statements: a transaction, with PostgreSQL's sorting off."""
        mode = dialect.claim_mode_for(max(limit, 2))
        return "transaction" if mode in ("statement", "writes") else mode
