"""The dashboard's page loads over a big queue: ``python -m benchmarks --web`` (1,000,000 live and 1,000,000
kept messages on PostgreSQL; ``--web 20000`` for a smoke run, ``--backends sqlite`` or ``mysql`` for another
backend).

One queue (``web-bench``) holds the live messages: most scheduled over the next days, a fifth due (ready),
some held by a claim, and dead letters with a real traceback; another (``web-bench-kept``) as many kept
ones, a tenth cancelled and the rest completed with a result, each tagged; ten small queues beside them. The dashboard
(``delayq.web.app``) is served by uvicorn on 127.0.0.1 and loaded over HTTP by one client, one request at
a time: each page ``WARMUP`` times, then ``LOADS`` times, reporting p50, p95 and the slowest. The queue
is filled once (a rerun on the same database finds it full and only measures). Tables use ``bench_``.
"""

from __future__ import annotations

import datetime as dt
import re
import socket
import statistics
import threading
import time
from dataclasses import dataclass

import sqlalchemy as sa

from delayq import DelayedQueue, migrations

QUEUE = "web-bench"
KEPT = "web-bench-kept"
RETENTION = dt.timedelta(days=30)
CHUNK = 5_000
WARMUP = 3
LOADS = 40
TARGET_MS = 200.0


@dataclass
class Load:
    page: str
    p50_ms: float
    p95_ms: float
    max_ms: float

    def line(self) -> str:
        flag = "" if self.p95_ms < TARGET_MS else f"  (over {TARGET_MS:.0f} ms)"
        return f"{self.page:<44} p50 {self.p50_ms:7.1f} ms  p95 {self.p95_ms:7.1f} ms  max {self.max_ms:7.1f} ms{flag}"


def fill(engine: sa.Engine, prefix: str, total: int) -> None:
    """``total`` messages in ``QUEUE`` (unless it holds them already), and the small queues beside it."""
    q = DelayedQueue(engine, QUEUE, table_prefix=prefix)
    s = q.stats()
    have = s.ready + s.scheduled + s.in_flight + s.expired_locks + s.dead
    if have >= total:
        print(f"{QUEUE}: {have:,} messages already", flush=True)
        return
    started = time.monotonic()
    due = total // 5
    for start in range(have, total, CHUNK):
        items = [
            (f"order/{i:08d}", {"order": i, "sku": f"sku-{i % 997}", "note": "x" * 60}, _due(i, due))
            for i in range(start, min(start + CHUNK, total))
        ]
        q.offer_many(items)
        if (start // CHUNK) % 40 == 0:
            print(f"  offered {start + len(items):>9,} of {total:,}", flush=True)
    held = q.try_poll_many(500)
    for d in held[:200]:  # dead letters with a traceback
        try:
            raise ValueError(f"card declined for {d.key}")
        except ValueError as exc:
            d.dead_letter(str(exc))
    for n in range(10):
        small = DelayedQueue(engine, f"web-small-{n}", table_prefix=prefix)
        small.offer_many([(f"job-{i}", {"i": i}, None) for i in range(100)])
    print(f"filled {total:,} messages in {time.monotonic() - started:.0f}s", flush=True)


def fill_kept(engine: sa.Engine, prefix: str, total: int) -> None:
    """``total`` kept messages in ``KEPT`` (unless it holds them): offered due, a tenth cancelled while queued,
    the rest claimed and acked by the batch API with a result (the way a worker keeps them)."""
    q = DelayedQueue(engine, KEPT, table_prefix=prefix, retention=RETENTION)
    s = q.stats()
    if (s.completed or 0) + (s.cancelled or 0) >= total:
        print(f"{KEPT}: {(s.completed or 0) + (s.cancelled or 0):,} kept messages already", flush=True)
        return
    started = time.monotonic()
    for start in range(0, total, CHUNK):
        items = [(f"job/{i:08d}", {"job": i, "note": "y" * 40}, None) for i in range(start, min(start + CHUNK, total))]
        q.offer_many(items, tags=["nightly" if start % (2 * CHUNK) else "hourly"])
        q.cancel_matching(key_prefix=f"job/{start:08d}"[:-3] + "9")  # (a tenth of the chunk: keys ...9xxx)
        while held := q.try_poll_many(1000):
            for d in held:
                d._finished_with({"job": d.key, "ok": True}, dt.timedelta(milliseconds=d.attempts * 7))
            q.ack_many(held)
        if (start // CHUNK) % 40 == 0:
            print(f"  kept {start + len(items):>9,} of {total:,}", flush=True)
    print(f"kept {total:,} messages in {time.monotonic() - started:.0f}s", flush=True)


def _due(i: int, due: int) -> dt.timedelta:
    if i < due:
        return dt.timedelta(seconds=-60 + i % 60)
    return dt.timedelta(minutes=1 + i % (60 * 24 * 3))


def _pages(base: str, client: object, total: int) -> list[tuple[str, str]]:
    import httpx

    assert isinstance(client, httpx.Client)
    deep = f"/queue?queue={QUEUE}&state=scheduled"
    for _ in range(20):  # the 21st page of scheduled messages, by following the "next" links
        found = re.search(r'<a rel="next" href="([^"]+)"', client.get(base + deep).text)
        assert found is not None, "no next page"
        deep = found.group(1).replace("&amp;", "&")
    return [
        ("overview (HTML, 11 queues)", "/"),
        ("overview panel (JSON)", "/api/overview"),
        ("queue panel (JSON)", f"/api/queue?queue={QUEUE}"),
        ("messages, first page", f"/queue?queue={QUEUE}"),
        ("messages, ready", f"/queue?queue={QUEUE}&state=ready"),
        ("messages, scheduled, page 21 (keyset)", deep),
        ("messages, key prefix", f"/queue?queue={QUEUE}&prefix=order/0050"),
        ("message", f"/message?queue={QUEUE}&key=order/{total // 2:08d}"),
        ("dead letters", f"/dead?queue={QUEUE}"),
        ("workers (HTML)", "/workers"),
        ("kept, completed, first page", f"/queue?queue={KEPT}&state=completed"),
        ("kept, cancelled, first page", f"/queue?queue={KEPT}&state=cancelled"),
        ("kept, completed, key prefix", f"/queue?queue={KEPT}&state=completed&prefix=job/0050"),
        ("kept, completed, tag", f"/queue?queue={KEPT}&state=completed&tag=nightly"),
        ("kept message (result)", f"/message?queue={KEPT}&key=job/{total // 2 + 1:08d}"),
        ("search, key prefix, all queues", "/search?prefix=job/0050"),
        ("search, tag, completed", "/search?tag=hourly&state=completed"),
        ("audit", "/audit"),
        ("history (24 h chart)", f"/history?queue={KEPT}&hours=24"),
    ]


def run(engine: sa.Engine, prefix: str, total: int) -> list[Load]:
    import httpx
    import uvicorn

    from delayq.web import app

    migrations.upgrade(engine.url.render_as_string(hide_password=False), prefix=prefix)
    fill(engine, prefix, total)
    fill_kept(engine, prefix, total)
    if engine.dialect.name != "sqlite":
        with engine.connect() as conn:  # (what autovacuum does after a bulk load)
            conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql(
                f"ANALYZE {prefix}messages, {prefix}finished"
                if engine.dialect.name == "postgresql"
                else f"ANALYZE TABLE {prefix}messages, {prefix}finished"
            )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app(engine, table_prefix=prefix), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    loads = []
    try:
        with httpx.Client(timeout=60) as client:
            for name, path in _pages(base, client, total):
                times = []
                for i in range(WARMUP + LOADS):
                    started = time.perf_counter()
                    r = client.get(base + path)
                    elapsed = (time.perf_counter() - started) * 1000
                    assert r.status_code == 200, (path, r.status_code)
                    if i >= WARMUP:
                        times.append(elapsed)
                times.sort()
                load = Load(name, statistics.median(times), times[int(len(times) * 0.95) - 1], times[-1])
                loads.append(load)
                print(load.line(), flush=True)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
    return loads
