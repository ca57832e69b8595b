"""A job's life (docs/lifecycle.md): what keeping finished messages costs the ack, each beside a ceiling.

- ``retention 0``: the ack is still one DELETE (now ``… AND unique_for_ms IS NULL``). Claims of 100 by the
  stack ceiling (``benchmarks/stack.py``), acked by delayq's DELETE against the DELETE main shipped before
  delayq_0007 (written here by hand); the ratio should stay at 1 (>= 0.95).
- ``retention on``: delayq's ``try_poll_many(100)`` + ``ack_many`` on a queue with ``retention=1h`` (the ack
  moves the messages into the finished table) against the same statements run by hand on SQLAlchemy Core:
  the stack's claim, then on PostgreSQL delayq's one statement (DELETE … RETURNING into INSERT, with the
  NOTIFY), elsewhere in one transaction the SELECT … FOR UPDATE of the held rows, the INSERT into the
  finished table (one executemany) and the DELETE by ids.

Each row drains ``n`` messages per side in alternating claims of 100, checks that every message was
delivered once, and empties the finished table after.
"""

from __future__ import annotations

import datetime as dt
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from benchmarks.stack import Stack
from delayq import DelayedQueue
from delayq.dialects.postgresql import _keep_held_statement
from delayq.queue._lifecycle import COMPLETED, lifecycle_sql
from delayq.schema import make_tables

BATCH = 100
Measure = Callable[[str, Callable[[], tuple[float, float | None, list[float]]]], None]


class Lost(AssertionError):
    pass


def _clear(engine: sa.Engine, prefix: str) -> None:
    tables = make_tables(prefix)
    with engine.begin() as conn:
        conn.execute(sa.delete(tables.messages))
        conn.execute(sa.delete(tables.finished))


def _fill(q: DelayedQueue, tag: str, n: int) -> set[str]:
    keys = [f"{tag}{i}" for i in range(n)]
    for b in range(0, n, 1000):
        q.offer_many([(k, {"k": k}, None) for k in keys[b : b + 1000]])
    return set(keys)


def _alternate(n: int, sides: list[Callable[[], list[str]]]) -> tuple[list[float], list[Counter[str]]]:
    """Call each side in turn until each has drained ``n`` messages; (seconds, deliveries) per side."""
    seconds = [0.0] * len(sides)
    seen: list[Counter[str]] = [Counter() for _ in sides]
    done = [0] * len(sides)
    while min(done) < n:
        for i, side in enumerate(sides):
            if done[i] >= n:
                continue
            t0 = time.perf_counter()
            keys = side()
            seconds[i] += time.perf_counter() - t0
            if not keys:
                raise Lost(f"side {i} found nothing after {done[i]} of {n}")
            seen[i].update(keys)
            done[i] += len(keys)
    return seconds, seen


def _check(expected: set[str], seen: Counter[str], what: str) -> None:
    if set(seen) != expected or max(seen.values()) != 1:
        raise Lost(f"{what}: {len(expected - set(seen))} not delivered, {sum(v > 1 for v in seen.values())} twice")


def ack_unchanged(engine: sa.Engine, prefix: str, n: int) -> tuple[float, float, list[float]]:
    """Stack claims of 100 acked by today's DELETE vs by main's (no ``unique_for_ms`` predicate)."""
    _clear(engine, prefix)
    q = DelayedQueue(engine, "bench", table_prefix=prefix)
    stack = Stack(q)
    m = q.tables.messages
    mains_ack = sa.delete(m).where(
        m.c.lock_token == sa.bindparam("token", type_=sa.String), stack.dialect.id_in(m.c.id)
    )
    expected = _fill(q, "a", n) | _fill(q, "b", n)

    def acked_by(stmt: sa.Delete) -> Callable[[], list[str]]:
        def side() -> list[str]:
            token, rows = stack.claim(BATCH)
            if rows:
                ids = [r[0] for r in rows]
                gone = stack._run("scan", lambda conn: conn.execute(stmt, {"token": token, "ids": ids}).rowcount)
                if gone != len(rows):
                    raise Lost(f"an ack deleted {gone} of {len(rows)}")
            return [r[1] for r in rows]

        return side

    seconds, seen = _alternate(n, [acked_by(stack.stmts.ack), acked_by(mains_ack)])
    _check(expected, seen[0] + seen[1], "retention 0 ack")
    return n / seconds[0], n / seconds[1], []


def keeping_drain(engine: sa.Engine, prefix: str, n: int) -> tuple[float, float, list[float]]:
    """delayq's claim + ack with retention on vs the same statements by hand."""
    _clear(engine, prefix)
    q = DelayedQueue(engine, "bench", table_prefix=prefix, retention=dt.timedelta(hours=1))
    stack = Stack(q)
    ls = lifecycle_sql(stack.stmts, stack.dialect)
    retention_ms = 3_600_000
    one_statement = stack.dialect.keeps_in_one_statement
    expected = _fill(q, "a", n) | _fill(q, "b", n)

    def ours() -> list[str]:
        got = q.try_poll_many(BATCH)
        if q.ack_many(got) != len(got):
            raise Lost("an ack lost messages")
        return [d.key for d in got]

    def by_hand() -> list[str]:
        token, rows = stack.claim(BATCH)
        if not rows:
            return []
        pairs = [(r[0], token) for r in rows]
        if one_statement:  # PostgreSQL: delayq's one statement (``Dialect.keep_held``), run by hand
            ids = [r[0] for r in rows]
            params = {
                **stack.dialect.held_params(pairs),
                "keep_ids": ids,
                "keep_durations": [None] * len(ids),
                "keep_results": [None] * len(ids),
                "keep_result_types": [None] * len(ids),
                "retention_ms": retention_ms,
                "queue_name": q.name,
                "worker": None,
            }
            one = stack.stmts.memo(_keep_held_statement, False, False, True)
            if stack._run("statement", lambda conn: conn.execute(one, params).scalar_one()) != len(rows):
                raise Lost("a hand-written keep lost messages")
            return [r[1] for r in rows]

        def keep(conn: Connection) -> int:
            held = conn.execute(ls.held, stack.dialect.held_params(pairs)).all()
            conn.execute(ls.insert_finished, [_finished(r, retention_ms) for r in held])
            gone = int(conn.execute(ls.delete_ids, {"ids": [r.id for r in held]}).rowcount)
            if ls.notify is not None:
                conn.execute(ls.notify, {"queue_name": q.name})
            return gone

        if stack._run("transaction", keep) != len(rows):
            raise Lost("a hand-written keep lost messages")
        return [r[1] for r in rows]

    seconds, seen = _alternate(n, [ours, by_hand])
    _check(expected, seen[0] + seen[1], "retention on drain")
    with engine.connect() as conn:
        kept = conn.execute(sa.select(sa.func.count()).select_from(q.tables.finished)).scalar_one()
    if kept != 2 * n:
        raise Lost(f"{kept} finished rows kept, not {2 * n}")
    _clear(engine, prefix)
    return n / seconds[0], n / seconds[1], []


def _finished(r: Any, retention_ms: int) -> dict[str, Any]:
    now = int(r.now)
    return {
        "queue": r.queue,
        "key": r.key,
        "payload": r.payload,
        "payload_type": r.payload_type,
        "state": COMPLETED,
        "scheduled_at_initially": r.scheduled_at_initially,
        "created_at": r.created_at,
        "attempts": r.attempts,
        "last_error": r.last_error,
        "attempt_history": r.attempt_history,
        "headers": r.headers,
        "tags": r.tags,
        "finished_at": now,
        "duration_ms": None,
        "result": None,
        "result_type": None,
        "expires_at": now + max(retention_ms, r.unique_for_ms or 0),
        "priority": r.priority,
        "group_key": r.group_key,
        "worker": None,
    }


def measure_all(engine: sa.Engine, prefix: str, n: int, measure: Measure) -> None:
    measure(
        "lifecycle: retention 0, stack claim 100 + ack (ceiling: main's ack DELETE)",
        lambda: ack_unchanged(engine, prefix, n),
    )
    measure(
        "lifecycle: retention on, try_poll_many(100) + ack_many (ceiling: same statements by hand)",
        lambda: keeping_drain(engine, prefix, n),
    )
