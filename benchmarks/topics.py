"""Topics (``delayq.topics``) beside a raw-SQL ceiling measured in the same run.

Scenarios (registered in ``python -m benchmarks``, all named "topics: ..."; ``--only topics``):

- publish one message per call, and ``publish_many`` of 500, each beside the ceiling's publish;
- publishers of one partition while another publisher of it holds its transaction open 100 ms, over and
  over (their rate and latency; the "ceiling" is their rate with nothing held open);
- poll(100) + ack_many with 1 and with 4 subscribers (threads, each its own ``Subscription`` of one
  group) over a topic of 1,000 partitions, beside the ceiling's consumer reading the same log as a
  group of its own; every run checks that each message was acked exactly once and that both groups'
  watermarks reached the heads (lag 0), and fails instead of printing a figure otherwise;
- the time for a rebalance to settle when a 4th subscriber joins and when 1 of 4 leaves gracefully
  (every partition leased to a live subscriber, none holding more than ``ceil(partitions / live)``);
- the time until a group's lag is back to 0 after 1 of 4 subscribers is killed (stops without
  ``close()``: its leases must expire; a 2 s ``lease_duration`` and visibility timeout).

The three time scenarios print "/s" as 1 / mean time and the times themselves as p50/p99 (ms); they
have no ceiling (their cost is protocol rounds and lease expiry, not SQL).

The ceiling is what a hand-written implementation on the same tables would send (see ``CeilingPublisher``
and ``CeilingConsumer``). It keeps offsets in commit order per partition as delayq does (the head counter
row, locked by the publishing transaction), but keeps no per-message delivery state: a Kafka-style
consumer that commits one watermark per batch. It runs twice in each run, taking turns with delayq: on
SQLAlchemy's stack (the same SQL text on one SQLAlchemy ``Connection``, ``exec_driver_sql``: the stack
the design prescribes, and the ceiling the ratios are taken against) and on a bare DBAPI connection (the
physical limit, reported beside it as ``bare`` and ``stack/bare``). The stack ceiling holds one
``Connection`` for the run and sends text, so it skips the pool checkout per call and the compiled-cache
lookup delayq pays: its ratios are, if anything, low.
"""

from __future__ import annotations

import datetime as dt
import functools
import math
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from benchmarks import ceiling
from delayq import Subscription, Topic
from delayq.topics import group_lag, partition_for

PREFIX = "bench_"
TOPIC = "bench"
GROUP = "bench"
CEILING_GROUP = "ceiling"
PARTITIONS = 1000
BATCH = 500  # publish_many
POLL = 100  # poll(100) / the ceiling's offset range per partition
ROUNDS = 2  # consume: delayq and the ceiling take turns, round by round, over the same messages
PAYLOAD = b'{"n":1}'
TABLES = [
    f"{PREFIX}{t}"
    for t in (
        "topic_subscribers",
        "topic_offsets",
        "topic_leases",
        "topic_deliveries",
        "topic_log",
        "topic_heads",
        "topics",
    )
]
Result = tuple[float, float | None, list[float]]
Measure = Callable[[str, Callable[[], Result]], None]
VIAS = ("stack", "bare")


class StackCursor:
    """The cursor calls the ceilings make, run by a ``StackConnection`` (results read whole)."""

    def __init__(self, owner: StackConnection) -> None:
        self.owner = owner
        self.rows: list[Any] = []
        self.rowcount = -1

    def execute(self, sql: str, params: tuple[Any, ...] = ()) -> None:
        self.rows, self.rowcount = self.owner.run(sql, params)

    def executemany(self, sql: str, params: list[tuple[Any, ...]]) -> None:
        self.rows, self.rowcount = self.owner.run(sql, params)

    def fetchall(self) -> list[Any]:
        return self.rows


class StackConnection:
    """A ceiling's connection on SQLAlchemy's stack, the plainest way it allows, as ``benchmarks/stack.py``
    runs the queue's: a pooled ``Connection`` checked out per transaction (per statement in autocommit),
    begun as ``ceiling.connect`` begins its DBAPI one (autocommit, with explicit ``BEGIN``/``COMMIT`` text
    where the ceiling sends them, on PostgreSQL and SQLite; on MySQL/MariaDB READ COMMITTED, autocommit or
    transactions ended by ``commit()``); each SQL text, its placeholders made named bind parameters, one
    ``sa.text`` construct (compiled once, then found in SQLAlchemy's statement cache as delayq's are)."""

    def __init__(self, engine: sa.Engine, autocommit: bool) -> None:
        self.engine = engine
        self.isolation = "READ COMMITTED" if engine.dialect.name == "mysql" and not autocommit else "AUTOCOMMIT"
        self.placeholder = "?" if engine.dialect.name == "sqlite" else "%s"
        self.conn: sa.Connection | None = None  # held from BEGIN (or a transaction's first statement) to its end

    def cursor(self) -> StackCursor:
        return StackCursor(self)

    def run(self, sql: str, params: tuple[Any, ...] | list[tuple[Any, ...]]) -> tuple[list[Any], int]:
        """Run one statement (a list of parameter tuples: executemany): its rows and row count."""
        held = self.conn is not None
        conn = self.conn if self.conn is not None else self._checkout()
        try:
            if isinstance(params, list):
                named = [{f"b{i}": v for i, v in enumerate(row)} for row in params]
                result = conn.execute(_text(sql, self.placeholder), named)
            elif params:
                result = conn.execute(_text(sql, self.placeholder), {f"b{i}": v for i, v in enumerate(params)})
            else:
                result = conn.exec_driver_sql(sql)
            found = (list(result.fetchall()) if result.returns_rows else []), result.rowcount
        except BaseException:
            self.close()
            if not held:
                conn.close()
            raise
        if sql.startswith("BEGIN") or (not held and self.isolation != "AUTOCOMMIT"):
            self.conn = conn  # the transaction goes on
        elif sql == "COMMIT":
            self.close()
        elif not held:
            conn.close()
        return found

    def _checkout(self) -> sa.Connection:
        conn = self.engine.connect().execution_options(isolation_level=self.isolation)
        info = conn.connection.info
        if self.engine.dialect.name == "sqlite" and not info.get("busy_timeout"):
            conn.exec_driver_sql("PRAGMA busy_timeout = 30000")
            info["busy_timeout"] = True
        return conn

    def commit(self) -> None:
        if self.conn is not None:
            self.conn.commit()
        self.close()

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


@functools.cache
def _text(sql: str, placeholder: str) -> sa.TextClause:
    """``sql`` with its placeholders as ``:b0``, ``:b1``, …; arrays (``%s::int[]``) keep their casts."""
    count = iter(range(sql.count(placeholder)))

    def named(found: re.Match[str]) -> str:
        bind = f":b{next(count)}"
        return f"CAST({bind} AS {found.group(1)})" if found.group(1) else bind

    return sa.text(re.sub(re.escape(placeholder) + r"(?:::(\w+\[\]))?", named, sql))


def connect(engine: sa.Engine, autocommit: bool, via: str) -> Any:
    """A ceiling's connection: on SQLAlchemy's stack (``via="stack"``) or the bare driver's."""
    return StackConnection(engine, autocommit) if via == "stack" else ceiling.connect(engine, autocommit)


class LostMessages(AssertionError):
    pass


# -- helpers ----------------------------------------------------------------------------------------
def reset(engine: sa.Engine, partitions: int = PARTITIONS) -> Topic:
    """Empty every topic table (TRUNCATE: no dead rows left for the next run), create the topic again."""
    with engine.begin() as conn:
        if engine.dialect.name == "sqlite":
            for t in TABLES:
                conn.exec_driver_sql(f"DELETE FROM {t}")
        elif engine.dialect.name == "postgresql":
            conn.exec_driver_sql(f"TRUNCATE {', '.join(TABLES)}")
        else:
            for t in TABLES:
                conn.exec_driver_sql(f"TRUNCATE {t}")
    topic = Topic(engine, TOPIC, table_prefix=PREFIX)
    topic.create(partitions)
    return topic


def _q(engine: sa.Engine) -> str:
    return "`partition`" if engine.dialect.name == "mysql" else '"partition"'


def check_log(engine: sa.Engine, expected: int) -> None:
    """The log holds ``expected`` rows, with offsets 1..head in every partition (gap-free, no duplicate)."""
    p = _q(engine)
    with engine.connect() as conn:
        rows = conn.exec_driver_sql(
            f"SELECT h.{p}, h.head, count(l.message_offset), coalesce(max(l.message_offset), 0)"
            f" FROM {PREFIX}topic_heads h LEFT JOIN {PREFIX}topic_log l ON l.topic = h.topic AND l.{p} = h.{p}"
            f" WHERE h.topic = '{TOPIC}' GROUP BY h.{p}, h.head"
        ).all()
    total = sum(int(r[2]) for r in rows)
    bad = [r for r in rows if not int(r[1]) == int(r[2]) == int(r[3])]
    if total != expected or bad:
        raise LostMessages(f"publish: {total} rows in the log, {expected} expected; partitions with gaps: {bad[:3]}")


def run_threads(n: int, work: Callable[[int], object]) -> float:
    """Run ``work(i)`` in n threads started together; the wall time until the last one ends."""
    barrier = threading.Barrier(n + 1)
    errors: list[BaseException] = []

    def body(i: int) -> None:
        barrier.wait()
        try:
            work(i)
        except BaseException as exc:  # reported after join
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start


def subscribers(engine: sa.Engine, n: int, lease: dt.timedelta, **options: Any) -> list[Subscription]:
    return [
        Subscription(engine, TOPIC, GROUP, f"sub-{i}", lease_duration=lease, table_prefix=PREFIX, **options)
        for i in range(n)
    ]


def settled(engine: sa.Engine, live: list[Subscription]) -> bool:
    """Every partition leased (unexpired) to one of ``live``, none holding more than its fair share."""
    names = {s.name for s in live}
    now = dt.datetime.now(dt.UTC)
    lag = group_lag(engine, TOPIC, GROUP, table_prefix=PREFIX)
    held = Counter(p.holder for p in lag if p.holder in names and p.lease_expires_at and p.lease_expires_at > now)
    share = math.ceil(len(lag) / len(live))
    return sum(held.values()) == len(lag) and max(held.values(), default=0) <= share


def settle(engine: sa.Engine, live: list[Subscription], max_rounds: int = 20) -> tuple[float, int]:
    """Rounds of every subscriber rebalancing at once (threads) until settled: (seconds of rounds, rounds)."""
    spent = 0.0
    for rounds in range(1, max_rounds + 1):
        spent += run_threads(len(live), lambda i: live[i].rebalance())
        if settled(engine, live):
            return spent, rounds
    raise LostMessages(f"rebalance: {len(live)} subscribers did not settle within {max_rounds} rounds")


# -- the ceiling ------------------------------------------------------------------------------------
class CeilingPublisher:
    """Publishing as a hand-written implementation would, with offsets in commit order per partition.

    One message: the head counter UPDATE and the log row INSERT in one transaction. PostgreSQL: one
    autocommitted statement (``WITH h AS (UPDATE heads ... RETURNING head) INSERT INTO log SELECT ... FROM
    h``); MySQL/MariaDB and SQLite: UPDATE, then INSERT ... SELECT head (the row this transaction just
    locked), COMMIT. Idempotence is left to the unique constraint (a duplicate fails the statement and
    the transaction rolls back, head included); delayq looks the id up first and reports IGNORED.

    A batch: in one transaction, lock and read the touched head rows in partition order (concurrent
    batches cannot deadlock), one multi-row INSERT of the log rows (PostgreSQL: one array per column),
    one UPDATE of every touched head (PostgreSQL: joined to arrays; others: CASE), COMMIT. delayq sends
    the same plus the id lookup (PostgreSQL: joined to two arrays).
    """

    def __init__(
        self, engine: sa.Engine, prefix: str = PREFIX, partitions: int = PARTITIONS, via: str = "bare"
    ) -> None:
        self.name = name = engine.dialect.name
        self.head_table, self.log_table, self.partitions = f"{prefix}topic_heads", f"{prefix}topic_log", partitions
        self.raw = connect(engine, name == "postgresql", via)
        self.ph = "?" if name == "sqlite" else "%s"
        self.p, self.now = _q(engine), ceiling.NOW_MS[name]

    def close(self) -> None:
        self.raw.close()

    def _begin(self, cur: Any) -> None:
        if self.name == "sqlite":
            cur.execute("BEGIN IMMEDIATE")
        elif self.name == "postgresql":
            cur.execute("BEGIN")

    def _commit(self, cur: Any) -> None:
        self.raw.commit() if self.name == "mysql" else cur.execute("COMMIT")

    def one(self, key: str, mid: str, payload: bytes) -> None:
        part = partition_for(key, self.partitions)
        ph, p, cur = self.ph, self.p, self.raw.cursor()
        cols = f"topic, {p}, message_offset, partition_key, message_id, payload, payload_type, published_at"
        if self.name == "postgresql":
            cur.execute(
                f"WITH h AS (UPDATE {self.head_table} SET head = head + 1 WHERE topic = %s AND {p} = %s"
                f" RETURNING head) INSERT INTO {self.log_table} ({cols})"
                f" SELECT %s, %s, h.head, %s, %s, %s, 'json', {self.now} FROM h",
                (TOPIC, part, TOPIC, part, key, mid, payload),
            )
            return
        self._begin(cur)
        cur.execute(f"UPDATE {self.head_table} SET head = head + 1 WHERE topic = {ph} AND {p} = {ph}", (TOPIC, part))
        cur.execute(
            f"INSERT INTO {self.log_table} ({cols}) SELECT topic, {p}, head, {ph}, {ph}, {ph}, 'json', {self.now}"
            f" FROM {self.head_table} WHERE topic = {ph} AND {p} = {ph}",
            (key, mid, payload, TOPIC, part),
        )
        self._commit(cur)

    def many(self, items: list[tuple[str, str, bytes]]) -> None:
        ph, p, cur = self.ph, self.p, self.raw.cursor()
        parts = sorted({partition_for(k, self.partitions) for k, _, _ in items})
        marks = ", ".join([ph] * len(parts))
        lock = " FOR UPDATE" if self.name != "sqlite" else ""
        self._begin(cur)
        cur.execute(
            f"SELECT {p}, head, {self.now} FROM {self.head_table} WHERE topic = {ph} AND {p} IN ({marks})"
            f" ORDER BY {p}{lock}",
            (TOPIC, *parts),
        )
        locked = cur.fetchall()
        heads = {int(r[0]): int(r[1]) for r in locked}
        now = int(locked[0][2])
        rows = []
        for k, mid, payload in items:
            part = partition_for(k, self.partitions)
            heads[part] += 1
            rows.append((part, heads[part], k, mid, payload))
        cols = f"topic, {p}, message_offset, partition_key, message_id, payload, payload_type, published_at"
        if self.name == "postgresql":
            cur.execute(
                f"INSERT INTO {self.log_table} ({cols}) SELECT %s, v.p, v.o, v.k, v.m, v.b, 'json', %s FROM"
                " unnest(%s::int[], %s::bigint[], %s::varchar[], %s::varchar[], %s::bytea[]) AS v(p, o, k, m, b)",
                (TOPIC, now, *(list(c) for c in zip(*rows, strict=True))),
            )
            cur.execute(
                f"UPDATE {self.head_table} SET head = v.h FROM unnest(%s::int[], %s::bigint[]) AS v(p, h)"
                f" WHERE {self.head_table}.topic = %s AND {self.head_table}.{p} = v.p",
                (list(heads), list(heads.values()), TOPIC),
            )
        else:
            # One executemany of a one-row INSERT: MySQLdb sends it as one multi-row INSERT (when the VALUES hold
            # placeholders only), sqlite3 loops in C.
            cur.executemany(
                f"INSERT INTO {self.log_table} ({cols}) VALUES ({', '.join([ph] * 8)})",
                [(TOPIC, part, o, k, mid, b, "json", now) for part, o, k, mid, b in rows],
            )
            case = " ".join([f"WHEN {ph} THEN {ph}"] * len(heads))
            cur.execute(
                f"UPDATE {self.head_table} SET head = CASE {p} {case} END WHERE topic = {ph} AND {p} IN ({marks})",
                (*(v for item in heads.items() for v in item), TOPIC, *heads),
            )
        self._commit(cur)


class CeilingConsumer:
    """Consuming as a hand-written, Kafka-style implementation would: by offset range, one watermark per batch.

    It holds its partitions (a static share, no lease rows) and keeps their watermarks in memory (read
    once per drain). A pass reads the heads of its partitions (one SELECT, as delayq's poll does first);
    for each partition with a head above its watermark it reads the next offsets
    (``message_offset > mark AND message_offset <= mark + 100``, by primary key) and then moves the
    watermark with one autocommitted ``UPDATE ... SET acked_offset = :new WHERE ... AND acked_offset =
    :old`` (compare-and-swap: a fence against another holder). Passes repeat until none finds work.
    No per-message delivery state (no visibility timeout, nack, attempt count or dead letters): that
    is what delayq's poll and ack add per message.
    """

    def __init__(self, engine: sa.Engine, partitions: list[int], via: str = "bare") -> None:
        self.name = name = engine.dialect.name
        self.raw = connect(engine, True, via)
        self.parts = partitions
        self.group = group = f"{CEILING_GROUP}-{via}"
        ph, p = ("?" if name == "sqlite" else "%s"), _q(engine)
        marks = ", ".join([ph] * len(partitions))
        self.read_marks = (
            f"SELECT {p}, acked_offset FROM {PREFIX}topic_offsets WHERE consumer_group = '{group}'"
            f" AND topic = {ph} AND {p} IN ({marks})"
        )
        self.read_heads = f"SELECT {p}, head FROM {PREFIX}topic_heads WHERE topic = {ph} AND {p} IN ({marks})"
        self.read_range = (
            f"SELECT message_offset, message_id, payload FROM {PREFIX}topic_log WHERE topic = {ph} AND {p} = {ph}"
            f" AND message_offset > {ph} AND message_offset <= {ph} ORDER BY message_offset"
        )
        self.commit = (
            f"UPDATE {PREFIX}topic_offsets SET acked_offset = {ph}, updated_at = {ceiling.NOW_MS[name]}"
            f" WHERE consumer_group = '{group}' AND topic = {ph} AND {p} = {ph} AND acked_offset = {ph}"
        )

    def drain(self, delivered: Counter[str], lock: threading.Lock) -> None:
        cur = self.raw.cursor()
        cur.execute(self.read_marks, (TOPIC, *self.parts))
        marks = {int(r[0]): int(r[1]) for r in cur.fetchall()}
        while True:
            cur.execute(self.read_heads, (TOPIC, *self.parts))
            work = sorted((int(r[0]), int(r[1])) for r in cur.fetchall() if int(r[1]) > marks[int(r[0])])
            if not work:
                return
            for part, head in work:
                mark = marks[part]
                cur.execute(self.read_range, (TOPIC, part, mark, min(head, mark + POLL)))
                rows = cur.fetchall()
                new = int(rows[-1][0])
                cur.execute(self.commit, (new, TOPIC, part, mark))
                if cur.rowcount != 1:
                    raise LostMessages(f"ceiling: the watermark of partition {part} moved under it")
                marks[part] = new
                with lock:
                    delivered.update(r[1] for r in rows)

    def close(self) -> None:
        self.raw.close()


# -- publishing -------------------------------------------------------------------------------------
def _publishing(engine: sa.Engine, turns: int, per_call: int, ours: Callable[[int], object], ceilings: str) -> Result:
    """``ours(i)`` and the stack and bare ceilings' publisher method ``ceilings`` (``one``, ``many``) of the
    same messages (``_items(i, per_call)``), taking turns call by call (``ceiling.three_way``)."""
    publishers = {via: CeilingPublisher(engine, via=via) for via in VIAS}

    def theirs(via: str, prefix: str) -> Callable[[int], object]:
        method = getattr(publishers[via], ceilings)
        if ceilings == "one":
            return lambda i: method(f"k{i}", f"{prefix}{i}", PAYLOAD)
        return lambda i: method([(k, f"{prefix}{m}", PAYLOAD) for k, m, _ in _items(i, per_call)])

    try:
        figures = ceiling.three_way(turns * per_call, [ours, theirs("stack", "s"), theirs("bare", "c")], per_call)
    finally:
        for p in publishers.values():
            p.close()
    check_log(engine, 3 * turns * per_call)
    return figures


def _items(i: int, per_call: int) -> list[tuple[str, str, dict[str, int]]]:
    """The messages of call ``i``: (partition key, id without its side's prefix, payload)."""
    return [(f"k{n}", str(n), {"n": n}) for n in range(i * per_call, (i + 1) * per_call)]


def publish_single(engine: sa.Engine, n: int) -> Result:
    """``Topic.publish`` and the ceilings', taking turns call by call (the same keys, so the same partitions)."""
    topic = reset(engine)
    return _publishing(engine, n, 1, lambda i: topic.publish(f"k{i}", f"d{i}", {"n": i}), "one")


def publish_batches(engine: sa.Engine, n: int) -> Result:
    """``Topic.publish_many`` of 500 and the ceilings' batch, taking turns batch by batch."""
    topic = reset(engine)

    def ours(i: int) -> object:
        return topic.publish_many([(k, f"d{m}", p) for k, m, p in _items(i, BATCH)])

    return _publishing(engine, n // BATCH, BATCH, ours, "many")


HOLD = 0.1  # seconds a publisher keeps its transaction open (publish_beside_open_transaction)
PUBLISHERS = 3


def publish_beside_open_transaction(engine: sa.Engine, seconds: float) -> Result:
    """Publishers of one partition beside one whose transaction stays open: ``PUBLISHERS`` threads publish
    one message per call to one partition for ``seconds`` while another, over and over, publishes to the
    same partition in its own transaction and keeps it open ``HOLD`` (an outbox transaction doing other
    work), then commits. The figure is the others' rate and latency; the "ceiling" is their rate in the
    same run with no transaction held open. Not on SQLite, which has one writer: the holder stops every
    other writer, and they fail once its busy timeout is spent."""
    topic = reset(engine, partitions=4)
    key = "hot"

    def others(holding: bool) -> tuple[float, list[float]]:
        stop = threading.Event()
        latencies: list[float] = []
        lock = threading.Lock()

        def hold() -> None:
            n = 0
            while not stop.is_set():
                with engine.begin() as conn:
                    topic.publish(key, f"held-{holding}-{n}", {"n": n}, using=conn)
                    time.sleep(HOLD)
                n += 1

        def publish(i: int) -> None:
            n = 0
            deadline = time.perf_counter() + seconds
            while time.perf_counter() < deadline:
                took = ceiling.timed(functools.partial(topic.publish, key, f"p{holding}-{i}-{n}", {"n": n}))
                with lock:
                    latencies.append(took)
                n += 1

        holder = threading.Thread(target=hold) if holding else None
        if holder is not None:
            holder.start()
            time.sleep(HOLD / 2)
        try:
            spent = run_threads(PUBLISHERS, publish)
        finally:
            stop.set()
            if holder is not None:
                holder.join()
        return len(latencies) / spent, latencies

    quiet, _ = others(False)
    busy, latencies = others(True)
    return busy, quiet, latencies


# -- consuming --------------------------------------------------------------------------------------
def check_drained(engine: sa.Engine, group: str, expected: set[str], delivered: Counter[str], what: str) -> None:
    lagging = [p for p in group_lag(engine, TOPIC, group, table_prefix=PREFIX) if p.lag or p.pending]
    if set(delivered) != expected or (delivered and max(delivered.values()) != 1) or lagging:
        missing = len(expected - set(delivered))
        twice = sum(1 for v in delivered.values() if v > 1)
        raise LostMessages(
            f"{what}: {missing} not delivered, {twice} delivered twice, {len(lagging)} partitions with lag"
            f" (first: {lagging[:1]})"
        )


def consume(engine: sa.Engine, n: int, consumers: int) -> Result:
    """Drain n messages over 1,000 partitions with delayq (poll(100) + ack_many) and the same n with the
    ceiling (a group of its own reading the same log), in alternating rounds."""
    topic = reset(engine)
    offsets = sa.table(
        f"{PREFIX}topic_offsets",
        sa.column("consumer_group"),
        sa.column("topic"),
        sa.column("partition"),
        sa.column("acked_offset"),
        sa.column("updated_at"),
    )
    subs = subscribers(engine, consumers, dt.timedelta(minutes=10))
    for s in subs:
        s.join()
    with engine.begin() as conn:
        conn.execute(
            sa.insert(offsets),
            [
                {"consumer_group": f"{CEILING_GROUP}-{via}", "topic": TOPIC, "partition": p}
                | {"acked_offset": 0, "updated_at": 0}
                for via in VIAS
                for p in range(PARTITIONS)
            ],
        )
    raws = {
        via: [CeilingConsumer(engine, list(range(i, PARTITIONS, consumers)), via) for i in range(consumers)]
        for via in VIAS
    }
    lock = threading.Lock()
    spent = {"delayq": 0.0, "stack": 0.0, "bare": 0.0}
    bare_cpu = 0.0
    per_round = n // ROUNDS
    for r in range(ROUNDS):
        expected = {f"m{r}-{i}" for i in range(per_round)}
        keys = sorted(expected)
        for b in range(0, per_round, 1000):
            topic.publish_many([(k, k, {"k": k}) for k in keys[b : b + 1000]])
        settle(engine, subs)  # untimed: every subscriber holds its share (and its leases are renewed)
        seen: dict[str, Counter[str]] = {who: Counter() for who in spent}

        def ours(i: int, seen: dict[str, Counter[str]] = seen) -> None:
            sub = subs[i]
            while got := sub.poll(POLL):
                if not all(sub.ack_many(got)):
                    raise LostMessages(f"delayq: {sub.name} could not ack what it polled")
                with lock:
                    seen["delayq"].update(d.message_id for d in got)

        def theirs(via: str, seen: dict[str, Counter[str]] = seen) -> Callable[[int], None]:
            def drain(index: int) -> None:
                raws[via][index].drain(seen[via], lock)

            return drain

        order = ["delayq", *VIAS]
        for who in order[r % 3 :] + order[: r % 3]:  # the order rotates round by round
            if who == "delayq":
                spent[who] += run_threads(consumers, ours)
                continue
            cpu = time.process_time()
            spent[who] += run_threads(consumers, theirs(who))
            if who == "bare":
                bare_cpu += time.process_time() - cpu
        check_drained(engine, GROUP, expected, seen["delayq"], f"delayq x{consumers}")
        for via in VIAS:
            check_drained(engine, f"{CEILING_GROUP}-{via}", expected, seen[via], f"ceiling ({via}) x{consumers}")
    for s in subs:
        s.close()
    for c in (c for ceilings in raws.values() for c in ceilings):
        c.close()
    done = ROUNDS * per_round
    ceiling.BARE_RUNS.append((done / spent["stack"], done / spent["bare"], bare_cpu / done))
    return done / spent["delayq"], done / spent["stack"], []


# -- rebalancing ------------------------------------------------------------------------------------
NOTES: list[int] = []  # rounds to settle, per run (printed under the figure)


def rebalance_join(engine: sa.Engine) -> Result:
    """3 subscribers settled; a 4th joins: the time (rounds of all rebalancing at once) until settled."""
    reset(engine)
    subs = subscribers(engine, 4, dt.timedelta(minutes=10))
    settle(engine, subs[:3])
    start = time.perf_counter()
    subs[3].join()
    joined = time.perf_counter() - start
    spent, rounds = settle(engine, subs)
    NOTES.append(rounds)
    for s in subs:
        s.close()
    return 1 / (joined + spent), None, [joined + spent]


def rebalance_leave(engine: sa.Engine) -> Result:
    """4 subscribers settled; one calls close(): the time until the other 3 hold every partition, fairly."""
    reset(engine)
    subs = subscribers(engine, 4, dt.timedelta(minutes=10))
    settle(engine, subs)
    start = time.perf_counter()
    subs[3].close()
    closed = time.perf_counter() - start
    spent, rounds = settle(engine, subs[:3])
    NOTES.append(rounds)
    for s in subs[:3]:
        s.close()
    return 1 / (closed + spent), None, [closed + spent]


# -- a killed subscriber ----------------------------------------------------------------------------
LEASE = dt.timedelta(seconds=2)
BACKLOG = 400  # small: the survivors drain their own share long before the victim's leases expire


def lag_recovery(engine: sa.Engine) -> Result:
    """4 subscribers over 1,000 partitions, each rebalancing every lease_duration / 3 in a thread of its own
    and polling in another, as a worker does, with a backlog of 400 messages. One of them polls and acks
    10, polls 10 more and stops without acking or closing (killed): its partitions wait for its leases to
    expire (and its heartbeat to go stale), its 10 for the visibility timeout. The time from the kill until
    the group's lag is 0 (the floor is the 2 s lease); every message must have been acked exactly once."""
    topic = reset(engine)
    keys = [f"r{i}" for i in range(BACKLOG)]
    topic.publish_many([(k, k, {"k": k}) for k in keys])
    subs = subscribers(engine, 4, LEASE, visibility_timeout=LEASE)
    victim, survivors = subs[3], subs[:3]
    settle(engine, subs)
    acked: Counter[str] = Counter()
    lock = threading.Lock()
    stop = threading.Event()
    killed_at: list[float] = []
    errors: list[BaseException] = []

    def record(sub: Subscription, got: list[Any]) -> None:
        done = sub.ack_many(got)
        with lock:
            acked.update(d.message_id for d, ok in zip(got, done, strict=True) if ok)

    def guarded(body: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                body()
            except BaseException as exc:  # reported after join
                errors.append(exc)
                stop.set()

        return run

    def heartbeat(sub: Subscription) -> None:
        while not stop.is_set():
            sub.rebalance()
            stop.wait(LEASE.total_seconds() / 3)

    def consume(sub: Subscription) -> None:
        while not stop.is_set():
            if got := sub.poll(POLL):
                record(sub, got)
            else:
                stop.wait(0.02)

    def die() -> None:
        try:
            victim.rebalance()
            record(victim, victim.poll(10))
            victim.poll(10)  # in flight when it dies: back after the visibility timeout
        finally:
            killed_at.append(time.perf_counter())

    p = _q(engine)
    lag_sql = sa.text(
        f"SELECT coalesce(sum(h.head - o.acked_offset), 0) FROM {PREFIX}topic_offsets o JOIN {PREFIX}topic_heads h"
        f" ON h.topic = o.topic AND h.{p} = o.{p} WHERE o.consumer_group = :g AND o.topic = :t"
    )
    victims_sql = sa.text(
        f"SELECT count(*) FROM {PREFIX}topic_leases WHERE consumer_group = :g AND topic = :t AND holder = :me"
    )
    threads = [threading.Thread(target=guarded(die))]
    for sub in survivors:
        threads += [threading.Thread(target=guarded(functools.partial(heartbeat, sub)))]
        threads += [threading.Thread(target=guarded(functools.partial(consume, sub)))]
    for t in threads:
        t.start()
    handed_over = None
    try:
        threads[0].join()
        deadline = killed_at[0] + 60
        while not errors:  # one cheap query at a time: the monitor must not starve the subscribers
            with engine.connect() as conn:
                params = {"g": GROUP, "t": TOPIC, "me": victim.name}
                if handed_over is None and not conn.execute(victims_sql, params).scalar_one():
                    handed_over = time.perf_counter() - killed_at[0]
                if not conn.execute(lag_sql, params).scalar_one():
                    break
            if time.perf_counter() > deadline:
                raise LostMessages("lag recovery: the group's lag is not 0 a minute after the kill")
            time.sleep(0.02)
        recovered = time.perf_counter() - killed_at[0]
    finally:
        stop.set()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    lagging = [lag for lag in group_lag(engine, TOPIC, GROUP, table_prefix=PREFIX) if lag.lag or lag.pending]
    if lagging or set(acked) != set(keys) or max(acked.values()) != 1:
        raise LostMessages(
            f"lag recovery: {len(set(keys) - set(acked))} never acked, {sum(v > 1 for v in acked.values())}"
            f" acked twice, {len(lagging)} partitions with lag"
        )
    NOTES.append(round((handed_over or recovered) * 1000))
    for s in survivors:
        s.close()
    return 1 / recovered, None, [recovered]


# -- registration -----------------------------------------------------------------------------------
def measure_all(engine: sa.Engine, sizes: Any, measure: Measure) -> None:
    """Every topic scenario, through ``python -m benchmarks``'s ``measure`` (which honours ``--only``)."""
    measure("topics: publish (one per call)", lambda: publish_single(engine, sizes.single))
    measure(f"topics: publish_many ({BATCH} per call)", lambda: publish_batches(engine, sizes.batch))
    if engine.dialect.name != "sqlite":  # one writer: the open transaction stops every other (docs/topics.md)
        measure(
            f"topics: publish beside a transaction held {HOLD * 1000:.0f} ms, same partition",
            lambda: publish_beside_open_transaction(engine, 2.0 if sizes.repeat > 1 else 0.5),
        )
    for consumers in (1, 4):
        measure(
            f"topics: poll({POLL}) + ack_many, {consumers} sub(s), {PARTITIONS:,} partitions",
            functools.partial(consume, engine, sizes.consume_batch, consumers),
        )
    for scenario, fn in (
        ("topics: rebalance settles, a 4th sub joins (ms)", rebalance_join),
        ("topics: rebalance settles, 1 of 4 leaves (close) (ms)", rebalance_leave),
    ):
        NOTES.clear()
        measure(scenario, functools.partial(fn, engine))
        if NOTES:
            rounds = ", ".join(map(str, NOTES))
            print(f"{'':<10} (settled after {rounds} round(s) of every subscriber rebalancing at once)", flush=True)
    NOTES.clear()
    measure(f"topics: lag to 0 after 1 of 4 killed, lease {LEASE.seconds} s (ms)", lambda: lag_recovery(engine))
    if NOTES:
        handed = ", ".join(map(str, NOTES))
        print(f"{'':<10} (its partitions all held by the others after {handed} ms)", flush=True)
