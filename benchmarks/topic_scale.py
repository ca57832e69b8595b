"""Topics at scale: hundreds of idle subscribers over thousands of partitions (``python -m benchmarks --topic-scale``).

Subscribers are real ``Worker``s, one ``TopicHandler`` each (one consumer group), run as threads of a few
processes: every process has one engine (a small pool shared by its workers) and counts the statements its
workers send (a ``before_cursor_execute`` listener; an ``executemany`` counts once). The workers run as
``delayq worker`` would, but with ``listen=False`` (a LISTEN connection per worker would take 200
connections; the idle loop polls at ``poll_interval`` either way) and without the watchdog thread.

Figures, on a topic of ``--partitions`` (2,000):

- for 10, 50 and the full count of subscribers (200): once the group has settled (every partition
  leased to a live subscriber, none holding more than ``ceil(partitions / live)``), the statements per
  second each idle subscriber sends, over ``--window`` seconds;
- from the full count (4 processes of 45 and one of 20): the time for the group to settle again when
  those 20 leave (a graceful stop: they give their partitions up at once; the 180 others take them),
  then when 20 join again (a new process: the others give up what is above their new share), with the
  rounds of rebalancing that took (the time over the rebalance period, a third of ``--lease``).
  (A join of 20 to 200 would change no share over 2,000 partitions: ``ceil(2000 / 220)`` is 10 too.)

Bounded: every wait has a limit (it fails rather than hangs), and every process it started is stopped
(terminated, then killed, if it does not stop by itself).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import sqlalchemy as sa

PREFIX = "bench_"
"""The tables' prefix by default (``--prefix``): ``reset`` deletes the topic's rows and creates it anew."""
TOPIC = "scale"
GROUP = "scale"


# -- a child process: N workers, a statement counter, commands on stdin -----------------------------------
def child(url: str, n: int, lease: float, pool: int, prefix: str = PREFIX) -> None:
    """Start ``n`` workers; answer ``count`` with the statements sent so far, ``stop`` by stopping them."""
    from delayq import TopicDelivery, TopicHandler, Worker

    engine = sa.create_engine(url, pool_size=pool, max_overflow=2, pool_timeout=120)
    sent = [0]
    kinds: Counter[str] = Counter()
    lock = threading.Lock()

    @sa.event.listens_for(engine, "before_cursor_execute")
    def count(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        with lock:
            sent[0] += 1
            kinds[" ".join(statement.split())[:60]] += 1

    class Idle(TopicHandler):
        topic, group, start = TOPIC, GROUP, "latest"
        lease_duration = dt.timedelta(seconds=lease)

        def handle(self, delivery: TopicDelivery, conn: sa.Connection | None = None) -> None:
            pass

    workers = [
        Worker(engine, [Idle()], concurrency=1, table_prefix=prefix, listen=False, stall_timeout=None) for _ in range(n)
    ]
    for w in workers:
        w.start()
    print(json.dumps({"names": [w.name for w in workers]}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "count":
            with lock:
                print(json.dumps({"count": sent[0], "at": time.monotonic(), "kinds": dict(kinds)}), flush=True)
        elif command == "stop":
            break
    stoppers = [threading.Thread(target=w.stop, args=(30,)) for w in workers]
    for t in stoppers:
        t.start()
    for t in stoppers:
        t.join(60)
    engine.dispose()
    print(json.dumps({"stopped": True}), flush=True)


# -- the parent ------------------------------------------------------------------------------------------
class Child:
    """One child process of ``n`` workers."""

    def __init__(self, url: str, n: int, lease: float, pool: int, prefix: str) -> None:
        args = [sys.executable, "-m", "benchmarks.topic_scale", "--child", str(n), "--url", url]
        args += ["--lease", str(lease), "--pool", str(pool), "--prefix", prefix]
        self.p = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        self.names: list[str] = self._read()["names"]

    def _read(self, limit: float = 180.0) -> dict[str, Any]:
        assert self.p.stdout is not None
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self.p.stdout.readline() if self.p.stdout else ""))
        reader.start()
        reader.join(limit)
        if not box or not box[0]:
            raise RuntimeError(f"a scale child (pid {self.p.pid}) did not answer within {limit:.0f} s")
        found: dict[str, Any] = json.loads(box[0])
        return found

    def send(self, command: str) -> dict[str, Any]:
        assert self.p.stdin is not None
        self.p.stdin.write(command + "\n")
        self.p.stdin.flush()
        return self._read()

    def stop(self) -> None:
        try:
            if self.p.poll() is None:
                self.send("stop")
        except (OSError, RuntimeError, ValueError):
            pass
        finally:
            if self.p.poll() is None:
                self.p.terminate()
                try:
                    self.p.wait(20)
                except subprocess.TimeoutExpired:
                    self.p.kill()
                    self.p.wait(10)


@dataclass
class Figures:
    backend: str
    partitions: int
    lease_s: float
    idle: dict[int, float] = field(default_factory=dict)
    """Subscribers -> statements per second per idle subscriber."""
    initial_settle_s: float | None = None
    leave_settle_s: float | None = None
    leave_stopped_s: float | None = None
    """Of ``leave_settle_s``, the time until the leaving process had stopped its workers and exited."""
    leave_rounds: int | None = None
    join_settle_s: float | None = None
    join_rounds: int | None = None
    load: str = ""


def reset(engine: sa.Engine, partitions: int, prefix: str) -> None:
    """Delete the scale topic's rows from every topic table, then create it with ``partitions``."""
    from delayq import Topic
    from delayq.schema import make_tables

    t = make_tables(prefix).topics
    with engine.begin() as conn:
        for table in (t.subscribers, t.offsets, t.leases, t.deliveries, t.log, t.heads, t.topics):
            conn.execute(sa.delete(table).where(table.c.topic.in_([TOPIC, f"{TOPIC}_dlq"])))
    Topic(engine, TOPIC, table_prefix=prefix).create(partitions)


def holdings(engine: sa.Engine, prefix: str) -> tuple[Counter[str], int]:
    """Per holder of an unexpired lease, the partitions it holds; and the partition count. One grouped read
    of the leases (``group_lag`` reads far more per partition: over 2,000 of them, a check every few seconds
    under this load, which would blur the settle times)."""
    from delayq.schema import make_tables

    t = make_tables(prefix).topics
    le = t.leases
    now = int(time.time() * 1000)  # the database runs on this host: one clock
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(le.c.holder, sa.func.count())
            .where(le.c.topic == TOPIC, le.c.consumer_group == GROUP, le.c.holder.is_not(None), le.c.expires_at > now)
            .group_by(le.c.holder)
        ).all()
        partitions = conn.execute(sa.select(t.topics.c.partitions).where(t.topics.c.topic == TOPIC)).scalar() or 0
    return Counter({str(h): int(n) for h, n in rows}), int(partitions)


def is_settled(engine: sa.Engine, live: set[str], prefix: str) -> bool:
    """Every partition leased to a live subscriber, none holding more than ``ceil(partitions / live)``."""
    held, partitions = holdings(engine, prefix)
    if not partitions or set(held) - live or sum(held.values()) != partitions:
        return False
    return max(held.values()) <= math.ceil(partitions / len(live))


def wait_settled(engine: sa.Engine, live: set[str], limit: float, prefix: str) -> float:
    """Seconds until ``is_settled`` (checked every 0.2 s); raises past ``limit``."""
    start = time.monotonic()
    while not is_settled(engine, live, prefix):
        if time.monotonic() - start > limit:
            held, partitions = holdings(engine, prefix)
            raise RuntimeError(
                f"{len(live)} subscribers did not settle over {partitions} partitions within {limit:.0f} s "
                f"(held {sum(held.values())}, most {max(held.values(), default=0)}, holders {len(held)})"
            )
        time.sleep(0.2)
    return time.monotonic() - start


KINDS: dict[int, dict[str, float]] = {}
"""Per subscriber count, the statements per second per subscriber by the start of their text (the last run)."""


def idle_rate(children: list[Child], window: float) -> float:
    """Statements per second per subscriber of ``children`` over ``window`` seconds."""
    first = [c.send("count") for c in children]
    time.sleep(window)
    last = [c.send("count") for c in children]
    subs = max(sum(len(c.names) for c in children), 1)
    kinds: Counter[str] = Counter()
    for a, b in zip(first, last, strict=True):
        for kind, n in b["kinds"].items():
            kinds[kind] += (n - a["kinds"].get(kind, 0)) / (b["at"] - a["at"]) / subs
    KINDS[subs] = {k: round(v, 3) for k, v in kinds.most_common(8)}
    return sum((b["count"] - a["count"]) / (b["at"] - a["at"]) for a, b in zip(first, last, strict=True)) / subs


def run(
    url: str,
    *,
    partitions: int = 2000,
    processes: int = 4,
    per_process: int = 50,
    churn: int = 20,
    lease: float = 15.0,
    window: float = 10.0,
    sizes: tuple[int, ...] = (10, 50),
    pool: int = 5,
    limit: float = 300.0,
    prefix: str = PREFIX,
    say: Any = print,
) -> Figures:
    """The whole scale run (see the module's docstring); the figures, or an error when something did not settle."""
    from delayq import migrations

    engine = sa.create_engine(url, pool_size=2)
    migrations.upgrade(url, prefix=prefix)
    figures = Figures(engine.dialect.name, partitions, lease)
    children: list[Child] = []
    try:
        for n in sizes:
            reset(engine, partitions, prefix)
            k = min(processes, n)
            base, extra = divmod(n, k)
            per = [base + 1] * extra + [base] * (k - extra)
            children = [Child(url, k, lease, pool, prefix) for k in per]
            live = {name for c in children for name in c.names}
            wait_settled(engine, live, limit, prefix)
            figures.idle[n] = idle_rate(children, window)
            say(f"{figures.backend}: {n} idle subscribers: {figures.idle[n]:.2f} statements/s each")
            for c in children:
                c.stop()
            children = []
        reset(engine, partitions, prefix)
        total = processes * per_process
        started = time.monotonic()  # from the processes' start (their imports included)
        base, extra = divmod(total - churn, processes)
        children = [Child(url, base + (i < extra), lease, pool, prefix) for i in range(processes)]
        churning = Child(url, churn, lease, pool, prefix)
        stay = {name for c in children for name in c.names}
        wait_settled(engine, stay | set(churning.names), limit, prefix)
        figures.initial_settle_s = time.monotonic() - started
        figures.idle[total] = idle_rate([*children, churning], window)
        say(f"{figures.backend}: {total} idle subscribers: {figures.idle[total]:.2f} statements/s each")
        period = lease / 3
        left = time.monotonic()  # from the stop asked (they leave the group as they stop)
        churning.stop()
        figures.leave_stopped_s = time.monotonic() - left
        wait_settled(engine, stay, limit, prefix)
        figures.leave_settle_s = time.monotonic() - left
        figures.leave_rounds = max(1, math.ceil((figures.leave_settle_s - figures.leave_stopped_s) / period))
        say(f"{figures.backend}: {churn} of {total} leave: settled in {figures.leave_settle_s:.1f} s")
        joining = time.monotonic()  # from the process's start (its imports included)
        churning = Child(url, churn, lease, pool, prefix)
        children.append(churning)
        wait_settled(engine, stay | set(churning.names), limit, prefix)
        figures.join_settle_s = time.monotonic() - joining
        figures.join_rounds = max(1, math.ceil(figures.join_settle_s / period))
        say(f"{figures.backend}: {churn} join {total - churn}: settled in {figures.join_settle_s:.1f} s")
    finally:
        for c in children:
            c.stop()
        engine.dispose()
    figures.load = "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.topic_scale", description=__doc__.splitlines()[0])
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--url", required=True)
    parser.add_argument("--partitions", type=int, default=2000)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--per-process", type=int, default=50)
    parser.add_argument("--churn", type=int, default=20)
    parser.add_argument("--lease", type=float, default=15.0, help="lease_duration in seconds (15)")
    parser.add_argument("--window", type=float, default=10.0, help="seconds each idle rate is measured over")
    parser.add_argument("--pool", type=int, default=5, help="connections per process (5, plus 2 overflow)")
    parser.add_argument("--prefix", default=PREFIX, help=f"the tables' prefix ({PREFIX})")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if args.child is not None:
        child(args.url, args.child, args.lease, args.pool, args.prefix)
        return 0
    figures = run(
        args.url,
        partitions=args.partitions,
        processes=args.processes,
        per_process=args.per_process,
        churn=args.churn,
        lease=args.lease,
        window=args.window,
        pool=args.pool,
        prefix=args.prefix,
    )
    print(json.dumps({**asdict(figures), "statements": KINDS}, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(figures), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
