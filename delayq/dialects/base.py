"""The dialect contract: everything delayq must know about a backend, in one small class.

``Dialect`` holds the SQL every backend shares (SQLAlchemy Core constructs, built once per
table set and clock mode). A backend module overrides only what differs in *shape*: the
database clock, the insert that skips duplicates, the claim, the start of a library-owned
transaction, and how to read its driver's error codes.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Final, Literal, NamedTuple, TypeVar, cast

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from delayq.schema import Tables  # (schema builds on dialects.types: its column types)

S = TypeVar("S")

Mode = Literal["read", "statement", "scan", "transaction", "writes", "ordered"]
"""What one of delayq's own operations does, so that its transaction starts right: only reads; one write
statement by primary or unique key; one write statement that may scan rows it leaves alone (an ack by a
list of ids, a delete by key prefix); several statements; several statements of which the first writes
(SQLite's claim: no ``BEGIN IMMEDIATE`` needed); or one statement that must walk an index in its order
whatever the table's statistics say (a batch claim: PostgreSQL runs it with sorting off)."""


class ClaimedRow(NamedTuple):
    """A message row as a claim returns it (a tuple: cheap to make, one per claimed message)."""

    id: int
    key: str
    payload: bytes
    payload_type: str
    due_at: int
    locked_until: int
    attempts: int
    created_at: int
    scheduled_at_initially: int
    lock_token: str
    tags: str | None = None
    """Its tags as stored (``delayq.tags``), mostly NULL."""
    priority: int = 0
    group_key: str | None = None


def _bp(name: str, type_: type[sa.types.TypeEngine[Any]] | sa.types.TypeEngine[Any] = sa.BigInteger) -> Any:
    return sa.bindparam(name, type_=type_)


@dataclass(frozen=True)
class OwnedStart:
    """How one of delayq's own operations runs on a fresh connection.

    ``autocommit``: switch the connection to autocommit for it (one statement is atomic on its
    own); ``isolation_level``: switch it to this level for it instead (a driver that begins its own
    transactions begins none in autocommit); ``sql``: statements sent first; ``commit``: end with a
    COMMIT; ``marks``: what ``sql`` left set on the connection's session, recorded in its pool record
    once ``sql`` ran (``session`` of ``Dialect.owned_start`` next time).
    """

    autocommit: bool = False
    isolation_level: str | None = None
    sql: tuple[str, ...] = ()
    commit: bool = True
    marks: tuple[tuple[str, Any], ...] = ()


def claim_limit(n: int) -> sa.ColumnElement[int]:
    """The claim's ``LIMIT n``, written into the SQL text: one statement per batch size.

    A bound LIMIT leaves the planner guessing how many rows come back: PostgreSQL's generic plan
    for a prepared claim then hash-joins the whole table instead of fetching the few picked rows
    by primary key. Written as a literal it also needs no rendering at each execution (as
    ``literal_execute`` would); each distinct size is built, cached and prepared once.
    """
    return sa.literal_column(str(int(n)), sa.Integer)


class Memo:
    """The one statement cache of delayq: what is built from a set of statements (a statement of one
    backend's own, a batch size's claim, the statements of a feature) is built once, and kept on it.

    A ``Statements`` or ``TopicStatements`` is itself kept on its engine's ``Dialect`` (``Dialect.cached``),
    so everything goes when the engine goes. Two threads that build the same statement at once both
    build it; the first kept is the one every caller gets from then on.
    """

    def __init__(self) -> None:
        self._memo: dict[tuple[Callable[..., Any], tuple[Any, ...]], Any] = {}

    def memo(self, build: Callable[..., S], *args: Any) -> S:
        """``build(self, *args)``, made once per ``build`` and ``args`` (a batch size, say)."""
        found = self._memo.get((build, args))
        if found is None:
            found = self._memo.setdefault((build, args), build(self, *args))
        return cast(S, found)


class Statements(Memo):
    """The shared statements over one table set, with "now" as given.

    ``now`` is the database's clock expression, or the bind parameter ``:now`` when the queue
    runs on an injected clock. Every other value is a named bind parameter.
    """

    def __init__(self, dialect: Dialect, tables: Tables, now: sa.ColumnElement[int], notify: bool) -> None:
        super().__init__()
        m, dead = tables.messages, tables.dead_letters
        self.kind = type(dialect)  # the class, not the object: no cycle between a dialect and its statements
        self.tables = tables
        self.now = now
        queue, key = _bp("queue_name", sa.String), _bp("msg_key", sa.String)
        by_key = sa.and_(m.c.queue == queue, m.c.key == key)
        held = sa.and_(m.c.id == _bp("msg_id"), m.c.lock_token == _bp("token", sa.String))
        # A due time is absolute (:due_at) or relative to now (:due_in); the other is NULL.
        due = sa.func.coalesce(_bp("due_at"), now + _bp("due_in"))

        self.now_select = sa.select(now.label("now"))
        insert = dialect.insert_skipping_duplicates(m).values(
            queue=queue,
            key=key,
            payload=_bp("payload", sa.LargeBinary),
            payload_type=_bp("payload_type", sa.String),
            scheduled_at=due,
            scheduled_at_initially=due,
            created_at=now,
            attempts=0,
        )
        self.insert: sa.Executable = insert
        if dialect.insert_returns_created:
            returning = insert.returning(m.c.id, m.c.queue)
            self.insert = dialect.notifying(returning, tables) if notify else returning
        self.notify = dialect.notify_statement(tables) if notify else None
        self.existing_keys = sa.select(m.c.key).where(
            m.c.queue == queue, m.c.key.in_(sa.bindparam("keys", expanding=True))
        )
        self.lock_for_update = (
            sa.select(
                m.c.id, m.c.payload, m.c.payload_type, m.c.scheduled_at_initially, m.c.created_at, now.label("now")
            )
            .where(by_key)
            .with_for_update()
        )
        self.replace = (
            sa.update(m)
            .where(
                m.c.id == _bp("msg_id"),
                m.c.scheduled_at_initially == _bp("old_scheduled_at_initially"),
                m.c.created_at == _bp("old_created_at"),
            )
            .values(
                payload=_bp("payload", sa.LargeBinary),
                payload_type=_bp("payload_type", sa.String),
                scheduled_at=_bp("new_scheduled_at"),
                scheduled_at_initially=_bp("new_scheduled_at"),
                created_at=_bp("new_created_at"),
                lock_token=None,
                attempts=0,
                last_error=None,
                attempt_history=None,
                headers=None,
                priority=_bp("new_priority", sa.Integer),
                group_key=_bp("new_group", sa.String),
                tags=None,  # (the replacing offer sets its own, in its transaction)
            )
        )
        self.mark_claimed = (
            sa.update(m)
            .where(dialect.id_in(m.c.id))
            .values(lock_token=_bp("token", sa.String), scheduled_at=_bp("locked_until"), attempts=m.c.attempts + 1)
        )
        self.unclaim = (
            sa.update(m).where(held).values(scheduled_at=_bp("due"), lock_token=None, attempts=m.c.attempts - 1)
        )
        # Claims whose reply never came (cancelled in flight, or the connection lost at COMMIT): their rows
        # by token, which no one else can hold (a fresh one per attempt); their lock's expiry minus the
        # visibility timeout is the claim's now.
        self.unclaim_tokens = (
            sa.update(m)
            .where(m.c.queue == queue, m.c.lock_token.in_(sa.bindparam("tokens", expanding=True)))
            .values(scheduled_at=m.c.scheduled_at - _bp("vt"), lock_token=None, attempts=m.c.attempts - 1)
        )
        # The ack of a queue that keeps no history deletes only messages offered without ``unique_for``
        # (``unique_for_ms`` NULL); the others are moved to the finished table (``delayq.queue._lifecycle``).
        unkept = m.c.unique_for_ms.is_(None)
        self.ack = sa.delete(m).where(m.c.lock_token == _bp("token", sa.String), dialect.id_in(m.c.id), unkept)
        # Deliveries of several claims: each id with its own token.
        self.ack_pairs = sa.delete(m).where(dialect.held_in(m.c.id, m.c.lock_token), unkept)
        # Never shortens a lock: a heartbeat that ran late or a smaller ``by`` keeps the later expiry.
        extended = self.extended_expiry = dialect.greatest(m.c.scheduled_at, now + _bp("by"))
        self.extend = sa.update(m).where(held).values(scheduled_at=extended)
        # Several held messages at once, each named by (id, token): heartbeats and background acks.
        held_pairs = dialect.held_in(m.c.id, m.c.lock_token)
        self.held_ids = sa.select(m.c.id).where(held_pairs)
        self.lock_held_skipping = sa.select(m.c.id).where(held_pairs).with_for_update(skip_locked=True)
        self.extend_ids = sa.update(m).where(dialect.id_in(m.c.id)).values(scheduled_at=extended)
        self.expiry_of = sa.select(m.c.id, m.c.scheduled_at).where(dialect.id_in(m.c.id))
        self.delete_ids = sa.delete(m).where(dialect.id_in(m.c.id))
        self.ack_ids = self.delete_ids.where(unkept)
        # Every column but the id, each bound by its own name: the statement compiles once.
        self.insert_dead = sa.insert(dead).values(
            {c.name: sa.bindparam(c.name, type_=c.type) for c in dead.c if c is not dead.c.id}
        )
        self.delete_held = sa.delete(m).where(held)
        # A queued message: not locked, or its lock expired (one whose handler runs is cancelled in a transaction
        # that records it: ``delayq.queue._cancel``).
        self.cancel = sa.delete(m).where(by_key, sa.or_(m.c.lock_token.is_(None), m.c.scheduled_at <= now))
        self.reschedule = (
            sa.update(m).where(by_key).values(scheduled_at=due, scheduled_at_initially=due, lock_token=None)
        )
        self.stats = stats_statement(tables, now, tagged=False)
        self.next_due = sa.select(sa.func.min(m.c.scheduled_at).label("next_due"), now.label("now")).where(
            m.c.queue == queue
        )
        self.dead_delete = sa.delete(dead).where(dead.c.id == _bp("dead_id"))

    def starts_with(self, column: sa.ColumnElement[str], name: str = "prefix") -> sa.ColumnElement[bool]:
        """See ``Dialect.starts_with``."""
        return self.kind.starts_with(column, name)


class Dialect:
    """A backend as delayq sees it. Subclasses override what differs; see each override's note."""

    name: ClassVar[str] = "base"
    #: The oldest server version delayq runs on.
    min_version: ClassVar[tuple[int, ...]] = ()
    #: Whether an insert that skips duplicates can return the rows it created (RETURNING).
    insert_returns_created: ClassVar[bool] = True
    #: Whether ``SELECT … FOR UPDATE`` / ``FOR SHARE`` lock rows. Where they do not, a statement that must
    #: read under a lock is a write (see ``delayq.topics.statements``).
    row_locks: ClassVar[bool] = True
    #: Whether an UPDATE can return the rows it changed (RETURNING).
    update_returning: ClassVar[bool] = True
    #: Whether a list binds as one array parameter, which ``unnest`` turns into rows (see ``unnest``).
    arrays: ClassVar[bool] = False
    #: Whether a statement's WITH can hold an UPDATE … RETURNING that an INSERT reads (one statement for a
    #: topic's single publish: ``delayq.topics._backends.publish_one``).
    writable_cte: ClassVar[bool] = False
    #: Whether an UPDATE can lock another table's rows (``FOR SHARE``) in a sub-select run once, before the
    #: UPDATE locks a row of its own (an ack's fence and watermark move as one statement:
    #: ``delayq.topics._backends.ack_runs_fenced``).
    fence_in_update: ClassVar[bool] = False
    #: Whether a COMMIT's reply can be lost after the server committed (a network between): a claim
    #: attempt that failed may then hold rows under its token (``DelayedQueue.try_poll_many`` gives them back).
    unseen_commits: ClassVar[bool] = True
    #: Client-side timeouts for engines delayq makes itself (``delayq worker``), as connect arguments;
    #: a URL's query overrides each.
    network_timeouts: ClassVar[dict[str, int]] = {}

    @classmethod
    def in_memory(cls, url: sa.URL) -> bool:
        """Whether ``url`` names a database that lives in one process only (gone when it ends)."""
        return False

    def __init__(self, sa_dialect: sa.Dialect) -> None:
        self.sa_dialect = sa_dialect
        self._verified = False
        self._cached: dict[tuple[Any, ...], Any] = {}

    # -- capabilities ---------------------------------------------------------------------------
    def verify(self) -> None:
        """Check the server once per engine (``check_server``), after its first connection."""
        if not self._verified:
            self.check_server()
            self._verified = True

    @classmethod
    def check_shared_url(cls, url: sa.URL) -> None:
        """Refuse a URL that other processes (Spark executors) cannot open to reach the same database."""

    def check_server(self) -> None:
        """Refuse a server that lacks what delayq relies on (``sa_dialect`` knows its version)."""

    # -- time -----------------------------------------------------------------------------------
    def now_ms(self) -> sa.ColumnElement[int]:
        """The database's current time as epoch milliseconds, constant within one statement."""
        raise NotImplementedError

    def statements(self, tables: Tables, manual_clock: bool, notify: bool = False) -> Statements:
        """The queue's shared statements, built once per table set, clock mode and wake-up mode."""

        def build() -> Statements:
            now = _bp("now") if manual_clock else self.now_ms()
            return Statements(self, tables, now, notify and self.can_notify)

        return self.cached(("queue", tables, manual_clock, notify), build)

    def cached(self, key: tuple[Any, ...], build: Callable[[], S]) -> S:
        """``build()``, made once per ``key`` for this engine: a set of statements (the queue's, a topic
        table set's), kept on this object (one per engine) so they go when the engine goes."""
        found = self._cached.get(key)
        if found is None:
            found = self._cached.setdefault(key, build())
        return cast(S, found)

    def id_in(self, column: sa.Column[int]) -> sa.ColumnElement[bool]:
        """``column IN`` the list of ids bound as ``:ids``."""
        return column.in_(sa.bindparam("ids", expanding=True))

    def held_in(self, ids: sa.Column[int], tokens: sa.Column[str]) -> sa.ColumnElement[bool]:
        """``(ids, tokens)`` is one of the ``(id, lock token)`` pairs bound by ``held_params``."""
        return sa.tuple_(ids, tokens).in_(sa.bindparam("pairs", expanding=True))

    def held_params(self, pairs: Sequence[tuple[int, str]]) -> dict[str, Any]:
        """The parameters of ``held_in`` for these ``(id, lock token)`` pairs."""
        return {"pairs": list(pairs)}

    @classmethod
    def starts_with(cls, column: sa.ColumnElement[str], name: str = "prefix") -> sa.ColumnElement[bool]:
        """``column`` starts with the prefix bound as ``{name}_lo`` / ``{name}_hi`` (see ``prefix_bounds``).

        A range, compared byte for byte (``bytewise``); never LIKE, which ignores case on SQLite and needs
        escaping everywhere. The (queue, key) indexes serve it because the key columns compare byte for byte
        themselves: a binary collation on MySQL/MariaDB, SQLite's default, and on PostgreSQL the collation "C"
        since delayq_0010 (an index in the database's collation cannot serve ``key COLLATE "C"``: before that
        revision a prefix filter read every message of the queue there).
        """
        key = cls.bytewise(column)
        return sa.and_(
            key >= sa.bindparam(f"{name}_lo", type_=sa.String), key < sa.bindparam(f"{name}_hi", type_=sa.String)
        )

    @staticmethod
    def bytewise(column: sa.ColumnElement[str]) -> sa.ColumnElement[str]:
        """``column`` compared by code point (the key columns are, on SQLite and MySQL/MariaDB)."""
        return column

    def greatest(self, a: sa.ColumnElement[int], b: sa.ColumnElement[int]) -> sa.ColumnElement[int]:
        """The larger of two values (GREATEST)."""
        return sa.func.greatest(a, b, type_=sa.BigInteger)

    # -- wake-ups -------------------------------------------------------------------------------
    #: Whether offers can wake listening workers when they commit (LISTEN/NOTIFY).
    can_notify: ClassVar[bool] = False

    def notifying(self, insert: sa.Insert, tables: Tables) -> sa.Executable:
        """Wrap an INSERT ... RETURNING (first column, queue) so it also wakes listening workers."""
        return insert

    def notify_statement(self, tables: Tables) -> sa.Executable | None:
        """A statement that wakes the workers listening for ``:queue_name``."""
        return None

    def notify_channel(self, channel: str) -> sa.Executable | None:
        """A statement that notifies ``channel`` with ``:queue_name`` on commit (where ``can_notify``)."""
        return None

    @classmethod
    def notify_cancel_statement(cls, tables: Tables) -> sa.Executable | None:
        """A statement that tells the worker holding message ``:msg_id`` that it was cancelled (on commit);
        None where there are no notifications (the worker's heartbeat finds the lock gone instead)."""
        return None

    def listen(self, engine: sa.Engine, channel: str, stop: threading.Event, cancels: bool = False) -> Iterator[str]:
        """Yield the queue names notified on ``channel`` until ``stop`` is set (where ``can_notify``); with
        ``cancels``, also the ids notified on its cancel channel, each after ``CANCELLED`` (``_pg_listen``)."""
        raise NotImplementedError(f"{self.name} has no notifications")

    def listen_async(self, engine: AsyncEngine, channel: str, cancels: bool = False) -> AsyncIterator[str]:
        """``listen`` for an ``AsyncEngine`` (where ``can_notify``)."""
        raise NotImplementedError(f"{self.name} has no notifications")

    # -- transactions ---------------------------------------------------------------------------
    #: Whether the claim is one statement (then it needs no explicit transaction).
    claim_mode: ClassVar[Mode] = "transaction"

    def claim_mode_for(self, limit: int) -> Mode:
        """The mode of a claim of up to ``limit`` messages (``claim_mode`` unless the plan needs more)."""
        return self.claim_mode

    def writer_turn(self, mode: Mode) -> contextlib.AbstractContextManager[object]:
        """Held around one of delayq's own operations of ``mode`` (each attempt): where the database
        lets one writer in at a time, the process's threads take turns here rather than in the
        database's busy wait. Nothing by default."""
        return contextlib.nullcontext()

    def owned_start(
        self, mode: Mode, autocommitting: bool, idle_s: float | None = None, session: Mapping[str, Any] | None = None
    ) -> OwnedStart:
        """How a library-owned operation of the given kind runs on a fresh connection.

        ``mode``: see ``Mode``.
        ``autocommitting``: the connection is in autocommit already (an engine made with
        ``isolation_level="AUTOCOMMIT"``), so several statements need an explicit BEGIN.
        ``idle_s``: the idle bound (``delayq.dialects.bounds``): where the server can, a transaction
        it begins that sits idle this long is ended by the server; None: no bound.
        ``session``: what earlier operations left set on this connection's session (``OwnedStart.marks``).
        """
        return OwnedStart()

    def autocommitting(self, dbapi_connection: Any) -> bool:
        """Whether this driver connection commits every statement by itself (read without a round trip)."""
        return False

    def prepare(self, driver_connection: Any) -> None:
        """Make a driver connection ready for delayq's statements, before each operation on it
        (cheap once done). Nothing by default."""

    def is_transient(self, exc: DBAPIError) -> bool:
        """True for errors that a retry of the whole transaction can overcome."""
        return bool(exc.connection_invalidated)

    def is_missing_table(self, exc: DBAPIError) -> bool:
        raise NotImplementedError

    def is_duplicate_key(self, exc: DBAPIError) -> bool:
        raise NotImplementedError

    # -- offers ---------------------------------------------------------------------------------
    def insert_skipping_duplicates(self, table: sa.Table) -> sa.Insert:
        """An INSERT that skips rows whose (queue, key) exists (ON CONFLICT DO NOTHING)."""
        raise NotImplementedError

    def insert_if_absent(self, conn: Connection, stmts: Statements, params: Mapping[str, Any]) -> bool:
        """Insert one message; True when created, False when its key existed."""
        return conn.execute(stmts.insert, params).first() is not None

    def insert_many_if_absent(
        self, conn: Connection, stmts: Statements, queue: str, rows: Sequence[NewRow]
    ) -> set[str]:
        """Insert rows whose keys are absent; return the keys created, in one round trip.

        The shared shape: one multi-row ``INSERT … ON CONFLICT (queue, key) DO NOTHING RETURNING key``.
        """
        key = self.sa_dialect.identifier_preparer.quote("key")
        conflict = f" ON CONFLICT (queue, {key}) DO NOTHING RETURNING {key}"
        sql = values_insert(self.sa_dialect, stmts.tables.messages, len(rows)) + conflict
        return set(conn.exec_driver_sql(sql, row_values(rows)).scalars().all())

    # -- consumers ------------------------------------------------------------------------------
    def claim(
        self,
        conn: Connection,
        stmts: Statements,
        params: Mapping[str, Any],
        visibility_ms: int,
        level: Level = "",
    ) -> list[ClaimedRow]:
        """Lock up to ``params['limit']`` due messages of ``params['queue_name']`` with ``params['token']``
        for ``visibility_ms``, oldest due first, and return them as they were due. Each backend has its
        own shape (docs/internals.md, "the claim"); it runs in the transaction ``claim_mode_for`` begins.
        ``level``: only messages of one priority (``at_level``)."""
        raise NotImplementedError

    def mark_claimed(
        self, conn: Connection, stmts: Statements, params: Mapping[str, Any], rows: Sequence[Any], visibility_ms: int
    ) -> list[ClaimedRow]:
        """Lock the candidate rows (selected FOR UPDATE in this transaction) for this consumer: one UPDATE by id."""
        if not rows:
            return []
        locked_until = rows[0].now + visibility_ms
        token = params["token"]
        conn.execute(stmts.mark_claimed, {"ids": [r[0] for r in rows], "token": token, "locked_until": locked_until})
        # Unpacked by position (the columns of ``candidate_rows``): a Row's attribute lookup costs
        # more than the rest of the row's handling.
        return [
            ClaimedRow(
                msg_id,
                key,
                payload,
                payload_type,
                due,
                locked_until,
                attempts + 1,
                created,
                initially,
                token,
                tags,
                priority,
                group,
            )
            for msg_id, key, payload, payload_type, due, attempts, created, initially, tags, priority, group, _ in rows
        ]

    def extend_held(self, conn: Connection, stmts: Statements, params: Mapping[str, Any]) -> dict[int, int]:
        """Extend the locks of the held messages ``params['pairs']`` (id, token) by ``params['by']`` ms.

        Rows that another transaction has locked are skipped, never waited for. Returns the new
        expiry of each message extended. The shared shape: lock the rows SKIP LOCKED, update
        them by id, read their expiry back; in one transaction.
        """
        ids = list(conn.execute(stmts.lock_held_skipping, params).scalars())
        if not ids:
            return {}
        conn.execute(stmts.extend_ids, {**params, "ids": ids})
        return {int(r.id): int(r.scheduled_at) for r in conn.execute(stmts.expiry_of, {"ids": ids})}

    def delete_held(self, conn: Connection, stmts: Statements, params: Mapping[str, Any]) -> int:
        """Delete the held messages ``params['pairs']`` (id, token) that no other transaction has locked
        (and that were offered without ``unique_for``: an ack keeps those).

        The shared shape: lock them SKIP LOCKED, then delete them by id, in one transaction.
        """
        ids = list(conn.execute(stmts.lock_held_skipping, params).scalars())
        if not ids:
            return 0
        return int(conn.execute(stmts.ack_ids, {"ids": ids}).rowcount)

    #: Whether ``keep_held`` is one statement here (then it needs no explicit transaction).
    keeps_in_one_statement: ClassVar[bool] = False

    def keep_held(
        self,
        conn: Connection,
        stmts: Statements,
        params: Mapping[str, Any],
        *,
        skip_locked: bool,
        only_unique: bool,
        notify: bool,
    ) -> int | None:
        """Move the held messages ``params`` names (``held_params``) into the finished table as completed, in one
        statement, where the backend can; how many. None where it cannot: the caller runs the shared shape
        (SELECT … FOR UPDATE, INSERT, DELETE; ``delayq.queue._lifecycle``). ``params`` also binds, per delivery,
        ``keep_ids``, ``keep_durations``, ``keep_results``, ``keep_result_types`` (arrays), and
        ``retention_ms``, ``queue_name`` and ``worker`` (the registry id each row records, or None). Each row keeps
        its message's priority and group. ``only_unique``: only messages offered with ``unique_for``;
        ``notify``: wake waiters (``notify_channel`` on the finished table)."""
        return None

    # Topics ------------------------------------------------------------------------------------
    def topic_upsert(self, table: sa.Table, keys: Sequence[str], set_: Mapping[str, Any] | None) -> sa.Insert:
        """An INSERT that, for a row whose ``keys`` exist, updates ``set_`` instead (or does nothing when None)."""
        raise NotImplementedError

    def adding_upsert(self, table: sa.Table, keys: Sequence[str], counts: Sequence[str]) -> sa.Insert:
        """An INSERT whose rows, where a row with the same ``keys`` exists, add their ``counts`` columns to it
        instead (the queue history: many workers add to one minute's row)."""
        raise NotImplementedError

    @classmethod
    def unnest(cls, name: str, *columns: tuple[str, sa.types.TypeEngine[Any]]) -> Any:
        """Rows from one array parameter per column, as table ``name``; only where ``arrays``."""
        raise NotImplementedError

    def any_of(self, column: sa.ColumnElement[Any], name: str) -> sa.ColumnElement[bool]:
        """``column`` is one of the values of the list bound as ``:name`` (``IN``, expanded per call)."""
        return column.in_(sa.bindparam(name, expanding=True))


Level = Literal["", "zero", "nonzero"]
"""Which messages a claim takes: all (""), those of priority 0, or those of the priority ``:at_priority`` (not 0)."""


def at_level(messages: sa.FromClause, level: Level) -> tuple[sa.ColumnElement[bool], ...]:
    """A claim's extra condition for ``level``. The priority index is partial on PostgreSQL and SQLite (the
    messages whose priority is not 0: a queue without priorities never writes to it), so a nonzero level's
    condition says ``priority <> 0`` in the statement's text, where the planner sees it whatever ``:at_priority``
    is; priority 0 is read through the due index."""
    if level == "zero":
        return (messages.c.priority == 0,)
    if level == "nonzero":
        return (messages.c.priority == sa.bindparam("at_priority", type_=sa.Integer), messages.c.priority != 0)
    return ()


def candidate_columns(stmts: Statements) -> tuple[sa.ColumnElement[Any], ...]:
    """What a claim reads of a message about to be claimed (in this order: ``Dialect.mark_claimed`` and
    SQLite's claim unpack them by position), and "now"."""
    m = stmts.tables.messages
    return (
        m.c.id,
        m.c.key,
        m.c.payload,
        m.c.payload_type,
        m.c.scheduled_at,
        m.c.attempts,
        m.c.created_at,
        m.c.scheduled_at_initially,
        m.c.tags,
        m.c.priority,
        m.c.group_key,
        stmts.now.label("now"),
    )


def candidate_rows(stmts: Statements) -> sa.Select[Any]:
    """SELECT the ``candidate_columns``."""
    return sa.select(*candidate_columns(stmts))


ROW_COLUMNS = (
    "queue",
    "key",
    "payload",
    "payload_type",
    "scheduled_at",
    "scheduled_at_initially",
    "created_at",
    "attempts",
)
"""The columns a new message's row sets, in the order of ``values_insert`` and ``row_values``."""


def values_insert(dialect: sa.Dialect, table: sa.Table, rows: int) -> str:
    """``INSERT INTO table (ROW_COLUMNS) VALUES (…), (…), …`` for ``rows`` rows, in the driver's paramstyle.

    Written out rather than compiled: SQLAlchemy would compile a statement per batch size.
    """
    quote = dialect.identifier_preparer
    mark = "?" if dialect.paramstyle == "qmark" else "%s"
    row = "(" + ", ".join([mark] * len(ROW_COLUMNS)) + ")"
    columns = ", ".join(quote.quote(c) for c in ROW_COLUMNS)
    return f"INSERT INTO {quote.format_table(table)} ({columns}) VALUES " + ", ".join([row] * rows)


NewRow = tuple[str, str, bytes, str, int, int, int, int]
"""A new message's row: its values of ``ROW_COLUMNS``, in that order."""
NEW_KEY: Final = 1  # ROW_COLUMNS.index("key")
NEW_PAYLOAD: Final = 2  # ROW_COLUMNS.index("payload")


def row_values(rows: Sequence[NewRow]) -> tuple[Any, ...]:
    """The parameters of ``values_insert``: each row's ``ROW_COLUMNS``, one row after another."""
    return tuple(itertools.chain.from_iterable(rows))


def prefix_bounds(prefix: str, name: str = "prefix") -> dict[str, str]:
    """The bind values of ``Dialect.starts_with(column, name)``: ``{name}_lo`` and ``{name}_hi``.

    Every key that starts with ``prefix`` is ``>= prefix`` and ``<`` the prefix with its last
    character replaced by the next code point; no other key is. (Trailing characters that have no
    next code point are dropped first.)
    """
    stem = prefix
    while stem and ord(stem[-1]) >= 0x10FFFF:
        stem = stem[:-1]
    if not stem:
        return {f"{name}_lo": prefix, f"{name}_hi": "\U0010ffff" * (len(prefix) + 1)}
    following = ord(stem[-1]) + 1
    if 0xD800 <= following <= 0xDFFF:  # surrogates are no characters: the next one is U+E000
        following = 0xE000
    return {f"{name}_lo": prefix, f"{name}_hi": stem[:-1] + chr(following)}


def stats_statement(tables: Tables, now: sa.ColumnElement[int], tagged: bool) -> sa.Select[Any]:
    """Count a queue's messages by state, its dead letters and its kept finished messages, in one statement; with
    ``tagged``, only those whose tags match the LIKE pattern ``:tag_pattern`` (``delayq.tags.tag_pattern``,
    escaped with ``!``)."""
    m, dead = tables.messages, tables.dead_letters
    queue = _bp("queue_name", sa.String)
    due_now = m.c.scheduled_at <= now
    locked = m.c.lock_token.is_not(None)

    def count(cond: sa.ColumnElement[bool]) -> sa.ColumnElement[int]:
        return sa.func.coalesce(sa.func.sum(sa.case((cond, 1), else_=0)), 0)

    fin = tables.finished
    dead_where = [dead.c.queue == queue]
    live_where = [m.c.queue == queue]
    fin_where = [fin.c.queue == queue]
    if tagged:
        dead_where.append(dead.c.tags.like(_bp("tag_pattern", sa.String), escape="!"))
        live_where.append(m.c.tags.like(_bp("tag_pattern", sa.String), escape="!"))
        fin_where.append(fin.c.tags.like(_bp("tag_pattern", sa.String), escape="!"))
    dead_count = sa.select(sa.func.count()).select_from(dead).where(*dead_where).scalar_subquery()

    def kept_count(state: int) -> sa.ScalarSelect[int]:  # finished.state: 1 completed, 2 cancelled
        return sa.select(sa.func.count()).select_from(fin).where(*fin_where, fin.c.state == state).scalar_subquery()

    return sa.select(
        count(sa.and_(due_now, ~locked)).label("ready"),
        count(sa.and_(~due_now, ~locked)).label("scheduled"),
        count(sa.and_(~due_now, locked)).label("in_flight"),
        count(sa.and_(due_now, locked)).label("expired_locks"),
        dead_count.label("dead"),
        kept_count(1).label("completed"),
        kept_count(2).label("cancelled"),
        sa.func.min(sa.case((due_now, m.c.scheduled_at), else_=None)).label("oldest_due"),
        now.label("now"),
    ).where(*live_where)


def purge_dead_statement(dialect: Dialect, tables: Tables, key: bool, key_prefix: bool) -> sa.Delete:
    """DELETE a queue's dead letters: all of them, ``msg_key``'s, or those whose key starts with ``prefix``."""
    dead = tables.dead_letters
    stmt = sa.delete(dead).where(dead.c.queue == sa.bindparam("queue_name", type_=sa.String))
    if key:
        stmt = stmt.where(dead.c.key == sa.bindparam("msg_key", type_=sa.String))
    if key_prefix:
        stmt = stmt.where(dialect.starts_with(dead.c.key))
    return stmt


def cancel_prefix_statement(stmts: Statements) -> sa.Delete:
    """DELETE a queue's messages whose key starts with ``prefix``."""
    m = stmts.tables.messages
    return sa.delete(m).where(m.c.queue == sa.bindparam("queue_name", type_=sa.String), stmts.starts_with(m.c.key))


def cancel_prefix_keeping_statement(stmts: Statements) -> sa.Delete:
    """DELETE a queue's messages whose key starts with ``prefix`` but not with ``keep``."""
    m = stmts.tables.messages
    return cancel_prefix_statement(stmts).where(~stmts.starts_with(m.c.key, "keep"))


def coalesce_statements(stmts: Statements) -> tuple[sa.Select[Any], sa.Delete]:
    """The newest overdue never-attempted message under ``prefix``, and the DELETE of those older."""
    m = stmts.tables.messages
    untouched = sa.and_(
        m.c.queue == sa.bindparam("queue_name", type_=sa.String),
        stmts.starts_with(m.c.key),
        m.c.lock_token.is_(None),
        m.c.attempts == 0,
    )
    latest = sa.select(sa.func.max(m.c.scheduled_at_initially)).where(
        untouched, m.c.scheduled_at_initially <= sa.bindparam("now_ms", type_=sa.BigInteger)
    )
    older = sa.delete(m).where(untouched, m.c.scheduled_at_initially < sa.bindparam("latest", type_=sa.BigInteger))
    return latest, older
