"""MySQL 8 / MariaDB 10.6+ (mysqlclient): no UPDATE ... RETURNING, no LIMIT inside IN (subquery).

So the claim is the shared two-statement shape (SELECT ... FOR UPDATE SKIP LOCKED, then
UPDATE by id) in a READ COMMITTED transaction, where InnoDB takes no gap locks that would
deadlock consumers against producers. Duplicates are caught by error code: ``INSERT IGNORE``
would turn every error into a warning, not only the duplicate key.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError, DisconnectionError, IntegrityError
from sqlalchemy.pool import Pool

from delayq.dialects import bounds
from delayq.dialects.base import (
    NEW_KEY,
    NEW_PAYLOAD,
    ClaimedRow,
    Dialect,
    Level,
    Mode,
    NewRow,
    OwnedStart,
    Statements,
    at_level,
    candidate_rows,
    claim_limit,
    row_values,
    values_insert,
)
from delayq.errors import UnsupportedDatabaseError

# lock wait timeout, deadlock, server shutdown in progress, server gone away, lost connection, can't
# connect (TCP, socket), lost connection (system error), MariaDB "connection was killed", MySQL "client
# disconnected by server".
_TRANSIENT = {1205, 1213, 1053, 2006, 2013, 2003, 2002, 2055, 1927, 4031}
_MISSING_TABLE = 1146
_DUPLICATE_KEY = 1062
MYSQL_MIN = (8, 0, 1)
MARIADB_MIN = (10, 6)


# MariaDB's idle bound: seconds a transaction may sit idle before the server ends it (0: none). A transaction
# that wrote takes idle_write_transaction_timeout, one that only read idle_readonly_transaction_timeout, where
# the session sets them; else idle_transaction_timeout, which delayq sets (the session's own value is kept in a
# user variable and put back before anyone else's checkout).
_IDLE_MARK = "delayq_idle_transaction_timeout"
_PUT_IDLE_BACK = (
    "SET SESSION idle_transaction_timeout = CAST(COALESCE(@delayq_idle_transaction_timeout, 0) AS UNSIGNED),"
    " @delayq_idle_transaction_timeout = NULL"
)


def _set_idle(seconds: int) -> str:
    # (Every right-hand side of a SET is evaluated before any assignment: the saved value is the session's.)
    return (
        "SET @delayq_idle_transaction_timeout = COALESCE(@delayq_idle_transaction_timeout,"
        f" @@session.idle_transaction_timeout), SESSION idle_transaction_timeout = {seconds}"
    )


def _put_idle_back(dbapi_connection: Any, record: Any, proxy: Any) -> None:
    """A checkout (pool event): if delayq left its idle bound on the session and this checkout is not
    delayq's own, put the session's own value back first (a connection that cannot is replaced)."""
    if record.info.get(_IDLE_MARK) is None or bounds.OWN_CHECKOUT.get():
        return
    try:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(_PUT_IDLE_BACK)
        finally:
            cursor.close()
    except Exception as exc:
        raise DisconnectionError(f"could not reset the session's idle_transaction_timeout: {exc}") from exc
    del record.info[_IDLE_MARK]


# On every pool, once, as delayq is imported (a listener added to a pool while other threads check connections
# out of it can break their checkout): it acts only on connections delayq marked, at the cost of a dict lookup.
sa.event.listen(Pool, "checkout", _put_idle_back)


def _code(exc: DBAPIError) -> int | None:
    args = getattr(exc.orig, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def check_version(version: tuple[int, ...], mariadb: bool) -> None:
    """Raise ``UnsupportedDatabaseError`` for a server without SKIP LOCKED."""
    minimum, product = (MARIADB_MIN, "MariaDB") if mariadb else (MYSQL_MIN, "MySQL")
    if tuple(version[: len(minimum)]) < minimum:
        shown = ".".join(map(str, version))
        needed = ".".join(map(str, minimum))
        raise UnsupportedDatabaseError(
            f"{product} {shown} has no SELECT ... FOR UPDATE SKIP LOCKED; delayq needs {product} {needed} or newer"
        )


class MySQLDialect(Dialect):
    name: ClassVar[str] = "mysql"
    min_version: ClassVar[tuple[int, ...]] = MYSQL_MIN  # and MariaDB 10.6: SKIP LOCKED
    insert_returns_created: ClassVar[bool] = False
    update_returning: ClassVar[bool] = False  # MariaDB has no UPDATE … RETURNING
    # mysqlclient: a statement whose reply does not come in 60 s fails (and is retried by delayq);
    # set read_timeout in the URL for transactional handlers that run longer statements.
    network_timeouts: ClassVar[dict[str, int]] = {"connect_timeout": 10, "read_timeout": 60, "write_timeout": 60}

    def check_server(self) -> None:
        info = self.sa_dialect.server_version_info or ()
        check_version(
            tuple(int(v) for v in info if isinstance(v, int)), bool(getattr(self.sa_dialect, "is_mariadb", False))
        )

    def now_ms(self) -> sa.ColumnElement[int]:
        # UTC_TIMESTAMP is fixed for the statement and free of the session's time zone.
        return sa.literal_column(
            "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)", sa.BigInteger
        )

    def owned_start(
        self, mode: Mode, autocommitting: bool, idle_s: float | None = None, session: Mapping[str, Any] | None = None
    ) -> OwnedStart:
        # SET TRANSACTION applies to the next transaction only: the engine keeps its own level.
        # A single statement by primary or unique key locks just its row: no need for it there.
        # A statement that scans does need it: on a table whose statistics say it is nearly
        # empty, MariaDB deletes by a list of ids with a full scan, and under REPEATABLE READ
        # that locks every row until the commit, so claims meanwhile skip them all and find
        # nothing. READ COMMITTED lets go of the rows a statement does not change at once.
        # (Switching to autocommit would save the COMMIT, but mysqlclient switches it with a
        # round trip each way; an engine made with isolation_level="AUTOCOMMIT" saves it.)
        if mode in ("read", "statement"):
            return OwnedStart(commit=not autocommitting)
        isolation = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED"
        if autocommitting and mode == "scan":  # the statement is a transaction of its own
            return OwnedStart(sql=(isolation,), commit=False)
        marks: tuple[tuple[str, Any], ...] = ()
        if idle_s is not None and getattr(self.sa_dialect, "is_mariadb", False):
            # The idle bound, a session variable: set in the same query as the isolation level (mysqlclient
            # sends several statements in one) when the session does not have it yet, and left there for
            # delayq's next transaction on this connection; anyone else's checkout puts the session's own
            # value back first (``_put_idle_back``).
            seconds = max(1, math.ceil(idle_s))  # whole seconds only
            if (session or {}).get(_IDLE_MARK) != seconds:
                isolation = f"{_set_idle(seconds)}; {isolation}"
                marks = ((_IDLE_MARK, seconds),)
        start = (isolation, "START TRANSACTION") if autocommitting else (isolation,)
        return OwnedStart(sql=start, marks=marks)

    def autocommitting(self, dbapi_connection: Any) -> bool:
        return bool(dbapi_connection.get_autocommit())

    def is_transient(self, exc: DBAPIError) -> bool:
        return super().is_transient(exc) or _code(exc) in _TRANSIENT

    def is_missing_table(self, exc: DBAPIError) -> bool:
        return _code(exc) == _MISSING_TABLE

    def is_duplicate_key(self, exc: DBAPIError) -> bool:
        return _code(exc) == _DUPLICATE_KEY

    def insert_skipping_duplicates(self, table: sa.Table) -> sa.Insert:
        return sa.insert(table)

    def insert_if_absent(self, conn: Connection, stmts: Statements, params: Mapping[str, Any]) -> bool:
        # InnoDB rolls back just the failed statement; the transaction goes on.
        try:
            conn.execute(stmts.insert, params)
        except IntegrityError as exc:
            if self.is_duplicate_key(exc):
                return False
            raise
        return True

    def insert_many_if_absent(
        self, conn: Connection, stmts: Statements, queue: str, rows: Sequence[NewRow]
    ) -> set[str]:
        # One multi-row INSERT per part, assuming first that no key exists (the common case). A
        # duplicate key fails the whole statement, and InnoDB rolls back just that statement: the
        # transaction goes on without a savepoint. Then the existing keys are read and the rest
        # inserted; a producer racing in between makes it fall back to one row at a time.
        created: set[str] = set()
        for part in _parts(rows):
            if self._insert_rows(conn, stmts, part):
                created.update(r[NEW_KEY] for r in part)
                continue
            keys = {"queue_name": queue, "keys": [r[NEW_KEY] for r in part]}
            existing = set(conn.execute(stmts.existing_keys, keys).scalars())
            fresh = [r for r in part if r[NEW_KEY] not in existing]
            if fresh and self._insert_rows(conn, stmts, fresh):
                created.update(r[NEW_KEY] for r in fresh)
                continue
            created.update(r[NEW_KEY] for r in fresh if self._insert_rows(conn, stmts, [r]))
        return created

    def claim(
        self,
        conn: Connection,
        stmts: Statements,
        params: Mapping[str, Any],
        visibility_ms: int,
        level: Level = "",
    ) -> list[ClaimedRow]:
        # InnoDB locks every index record a locking range scan reads, and when fewer than n rows
        # are due the scan reads one past the due range: the next message to become due, maybe of
        # another queue, which other claims then skip for as long as this transaction is open. So
        # the range is read without locks, and only the picked rows are locked, by primary key
        # (point locks, no gap or next-record lock), skipping those another claim took meanwhile.
        # Consumers that read the same first ids race for them; a loser reads on past those ids
        # (a few times at most) rather than reporting an empty queue while messages are due.
        taken: list[int] = []
        for _ in range(CLAIM_READS):
            pick = _due_ids_past if taken else _due_ids
            due = stmts.memo(pick, params["limit"], level)
            ids: list[int] = list(conn.execute(due, {**params, "taken": taken}).scalars())
            if not ids:
                return []
            rows = conn.execute(stmts.memo(_lock_due_by_id), {**params, "ids": ids}).all()
            if rows:
                ordered = sorted(rows, key=lambda r: (r.scheduled_at, r.id))
                return self.mark_claimed(conn, stmts, params, ordered, visibility_ms)
            taken += ids
        return []

    def _insert_rows(self, conn: Connection, stmts: Statements, rows: Sequence[NewRow]) -> bool:
        """Insert the rows in one statement; False, inserting none, when a key exists."""
        try:
            conn.exec_driver_sql(values_insert(self.sa_dialect, stmts.tables.messages, len(rows)), row_values(rows))
        except IntegrityError as exc:
            if self.is_duplicate_key(exc):
                return False
            raise
        return True

    # Topics
    def topic_upsert(self, table: sa.Table, keys: Sequence[str], set_: Mapping[str, Any] | None) -> sa.Insert:
        # ON DUPLICATE KEY UPDATE; "do nothing" assigns a key column to itself (never INSERT IGNORE).
        from sqlalchemy.dialects.mysql import insert as mysql_insert

        insert = mysql_insert(table)
        return insert.on_duplicate_key_update(dict(set_) if set_ is not None else {keys[0]: table.c[keys[0]]})

    def adding_upsert(self, table: sa.Table, keys: Sequence[str], counts: Sequence[str]) -> sa.Insert:
        # ON DUPLICATE KEY UPDATE c = c + VALUES(c): the duplicate key is (only) the primary key ``keys``.
        from sqlalchemy.dialects.mysql import insert as mysql_insert

        insert = mysql_insert(table)
        return insert.on_duplicate_key_update({c: table.c[c] + insert.inserted[c] for c in counts})


def _due_ids(stmts: Statements, limit: int, level: Level = "") -> sa.Select[Any]:
    """The ids of the first due messages of ``:queue_name`` (of priority ``:at_priority`` with ``level``), read
    without locks."""
    m = stmts.tables.messages
    pick = sa.select(m.c.id)
    if level:  # statistics taken while the table was small pick the due index and filter by priority
        pick = pick.with_hint(m, f"FORCE INDEX ({m.name}_priority_ix)", dialect_name="mysql")
    return (
        pick.where(m.c.queue == sa.bindparam("queue_name", type_=sa.String), m.c.scheduled_at <= stmts.now)
        .where(*at_level(m, level))
        .order_by(m.c.scheduled_at, m.c.id)
        .limit(claim_limit(limit))
    )


def _due_ids_past(stmts: Statements, limit: int, level: Level = "") -> sa.Select[Any]:
    """``_due_ids`` leaving out ``:taken``, the ids other claims locked first."""
    return _due_ids(stmts, limit, level).where(stmts.tables.messages.c.id.not_in(sa.bindparam("taken", expanding=True)))


def _lock_due_by_id(stmts: Statements) -> sa.Select[Any]:
    """The messages ``:ids`` that are still due, locked by primary key, skipping those locked elsewhere."""
    m = stmts.tables.messages
    return (
        candidate_rows(stmts)
        .where(m.c.id.in_(sa.bindparam("ids", expanding=True)), m.c.scheduled_at <= stmts.now)
        .with_for_update(skip_locked=True)
    )


CLAIM_READS = 4
"""How many times a claim reads due ids when every one it read was taken by another claim meanwhile."""

MAX_STATEMENT_BYTES = 4 * 1024 * 1024
"""Payload bytes per multi-row INSERT: well under the server's max_allowed_packet (16 MiB by default)."""


def _parts(rows: Sequence[NewRow]) -> Iterator[Sequence[NewRow]]:
    """The rows in runs of at most ``MAX_STATEMENT_BYTES`` of payload (a larger row alone)."""
    start, size = 0, 0
    for i, row in enumerate(rows):
        size += len(row[NEW_PAYLOAD])
        if size > MAX_STATEMENT_BYTES and i > start:
            yield rows[start:i]
            start, size = i, len(row[NEW_PAYLOAD])
    if start < len(rows):
        yield rows[start:]
