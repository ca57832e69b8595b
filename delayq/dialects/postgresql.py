"""PostgreSQL (psycopg 3): the claim is one statement, ON CONFLICT skips duplicates."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.types import TypeDecorator

from delayq.dialects import bounds
from delayq.dialects._pg_listen import CANCEL_SUFFIX as CANCEL_SUFFIX
from delayq.dialects._pg_listen import CANCELLED as CANCELLED
from delayq.dialects._pg_listen import LISTEN_PING_AFTER as LISTEN_PING_AFTER
from delayq.dialects._pg_listen import LISTEN_PING_TIMEOUT as LISTEN_PING_TIMEOUT
from delayq.dialects._pg_listen import PING as PING
from delayq.dialects._pg_listen import ListenStalledError as ListenStalledError
from delayq.dialects.base import ClaimedRow, Dialect, Level, Mode, NewRow, OwnedStart, Statements, at_level, claim_limit
from delayq.errors import UnsupportedDatabaseError

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from delayq.schema import Tables  # (schema builds on dialects.types: its column types)


def bounded_begin(idle_s: float | None, sort: bool = True) -> str:
    """The start of one of delayq's own transactions, in one simple query (no parameters: psycopg sends it
    as is, in the round trip its own BEGIN would take).

    ``idle_s``: should its client freeze or its network go silent between two statements or before the
    COMMIT, the server ends the transaction after this many idle seconds, and the rows it locked are free
    again (by default it would wait for as long as the connection seems up); None: no bound. ``sort``
    False: its plans walk indexes, never a sort (see ``claim_mode_for``). Both settings end with the
    transaction.
    """
    sql = "BEGIN"
    if not sort:
        sql += "; SET LOCAL enable_sort = off"
    if idle_s is not None:
        sql += f"; SET LOCAL idle_in_transaction_session_timeout = '{max(1, round(idle_s * 1000))}ms'"
    return sql


# serialization_failure, deadlock_detected, lock_not_available, admin/crash shutdown,
# cannot_connect_now, and the connection_exception class.
_TRANSIENT = {"40001", "40P01", "55P03", "57P01", "57P02", "57P03"}


def _sqlstate(exc: DBAPIError) -> str:
    orig = exc.orig
    return str(getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None) or "")


class _BinaryList(list[Any]):
    """A list that psycopg sends as a binary array (once ``PostgresDialect.prepare`` taught the connection)."""


class BinaryArray(TypeDecorator[list[Any]]):
    """An array parameter sent in binary: psycopg sends a plain list as a text array, whose dumper
    quotes and escapes every element in Python (2 µs a bytea element, 0.4 a string or integer;
    the binary dumper: 0.15 and under 0.2)."""

    impl = ARRAY
    cache_ok = True

    def __init__(self, item_type: sa.types.TypeEngine[Any]) -> None:
        super().__init__(item_type)
        self.item_type = item_type  # part of the cache key: arrays of other items render other casts

    def bind_processor(self, dialect: sa.Dialect) -> Any:
        return _BinaryList  # not ARRAY's processor, which copies into a plain list element by element


def _array(name: str, item_type: sa.types.TypeEngine[Any]) -> sa.BindParameter[Any]:
    return sa.bindparam(name, type_=BinaryArray(item_type))


class PostgresDialect(Dialect):
    name: ClassVar[str] = "postgresql"
    min_version: ClassVar[tuple[int, ...]] = (12,)  # WITH ... AS MATERIALIZED

    def check_server(self) -> None:
        version = tuple(v for v in (self.sa_dialect.server_version_info or ()) if isinstance(v, int))
        if version < self.min_version:
            raise UnsupportedDatabaseError(
                f"PostgreSQL {'.'.join(map(str, version))} is too old; delayq needs PostgreSQL 12 or newer"
            )

    claim_mode: ClassVar[Mode] = "statement"
    # libpq: give up connecting after 10 s; TCP keepalives find a dead peer of an idle connection in
    # about 25 s, and tcp_user_timeout one that stops acknowledging what was sent after 30 s.
    network_timeouts: ClassVar[dict[str, int]] = {
        "connect_timeout": 10,
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 5,
        "keepalives_count": 3,
        "tcp_user_timeout": 30_000,
    }
    can_notify: ClassVar[bool] = True
    arrays: ClassVar[bool] = True
    writable_cte: ClassVar[bool] = True
    fence_in_update: ClassVar[bool] = True  # ``= ANY((SELECT array_agg(…) FROM (… FOR SHARE)))``: an InitPlan

    @classmethod
    def unnest(cls, name: str, *columns: tuple[str, sa.types.TypeEngine[Any]]) -> Any:
        return _unnest(name, *columns)

    def notifying(self, insert: sa.Insert, tables: Tables) -> sa.Executable:
        # One statement still: NOTIFY rides on the insert and is delivered when the offering
        # transaction commits (the caller's, when the offer joined it). PostgreSQL folds equal
        # notifications of one transaction into one.
        offered = insert.cte("offered")
        first = next(iter(offered.c))
        return sa.select(first, sa.func.pg_notify(tables.messages.name, offered.c.queue)).select_from(offered)

    def notify_statement(self, tables: Tables) -> sa.Executable:
        return sa.select(sa.func.pg_notify(tables.messages.name, sa.bindparam("queue_name", type_=sa.String)))

    def notify_channel(self, channel: str) -> sa.Executable:
        return sa.select(sa.func.pg_notify(channel, sa.bindparam("queue_name", type_=sa.String)))

    @classmethod
    def notify_cancel_statement(cls, tables: Tables) -> sa.Executable:
        # A channel of its own (not the wake-up one, whose payload is a queue name): a worker listens on both.
        channel = tables.messages.name + CANCEL_SUFFIX
        return sa.select(sa.func.pg_notify(channel, sa.cast(sa.bindparam("msg_id", type_=sa.BigInteger), sa.Text)))

    def listen_async(self, engine: AsyncEngine, channel: str, cancels: bool = False) -> AsyncIterator[str]:
        from delayq.dialects.postgresql_async import notifications

        return notifications(engine, channel, cancels)

    def listen(self, engine: sa.Engine, channel: str, stop: threading.Event, cancels: bool = False) -> Iterator[str]:
        from psycopg import sql as psycopg_sql

        # A connection of the engine's own making (its connect_args, do_connect handlers, SSL,
        # application_name), taken out of the pool for good: it only listens, in autocommit.
        pooled = engine.raw_connection()
        pooled.detach()
        conn: Any = pooled.dbapi_connection
        try:
            bounds.arm(conn, LISTEN_PING_AFTER)  # its setup, on a connection that may have gone silent
            conn.rollback()
            conn.autocommit = True
            conn.execute(psycopg_sql.SQL("LISTEN {}").format(psycopg_sql.Identifier(channel)))
            if cancels:
                conn.execute(psycopg_sql.SQL("LISTEN {}").format(psycopg_sql.Identifier(channel + CANCEL_SUFFIX)))
            bounds.disarm(conn)
            heard, pinged, pinger = time.monotonic(), None, None
            while not stop.is_set():
                for notice in conn.notifies(timeout=0.5):
                    heard, pinged, pinger = time.monotonic(), None, None
                    if notice.channel != channel:
                        yield CANCELLED + notice.payload
                    elif notice.payload != PING:
                        yield notice.payload
                # A half-open connection (a peer gone without a FIN) delivers nothing and raises
                # nothing: after a quiet spell, notify ourselves through another connection and
                # give up on this one when that does not arrive.
                quiet = time.monotonic() - heard
                if pinged is None and quiet > LISTEN_PING_AFTER:
                    pinger = self._ping(engine, channel, pinger)
                    pinged = time.monotonic()
                elif pinged is not None and time.monotonic() - pinged > LISTEN_PING_TIMEOUT:
                    raise ListenStalledError(
                        f"LISTEN {channel}: a test notification did not arrive in {LISTEN_PING_TIMEOUT:.0f}s"
                    )
        finally:
            bounds.disarm(conn)
            pooled.close()

    @staticmethod
    def _ping(engine: sa.Engine, channel: str, previous: threading.Thread | None) -> threading.Thread:
        """Send the test notification from a thread of its own: its connection may hang too, and the
        listener must go on counting the time (one ping at a time). Its calls are bounded: past the
        listener's patience, its connection is dropped, so the thread never waits for ever."""
        if previous is not None and previous.is_alive():
            return previous

        def ping() -> None:
            try:
                with engine.connect() as conn:
                    dbapi_connection = conn.connection.dbapi_connection
                    bounds.arm(dbapi_connection, LISTEN_PING_TIMEOUT)
                    try:
                        conn.execute(sa.select(sa.func.pg_notify(channel, PING)))
                        conn.commit()
                    finally:
                        bounds.disarm(dbapi_connection)
            except Exception:  # the missing notification is what the listener acts on
                return

        thread = threading.Thread(target=ping, name="delayq-listen-ping", daemon=True)
        thread.start()
        return thread

    def claim_mode_for(self, limit: int) -> Mode:
        # A batch claim must walk the due index: on a table whose statistics are stale (analyzed
        # while empty, autovacuum off) the planner takes a sort of every due row for free and
        # picks it over the index, 10x slower at 20,000 due rows. Forbidding the sort for this one
        # transaction costs two round trips per batch (BEGIN with the setting, and the COMMIT). A
        # claim of one keeps the index anyway (LIMIT 1 makes the first row's cost decide) and stays
        # one autocommitted statement.
        return "ordered" if limit > 1 else "statement"

    def owned_start(
        self, mode: Mode, autocommitting: bool, idle_s: float | None = None, session: Mapping[str, Any] | None = None
    ) -> OwnedStart:
        # One statement is atomic on its own: autocommit saves the BEGIN and COMMIT round trips
        # (psycopg switches autocommit without one), and it leaves nothing open to bound.
        if mode in ("read", "statement", "scan"):
            return OwnedStart(autocommit=not autocommitting, commit=False)
        # Several: our own BEGIN with the idle bound (and the plan's setting), in the round trip psycopg's
        # implicit BEGIN would take; the COMMIT ends the transaction as usual.
        return OwnedStart(autocommit=not autocommitting, sql=(bounded_begin(idle_s, sort=mode != "ordered"),))

    def autocommitting(self, dbapi_connection: Any) -> bool:
        return bool(dbapi_connection.autocommit)

    def prepare(self, driver_connection: Any) -> None:
        # psycopg looks dumpers up per connection (copies of the engine's map): teach each of
        # them once to send ``BinaryArray`` values as binary arrays. A connection that missed it
        # still sends them right, as text.
        adapters = getattr(driver_connection, "adapters", None)
        if adapters is None:  # not psycopg 3: its own adaptation of a list
            return
        from psycopg.adapt import PyFormat
        from psycopg.types.array import ListBinaryDumper

        if adapters.get_dumper(_BinaryList, PyFormat.AUTO).format != ListBinaryDumper.format:
            adapters.register_dumper(_BinaryList, ListBinaryDumper)

    @staticmethod
    def bytewise(column: sa.ColumnElement[str]) -> sa.ColumnElement[str]:
        # The database's collation may order by language rules (en_US ignores punctuation at first). The key
        # columns are in "C" themselves since delayq_0010, so their indexes serve this (``starts_with``).
        return column.collate("C")

    def id_in(self, column: sa.Column[int]) -> sa.ColumnElement[bool]:
        # One array parameter: the statement text stays the same whatever the number of ids,
        # so psycopg prepares it once.
        return column == sa.any_(_array("ids", sa.BigInteger()))

    def held_in(self, ids: sa.Column[int], tokens: sa.Column[str]) -> sa.ColumnElement[bool]:
        # The pairs as two arrays (ids, tokens): one statement text whatever their number, so psycopg
        # parses it once and prepares it (an expanding IN of 100 pairs cost 2-4 ms of SQLAlchemy's
        # rendering and psycopg's parsing per ack). With them, the few distinct tokens (one per claim):
        # the lock-token index finds the rows with one probe per token, a plan that stays the
        # cheapest where the statistics say the table is empty (a probe per id does not).
        return _held_pairs(ids, tokens)

    def held_params(self, pairs: Sequence[tuple[int, str]]) -> dict[str, Any]:
        tokens = [t for _, t in pairs]
        return {"held_ids": [i for i, _ in pairs], "held_tokens": tokens, "held_token_set": list(dict.fromkeys(tokens))}

    def now_ms(self) -> sa.ColumnElement[int]:
        # statement_timestamp(): one value per statement, unlike clock_timestamp(), and fresh
        # per statement, unlike now() which is frozen at the start of the transaction.
        # Written out, not bound: a parameter less for every statement that reads the clock.
        return sa.literal_column(
            "CAST(floor(EXTRACT(epoch FROM statement_timestamp()) * 1000) AS BIGINT)", sa.BigInteger
        )

    def is_transient(self, exc: DBAPIError) -> bool:
        state = _sqlstate(exc)
        return super().is_transient(exc) or state in _TRANSIENT or state.startswith("08")

    def is_missing_table(self, exc: DBAPIError) -> bool:
        return _sqlstate(exc) == "42P01"

    def is_duplicate_key(self, exc: DBAPIError) -> bool:
        return _sqlstate(exc) == "23505"

    def insert_skipping_duplicates(self, table: sa.Table) -> sa.Insert:
        return pg_insert(table).on_conflict_do_nothing(index_elements=["queue", "key"])

    def insert_many_if_absent(
        self, conn: Connection, stmts: Statements, queue: str, rows: Sequence[NewRow]
    ) -> set[str]:
        # INSERT ... SELECT FROM unnest of one array per column that varies (key, payload, due
        # time); what one offer shares (queue, payload type, creation time) is bound once. The
        # statement stays small and cached whatever the batch size, instead of 7 parameters per row.
        # One NOTIFY for the batch, in the same transaction, rather than one per row.
        _, _, _, payload_type, _, _, created_at, _ = rows[0]
        keys, payloads, due = [], [], []
        for row_queue, key, payload, row_type, scheduled_at, initially, row_created, _ in rows:
            if (row_queue, row_type, row_created, initially) != (queue, payload_type, created_at, scheduled_at):
                raise ValueError("insert_many_if_absent takes the rows of one offer: one queue, type and time")
            keys.append(key)
            payloads.append(payload)
            due.append(scheduled_at)
        params = {
            "queue": queue,
            "payload_type": payload_type,
            "created_at": created_at,
            "key": keys,
            "payload": payloads,
            "scheduled_at": due,
        }
        created = set(conn.execute(stmts.memo(_insert_unnest), params).scalars().all())
        if created and stmts.notify is not None:
            conn.execute(stmts.notify, {"queue_name": queue})
        return created

    def claim(
        self,
        conn: Connection,
        stmts: Statements,
        params: Mapping[str, Any],
        visibility_ms: int,
        level: Level = "",
    ) -> list[ClaimedRow]:
        # One statement: the MATERIALIZED CTE picks and locks the ids exactly once. The plainer
        # `WHERE id IN (SELECT ... LIMIT n FOR UPDATE SKIP LOCKED)` may be re-run per outer row
        # by a nested-loop plan and then claims more than n rows.
        rows = conn.execute(
            stmts.memo(_claim_statement, params["limit"], level), {**params, "visibility": visibility_ms}
        ).all()
        claimed = [ClaimedRow._make(row) for row in rows]
        claimed.sort(key=lambda r: (r.due_at, r.id))
        return claimed

    def extend_held(self, conn: Connection, stmts: Statements, params: Mapping[str, Any]) -> dict[int, int]:
        # One statement: pick the rows SKIP LOCKED in a MATERIALIZED CTE, update and return them.
        return {int(r.id): int(r.scheduled_at) for r in conn.execute(stmts.memo(_extend_held_statement), params)}

    def delete_held(self, conn: Connection, stmts: Statements, params: Mapping[str, Any]) -> int:
        return int(conn.execute(stmts.memo(_delete_held_statement), params).rowcount)

    keeps_in_one_statement: ClassVar[bool] = True

    def keep_held(
        self,
        conn: Connection,
        stmts: Statements,
        params: Mapping[str, Any],
        *,
        skip_locked: bool,
        only_unique: bool,
        notify: bool,
    ) -> int:
        # One statement: pick the held rows (FOR UPDATE, SKIP LOCKED for background acks) in a MATERIALIZED
        # CTE, DELETE them RETURNING their columns, INSERT those into the finished table joined to the
        # deliveries' results and durations (arrays), count; the payloads never travel to the client.
        stmt = stmts.memo(_keep_held_statement, skip_locked, only_unique, notify)
        return int(conn.execute(stmt, params).scalar_one())

    # Topics
    def topic_upsert(self, table: sa.Table, keys: Sequence[str], set_: Mapping[str, Any] | None) -> sa.Insert:
        insert = pg_insert(table)
        if set_ is None:
            return insert.on_conflict_do_nothing(index_elements=list(keys))
        return insert.on_conflict_do_update(index_elements=list(keys), set_=dict(set_))

    def adding_upsert(self, table: sa.Table, keys: Sequence[str], counts: Sequence[str]) -> sa.Insert:
        insert = pg_insert(table)
        added = {c: table.c[c] + insert.excluded[c] for c in counts}
        return insert.on_conflict_do_update(index_elements=list(keys), set_=added)

    def any_of(self, column: sa.ColumnElement[Any], name: str) -> sa.ColumnElement[bool]:
        # One array parameter (as ``id_in``): one statement text whatever the list's length, prepared
        # once, instead of a parameter per value (1,000 held partitions cost a poll ~25 ms to bind).
        # Only where the rows around are bounded anyway (a group's offsets): a generic plan, on statistics
        # taken while the table was small, filters by the array instead of probing the index with it.
        return column == sa.any_(_array(name, column.type))


def _picked_held(stmts: Statements) -> sa.CTE:
    return stmts.lock_held_skipping.cte("picked").prefix_with("MATERIALIZED")


def _extend_held_statement(stmts: Statements) -> sa.Update:
    m, picked = stmts.tables.messages, _picked_held(stmts)
    return (
        sa.update(m)
        .where(m.c.id == picked.c.id, _held_token(m.c.lock_token))
        .values(scheduled_at=stmts.extended_expiry)
        .returning(m.c.id, m.c.scheduled_at)
    )


def _delete_held_statement(stmts: Statements) -> sa.Delete:
    m, picked = stmts.tables.messages, _picked_held(stmts)
    return sa.delete(m).where(m.c.id == picked.c.id, _held_token(m.c.lock_token), m.c.unique_for_ms.is_(None))


def _held_pairs(ids: sa.ColumnElement[int], tokens: sa.ColumnElement[str]) -> sa.ColumnElement[bool]:
    """``held_in``: (id, token) is one of the pairs bound as two arrays."""
    held = _unnest("held", ("held_ids", sa.BigInteger()), ("held_tokens", sa.String()))
    return sa.and_(_held_token(tokens), sa.tuple_(ids, tokens).in_(sa.select(held.c.held_ids, held.c.held_tokens)))


def _keep_held_statement(stmts: Statements, skip_locked: bool, only_unique: bool, notify: bool) -> sa.Select[Any]:
    m, fin, now = stmts.tables.messages, stmts.tables.finished, stmts.now
    pick = sa.select(m.c.id).where(_held_pairs(m.c.id, m.c.lock_token))
    if only_unique:
        pick = pick.where(m.c.unique_for_ms.is_not(None))
    picked = pick.with_for_update(skip_locked=skip_locked).cte("picked").prefix_with("MATERIALIZED")
    kept_columns = [
        "queue",
        "key",
        "payload",
        "payload_type",
        "scheduled_at_initially",
        "created_at",
        "attempts",
        "last_error",
        "attempt_history",
        "headers",
        "tags",
        "priority",
        "group_key",
    ]
    gone = (
        sa.delete(m)
        .where(m.c.id == picked.c.id, _held_token(m.c.lock_token))
        .returning(m.c.id, m.c.unique_for_ms, *(m.c[c] for c in kept_columns))
        .cte("gone")
    )
    extra = _unnest(
        "extra",
        ("keep_ids", sa.BigInteger()),
        ("keep_durations", sa.BigInteger()),
        ("keep_results", sa.LargeBinary()),
        ("keep_result_types", sa.String()),
    )
    retention = sa.bindparam("retention_ms", type_=sa.BigInteger)
    rows = sa.select(
        *(gone.c[c] for c in kept_columns),
        sa.literal_column("1", sa.SmallInteger).label("state"),
        now.label("finished_at"),
        extra.c.keep_durations,
        extra.c.keep_results,
        extra.c.keep_result_types,
        (now + sa.func.greatest(retention, sa.func.coalesce(gone.c.unique_for_ms, 0))).label("expires_at"),
        sa.bindparam("worker", type_=sa.String).label("worker"),
    ).select_from(gone.outerjoin(extra, extra.c.keep_ids == gone.c.id))
    into = [*kept_columns, "state", "finished_at", "duration_ms", "result", "result_type", "expires_at", "worker"]
    kept = sa.insert(fin).from_select(into, rows).returning(fin.c.id).cte("kept")
    count = sa.select(sa.func.count()).select_from(kept).scalar_subquery().label("kept")
    if notify:
        return sa.select(count, sa.func.pg_notify(fin.name, sa.bindparam("queue_name", type_=sa.String)))
    return sa.select(count)


def _held_token(tokens: sa.ColumnElement[str]) -> sa.ColumnElement[bool]:
    """The token is one of the held pairs' distinct tokens (``held_params``): a probe of the lock-token index
    per token, for ``held_in`` and for the join back to the picked rows."""
    return tokens == sa.any_(_array("held_token_set", sa.String()))


def _claim_statement(stmts: Statements, limit: int, level: Level = "") -> sa.Update:
    m = stmts.tables.messages
    picked = (
        sa.select(m.c.id, m.c.scheduled_at)
        .where(m.c.queue == sa.bindparam("queue_name", type_=sa.String), m.c.scheduled_at <= stmts.now)
        .where(*at_level(m, level))
        .order_by(m.c.scheduled_at, m.c.id)
        .limit(claim_limit(limit))
        .with_for_update(skip_locked=True)
        .cte("picked")
        .prefix_with("MATERIALIZED")
    )
    return (
        sa.update(m)
        .where(m.c.id == picked.c.id)
        .values(
            lock_token=sa.bindparam("token", type_=sa.String),
            scheduled_at=stmts.now + sa.bindparam("visibility", type_=sa.BigInteger),
            attempts=m.c.attempts + 1,
        )
        .returning(
            m.c.id,
            m.c.key,
            m.c.payload,
            m.c.payload_type,
            picked.c.scheduled_at,
            m.c.scheduled_at,
            m.c.attempts,
            m.c.created_at,
            m.c.scheduled_at_initially,
            m.c.lock_token,
            m.c.tags,
            m.c.priority,
            m.c.group_key,
        )
    )


_UNNEST_COLUMNS: dict[str, sa.types.TypeEngine[Any]] = {
    "key": sa.String(),
    "payload": sa.LargeBinary(),
    "scheduled_at": sa.BigInteger(),
}


def _insert_unnest(stmts: Statements) -> sa.Insert:
    m = stmts.tables.messages
    new = _unnest("new_rows", *_UNNEST_COLUMNS.items())
    shared = {
        name: sa.bindparam(name, type_=type_)
        for name, type_ in (("queue", sa.String()), ("payload_type", sa.String()), ("created_at", sa.BigInteger()))
    }
    row = sa.select(
        shared["queue"].label("queue"),
        new.c.key,
        new.c.payload,
        shared["payload_type"].label("payload_type"),
        new.c.scheduled_at,
        new.c.scheduled_at.label("scheduled_at_initially"),
        shared["created_at"].label("created_at"),
    )
    return (
        pg_insert(m)
        .from_select(
            ["queue", "key", "payload", "payload_type", "scheduled_at", "scheduled_at_initially", "created_at"], row
        )
        .on_conflict_do_nothing(index_elements=["queue", "key"])
        .returning(m.c.key)
    )


def _unnest(name: str, *columns: tuple[str, sa.types.TypeEngine[Any]]) -> Any:
    """``unnest(:a, :b, …) AS name(a, b, …)``: rows from one array parameter per column."""
    arrays = [_array(c, t) for c, t in columns]
    return sa.func.unnest(*arrays).table_valued(*(c for c, _ in columns)).render_derived(name=name)
