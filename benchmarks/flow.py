"""Flow control (docs/workers.md, "Flow control") beside a hand-written ceiling of the same semantics.

    python -m benchmarks --flow                      # every backend
    python -m benchmarks --flow --quick --backends mysql

Each row drains a queue with ``try_poll_many(100)`` + ``ack_many`` on one thread, delayq and the ceiling
taking turns round by round (so the machine's other load slows both alike). The ceiling is the claim
docs/workers.md describes, written by hand on SQLAlchemy Core: the same statements in the same
transactions (the flow row locked, the held messages counted, the claim of each priority level, the token
bucket, the group pick), without delayq's layers (its flow cache, deliveries, serializers, retries,
metrics). The acks are one ``DELETE`` of the claimed ids under the claim's token.

Rows:

- priorities: the queue's messages at three levels (5, 0, -5), claimed level by level from the top;
- a concurrency limit (1000: above what one claimer holds, so it never binds: the cost of the check);
- a rate limit (1,000,000 per second: it never binds either: the cost of the bucket);
- groups: 200 groups, group concurrency 1, their messages interleaved in due order;
- the priority index on offers (MySQL/MariaDB have no partial index, so every message of a plain queue has
  an entry there): delayq's ``offer`` and ``offer_many`` into the table as migrated beside a copy whose
  priority index was dropped ("ceiling" = without the index; a ratio below 1 is the index's cost).
"""

from __future__ import annotations

import datetime as dt
import math
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from delayq import DelayedQueue, migrations

Measure = Callable[[str, Callable[[], tuple[float, float | None, list[float]]]], None]
ROUNDS = 4
BATCH = 100
LEVELS = (5, 0, -5)
GROUPS = 200
GROUP_SCAN = 500
NO_INDEX_PREFIX = "benchnp_"


class Ceiling:
    """The hand-written claims, on an engine of their own with the isolation delayq's claims use."""

    def __init__(self, engine: sa.Engine, prefix: str) -> None:
        name = engine.dialect.name
        self.name = name
        url = engine.url
        if name == "sqlite":
            self.engine = sa.create_engine(url, connect_args={"timeout": 30})

            @sa.event.listens_for(self.engine, "connect")
            def _connect(dbapi_conn: Any, _: object) -> None:
                dbapi_conn.isolation_level = None  # BEGIN sent below
                dbapi_conn.execute("PRAGMA journal_mode=WAL")

            @sa.event.listens_for(self.engine, "begin")
            def _begin(conn: Connection) -> None:
                conn.exec_driver_sql("BEGIN IMMEDIATE")

        else:
            self.engine = sa.create_engine(url, pool_size=2, isolation_level="READ COMMITTED")
        md = sa.MetaData()
        self.m = sa.Table(f"{prefix}messages", md, autoload_with=self.engine)
        self.flow = sa.Table(f"{prefix}queue_flow", md, autoload_with=self.engine)
        self.now = sa.literal_column(
            {
                "postgresql": "CAST(floor(EXTRACT(epoch FROM statement_timestamp()) * 1000) AS BIGINT)",
                "mysql": "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)",
                "sqlite": "CAST(round((julianday('now') - 2440587.5) * 86400000.0) AS BIGINT)",
            }[name],
            sa.BigInteger,
        )

    def hint(self, stmt: Any, index: str) -> Any:
        """``stmt`` with MySQL's ``FORCE INDEX`` of delayq's index ``{table}_{index}`` (other backends: as is)."""
        m = self.m
        return stmt.with_hint(m, f"FORCE INDEX ({m.name}_{index})", dialect_name="mysql")

    # -- the claim of n due messages (of one level), each backend's own -------------------------------------
    def claim(self, conn: Connection, queue: str, n: int, token: str, *where: Any, index: str = "due_ix") -> list[Any]:
        m, now = self.m, self.now
        pick = self.hint(
            sa.select(*((m.c.id, m.c.key) if self.name == "mysql" else (m.c.id,)))
            .where(m.c.queue == queue, m.c.scheduled_at <= now, *where)
            .order_by(m.c.scheduled_at, m.c.id)
            .limit(n),
            index,
        )
        mark = {"scheduled_at": now + 300000, "lock_token": token, "attempts": m.c.attempts + 1}
        if self.name == "postgresql":
            picked = pick.with_for_update(skip_locked=True).cte("picked").prefix_with("MATERIALIZED")
            stmt = sa.update(m).where(m.c.id == picked.c.id).values(mark).returning(m.c.id, m.c.key)
            return list(conn.execute(stmt).all())
        if self.name == "mysql":
            return self.mark(conn, conn.execute(pick.with_for_update(skip_locked=True)).all(), token)
        stmt = sa.update(m).where(m.c.id.in_(pick)).values(mark).returning(m.c.id, m.c.key)
        return list(conn.execute(stmt).all())

    def mark(self, conn: Connection, rows: Sequence[Any], token: str) -> list[Any]:
        """Mark the given locked (id, key) rows claimed under ``token``; returns them."""
        if not rows:
            return []
        m, now = self.m, self.now
        mark = {"scheduled_at": now + 300000, "lock_token": token, "attempts": m.c.attempts + 1}
        conn.execute(sa.update(m).where(m.c.id.in_([r[0] for r in rows])).values(mark))
        return list(rows)

    def ack(self, conn: Connection, rows: Sequence[Any], token: str) -> None:
        m = self.m
        conn.execute(sa.delete(m).where(m.c.id.in_([r[0] for r in rows]), m.c.lock_token == token))

    # -- priorities: level by level, from the top ----------------------------------------------------------
    def claim_by_priority(self, conn: Connection, queue: str, n: int, token: str) -> list[Any]:
        m = self.m
        got: list[Any] = []
        below, zero_done = 1001, False
        while len(got) < n:
            top = conn.execute(
                self.hint(
                    sa.select(m.c.priority)
                    .where(m.c.queue == queue, m.c.priority < below, m.c.priority != 0)
                    .order_by(m.c.priority.desc())
                    .limit(1),
                    "priority_ix",
                )
            ).scalar()
            if not zero_done and (top is None or top < 0):
                level, zero_done = 0, True
            elif top is None:
                break
            else:
                level = below = top
            at_level: tuple[Any, ...] = (
                (m.c.priority == 0,) if level == 0 else (m.c.priority == level, m.c.priority != 0)
            )
            index = "due_ix" if level == 0 else "priority_ix"
            asked = n - len(got)
            rows = self.claim(conn, queue, asked, token, *at_level, index=index)
            got += rows
            if len(rows) < asked:  # a due message passed by at this level: the claim ends here
                passed = conn.execute(
                    self.hint(
                        sa.select(m.c.id).where(m.c.queue == queue, m.c.scheduled_at <= self.now, *at_level).limit(1),
                        index,
                    )
                ).first()
                if passed is not None:
                    break
        return got

    # -- limits: the flow row locked, then the count or the bucket -----------------------------------------
    def _flow_row(self, conn: Connection, queue: str) -> Any:
        f = self.flow
        return conn.execute(
            sa.select(
                f.c.concurrency,
                f.c.rate,
                f.c.rate_period_ms,
                f.c.tokens,
                f.c.tokens_at,
                f.c.group_concurrency,
                self.now.label("now"),
            )
            .where(f.c.queue == queue)
            .with_for_update()
        ).one()

    def _held(self, queue: str, *columns: Any) -> Any:
        m = self.m
        stmt = self.hint(
            sa.select(*columns).where(
                m.c.lock_token.is_not(None),
                m.c.lock_token > "",
                sa.func.coalesce(m.c.queue, m.c.queue) == queue,
                sa.func.coalesce(m.c.scheduled_at, m.c.scheduled_at) > self.now,
            ),
            "lock_ix",
        )
        return stmt

    def claim_concurrency(self, conn: Connection, queue: str, n: int, token: str) -> list[Any]:
        row = self._flow_row(conn, queue)
        held = conn.execute(self._held(queue, sa.func.count())).scalar_one()
        room = min(n, int(row.concurrency) - int(held))
        return self.claim(conn, queue, room, token) if room > 0 else []

    def claim_rate(self, conn: Connection, queue: str, n: int, token: str) -> list[Any]:
        row = self._flow_row(conn, queue)
        rate, period = int(row.rate), max(1, int(row.rate_period_ms))
        at = int(row.tokens_at if row.tokens_at is not None else row.now)
        tokens = min(float(rate), float(row.tokens or 0.0) + max(0, int(row.now) - at) * rate / period)
        take = min(n, math.floor(tokens))
        rows = self.claim(conn, queue, take, token) if take > 0 else []
        f = self.flow
        conn.execute(sa.update(f).where(f.c.queue == queue).values(tokens=tokens - len(rows), tokens_at=int(row.now)))
        return rows

    def claim_groups(self, conn: Connection, queue: str, n: int, token: str) -> list[Any]:
        m = self.m
        row = self._flow_row(conn, queue)
        per_group = int(row.group_concurrency or 1)
        held = Counter(
            {
                g: int(c)
                for g, c in conn.execute(
                    self._held(queue, m.c.group_key, sa.func.count())
                    .where(m.c.group_key.is_not(None))
                    .group_by(m.c.group_key)
                )
            }
        )
        candidates = conn.execute(
            self.hint(
                sa.select(m.c.id, m.c.group_key)
                .where(m.c.queue == queue, m.c.scheduled_at <= self.now)
                .order_by(m.c.scheduled_at, m.c.id)
                .limit(GROUP_SCAN),
                "due_ix",
            )
        ).all()
        picked: list[int] = []
        for id_, group in candidates:
            if group is not None:
                if held[group] >= per_group:
                    continue
                held[group] += 1
            picked.append(id_)
            if len(picked) == n:
                break
        if not picked:
            return []
        lock = sa.select(m.c.id, m.c.key).where(m.c.id.in_(picked), m.c.scheduled_at <= self.now)
        if self.name == "postgresql":  # lock and mark in one statement, as the plain claim does
            locked = lock.with_for_update(skip_locked=True).cte("locked").prefix_with("MATERIALIZED")
            mark = {"scheduled_at": self.now + 300000, "lock_token": token, "attempts": m.c.attempts + 1}
            stmt = sa.update(m).where(m.c.id == locked.c.id).values(mark).returning(m.c.id, m.c.key)
            return list(conn.execute(stmt).all())
        return self.mark(conn, conn.execute(lock.with_for_update(skip_locked=True)).all(), token)


def _clear(engine: sa.Engine, prefix: str) -> None:
    with engine.begin() as conn:
        for table in (f"{prefix}messages", f"{prefix}queue_flow"):
            conn.exec_driver_sql(f"DELETE FROM {table}" if engine.dialect.name == "sqlite" else f"TRUNCATE {table}")


def _remaining(engine: sa.Engine, prefix: str, queue: str) -> int:
    with engine.connect() as conn:
        return int(conn.exec_driver_sql(f"SELECT count(*) FROM {prefix}messages WHERE queue = '{queue}'").scalar_one())


def _drain_rows(
    engine: sa.Engine,
    prefix: str,
    n: int,
    queue: str,
    setup: Callable[[DelayedQueue], None],
    fill: Callable[[DelayedQueue, int, str], set[str]],
    claim: Callable[[Ceiling, Connection, str, int, str], list[Any]],
) -> tuple[float, float, list[float]]:
    """Drain ``n`` messages with delayq and ``n`` with the ceiling, round by round; each side checked
    exactly once and the queue left empty."""
    _clear(engine, prefix)
    setup(DelayedQueue(engine, queue, table_prefix=prefix))
    ceil = Ceiling(engine, prefix)
    with ceil.engine.connect():  # its first connection outside the timing, as delayq's engine has one
        pass
    ours_time = theirs_time = 0.0
    per = n // ROUNDS
    for r in range(ROUNDS):
        q = DelayedQueue(engine, queue, table_prefix=prefix)  # flow row read afresh
        expected = fill(q, per, f"o{r}-")
        delivered: Counter[str] = Counter()
        start = time.perf_counter()
        while got := q.try_poll_many(BATCH):
            q.ack_many(got)
            delivered.update(d.key for d in got)
        ours_time += time.perf_counter() - start
        _check(engine, prefix, queue, expected, delivered, "delayq")

        expected = fill(q, per, f"c{r}-")
        delivered = Counter()
        start = time.perf_counter()
        while True:
            token = str(uuid.uuid4())
            with ceil.engine.begin() as conn:
                rows = claim(ceil, conn, queue, BATCH, token)
            if not rows:
                break
            with ceil.engine.begin() as conn:
                ceil.ack(conn, rows, token)
            delivered.update(r[1] for r in rows)
        theirs_time += time.perf_counter() - start
        _check(engine, prefix, queue, expected, delivered, "ceiling")
    ceil.engine.dispose()
    done = ROUNDS * per
    return done / ours_time, done / theirs_time, []


def _check(engine: sa.Engine, prefix: str, queue: str, expected: set[str], got: Counter[str], what: str) -> None:
    left = _remaining(engine, prefix, queue)
    if set(got) != expected or (got and max(got.values()) != 1) or left:
        raise AssertionError(
            f"flow {what}: {len(expected - set(got))} not delivered, "
            f"{sum(1 for v in got.values() if v > 1)} twice, {left} left"
        )


def _fill_plain(q: DelayedQueue, n: int, tag: str) -> set[str]:
    keys = [f"{tag}{i}" for i in range(n)]
    for b in range(0, n, 1000):
        q.offer_many([(k, {"k": k}, None) for k in keys[b : b + 1000]])
    return set(keys)


def _fill_levels(q: DelayedQueue, n: int, tag: str) -> set[str]:
    keys = [f"{tag}{i}" for i in range(n)]
    for j, level in enumerate(LEVELS):  # the low levels first: the claim must still take the high ones first
        mine = keys[len(LEVELS) - 1 - j :: len(LEVELS)]
        for b in range(0, len(mine), 1000):
            q.offer_many([(k, {"k": k}, None) for k in mine[b : b + 1000]], priority=level)
    return set(keys)


def _fill_groups(q: DelayedQueue, n: int, tag: str) -> set[str]:
    """n messages over ``GROUPS`` groups, interleaved in due order (all due in the past)."""
    base = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
    keys: list[str] = []
    per_group = -(-n // GROUPS)
    for g in range(GROUPS):
        items = [
            (f"{tag}{i * GROUPS + g}", {"g": g}, base + dt.timedelta(milliseconds=i * GROUPS + g))
            for i in range(per_group)
            if i * GROUPS + g < n
        ]
        if items:
            q.offer_many(items, group=f"g{g}")
            keys += [k for k, _, _ in items]
    return set(keys)


def _offers_with_and_without_index(
    engine: sa.Engine, prefix: str, n: int, batch: int | None
) -> tuple[float, float, list[float]]:
    """delayq's offers into the table as migrated ("delayq") and into a copy without the priority index
    ("ceiling"), call by call in turns."""
    _clear(engine, prefix)
    _clear(engine, NO_INDEX_PREFIX)
    with_ix = DelayedQueue(engine, "flow_offer", table_prefix=prefix)
    without = DelayedQueue(engine, "flow_offer", table_prefix=NO_INDEX_PREFIX)
    without.offer("warm-up", {})  # the first call's connection and statement cache outside the timing
    ours = theirs = 0.0
    step = batch or 1
    for b in range(0, n, step):
        sides = ((True, with_ix), (False, without))
        for side, q in sides if (b // step) % 2 == 0 else sides[::-1]:  # who goes first alternates
            start = time.perf_counter()
            if batch:
                q.offer_many([(f"k{i}", {"n": i}, None) for i in range(b, min(n, b + batch))])
            else:
                q.offer(f"k{b}", {"n": b})
            spent = time.perf_counter() - start
            if side:
                ours += spent
            else:
                theirs += spent
    return n / ours, n / theirs, []


def _drop_priority_index(engine: sa.Engine) -> None:
    """Migrate the ``benchnp_`` tables and drop their priority index (if it is there)."""
    migrations.upgrade(engine.url.render_as_string(hide_password=False), prefix=NO_INDEX_PREFIX)
    index = f"{NO_INDEX_PREFIX}messages_priority_ix"
    with engine.begin() as conn:
        names = {ix["name"] for ix in sa.inspect(conn).get_indexes(f"{NO_INDEX_PREFIX}messages")}
        if index in names:
            on = f" ON {NO_INDEX_PREFIX}messages" if engine.dialect.name == "mysql" else ""
            conn.exec_driver_sql(f"DROP INDEX {index}{on}")


def rows(engine: sa.Engine, prefix: str, n: int, offers: int, measure: Measure) -> None:
    """Measure every flow row on ``engine`` (migrated with ``prefix``): ``n`` messages per drain,
    ``offers`` per offer row."""

    measure(
        f"flow: try_poll_many({BATCH}) + ack_many, priorities {'/'.join(map(str, LEVELS))}",
        lambda: _drain_rows(
            engine,
            prefix,
            n,
            "flow_prio",
            lambda q: None,
            _fill_levels,
            lambda c, conn, queue, k, t: c.claim_by_priority(conn, queue, k, t),
        ),
    )
    measure(
        f"flow: try_poll_many({BATCH}) + ack_many, concurrency limit 1000",
        lambda: _drain_rows(
            engine,
            prefix,
            n,
            "flow_conc",
            lambda q: q.set_concurrency_limit(1000),
            _fill_plain,
            lambda c, conn, queue, k, t: c.claim_concurrency(conn, queue, k, t),
        ),
    )
    measure(
        f"flow: try_poll_many({BATCH}) + ack_many, rate limit 1,000,000/s",
        lambda: _drain_rows(
            engine,
            prefix,
            n,
            "flow_rate",
            lambda q: q.set_rate_limit(1_000_000),
            _fill_plain,
            lambda c, conn, queue, k, t: c.claim_rate(conn, queue, k, t),
        ),
    )
    measure(
        f"flow: try_poll_many({BATCH}) + ack_many, {GROUPS} groups, 1 each",
        lambda: _drain_rows(
            engine,
            prefix,
            n,
            "flow_group",
            lambda q: q.set_group_concurrency(1),
            _fill_groups,
            lambda c, conn, queue, k, t: c.claim_groups(conn, queue, k, t),
        ),
    )
    _drop_priority_index(engine)
    measure(
        "flow: offer (one per call), priority index (ceiling: dropped)",
        lambda: _offers_with_and_without_index(engine, prefix, offers, None),
    )
    measure(
        "flow: offer_many (500 per call), priority index (ceiling: dropped)",
        lambda: _offers_with_and_without_index(engine, prefix, offers * 10, 500),
    )
