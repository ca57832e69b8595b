"""One chaos run: a throwaway server, a fault proxy, real ``delayq worker`` processes, a producer, faults on
a seeded schedule, a drain, the final state, and the checker's report.

Everything is bounded: the schedule ends with the production window, the drain has a deadline, every
process and server is stopped (SIGTERM, then SIGKILL) and every temp dir removed, also on failure (the
history dir is kept when the run fails or ``keep`` is set).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from delayq import DelayedQueue, migrations
from delayq.schema import metadata

from ..faults import FaultProxy, Frozen, sigkill
from .app import effects, effects_metadata
from .history import Recorder, Report, check, load
from .servers import MariadbServer, PostgresServer, SqliteFile, start_server

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVER_FAULTS = ("restart", "cut_all", "cut_after", "black_hole")
CUT_PATTERNS = {"commit": b"COMMIT", "claim": b"SKIP LOCKED", "ack": b"DELETE FROM"}


@dataclass(frozen=True)
class Profile:
    """How big a run is and how many faults of each kind it gets (server faults only where a server runs)."""

    name: str
    messages: dict[str, int]
    workers: int
    concurrency: int
    produce_seconds: dict[str, float]
    drain_seconds: float
    vt: float
    faults: dict[str, int]
    freeze_seconds: tuple[float, float]
    hole_seconds: tuple[float, float]
    down_seconds: tuple[float, float]
    tx_fraction: float = 0.4
    delayed_fraction: float = 0.2
    max_delay: float = 8.0
    many_fraction: float = 0.4
    long_fraction: float = 0.02


PROFILES = {
    "ci": Profile(
        name="ci",
        messages={"sqlite": 600, "postgresql": 1500, "mysql": 1500},
        workers=3,
        concurrency=4,
        produce_seconds={"sqlite": 25.0, "postgresql": 45.0, "mysql": 45.0},
        drain_seconds=45.0,
        vt=3.0,
        faults={"kill": 3, "freeze": 2, "restart": 2, "cut_all": 2, "cut_after": 3, "black_hole": 2},
        freeze_seconds=(1.0, 6.0),
        hole_seconds=(1.5, 4.0),
        down_seconds=(0.5, 2.0),
    ),
    "soak": Profile(
        name="soak",
        messages={"sqlite": 100_000, "postgresql": 100_000, "mysql": 100_000},
        workers=8,
        concurrency=8,
        produce_seconds={"sqlite": 1800.0, "postgresql": 1800.0, "mysql": 1800.0},
        drain_seconds=300.0,
        vt=5.0,
        faults={"kill": 360, "freeze": 60, "restart": 2, "cut_all": 30, "cut_after": 60, "black_hole": 20},
        freeze_seconds=(1.0, 12.0),
        hole_seconds=(2.0, 8.0),
        down_seconds=(1.0, 5.0),
    ),
}


@dataclass(frozen=True)
class Fault:
    at: float
    """Seconds after the start of production."""
    kind: str
    slot: int = 0
    seconds: float = 0.0
    detail: str = ""


@dataclass(frozen=True)
class Item:
    key: str
    kind: str
    delay: float
    sleep: float
    via: str


def schedule(profile: Profile, backend: str, seed: int) -> list[Fault]:
    """The faults of a run, reproducible from the seed."""
    rng = random.Random(f"faults:{seed}")
    window = profile.produce_seconds[backend]
    out: list[Fault] = []
    for kind, count in profile.faults.items():
        for i in range(count):
            at = rng.uniform(2.0, window - 2.0)
            slot = rng.randrange(profile.workers)
            if kind == "freeze":
                out.append(Fault(at, kind, slot, rng.uniform(*profile.freeze_seconds)))
            elif kind == "black_hole":
                out.append(Fault(at, kind, seconds=rng.uniform(*profile.hole_seconds)))
            elif kind == "restart":
                out.append(
                    Fault(at, kind, seconds=rng.uniform(*profile.down_seconds), detail=("fast", "immediate")[i % 2])
                )
            elif kind == "cut_after":
                out.append(Fault(at, kind, detail=rng.choice(sorted(CUT_PATTERNS))))
            else:
                out.append(Fault(at, kind, slot))
    if backend == "sqlite":
        out = [f for f in out if f.kind not in SERVER_FAULTS]
    return sorted(out, key=lambda f: f.at)


def plan(profile: Profile, backend: str, seed: int) -> list[list[Item]]:
    """The messages, in the batches the producer offers them (a batch of one is a plain ``offer``)."""
    rng = random.Random(f"messages:{seed}")
    items: list[Item] = []
    for i in range(profile.messages[backend]):
        kind = "tx" if rng.random() < profile.tx_fraction else "plain"
        delay = rng.uniform(0.5, profile.max_delay) if rng.random() < profile.delayed_fraction else 0.0
        sleep = rng.uniform(0.0, 0.02)
        if kind == "plain" and rng.random() < profile.long_fraction:
            sleep = rng.uniform(0.6 * profile.vt, 2.0 * profile.vt)  # outlives its lock: heartbeats must extend it
        items.append(Item(f"{kind[0]}-{i:06d}", kind, delay, sleep, "one"))
    batches: list[list[Item]] = []
    i = 0
    while i < len(items):
        if rng.random() < profile.many_fraction:
            n = rng.randint(5, 40)
            batches.append([dataclasses.replace(x, via="many") for x in items[i : i + n]])
            i += n
        else:
            batches.append([items[i]])
            i += 1
    return batches


def make_engine(url: str) -> sa.Engine:
    if url.startswith("sqlite"):
        return sa.create_engine(url, connect_args={"timeout": 30.0})
    return sa.create_engine(url, pool_size=4, max_overflow=4, pool_pre_ping=True)


class Workers:
    """The worker processes, one per slot; a killed one is replaced."""

    def __init__(self, url: str, base: str, vt: float, concurrency: int, work: Path, rec: Recorder) -> None:
        self.url, self.base, self.vt, self.concurrency = url, base, vt, concurrency
        self.work, self.rec = work, rec
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.expected: set[int] = set()
        """Pids we killed or stopped on purpose."""
        self.crashed: list[str] = []
        self.refused: list[str] = []
        """Replacements that exited 2 at start because the database could not be reached (a restart was
        under way): ``delayq worker`` checks the database first, by design; the harness starts another,
        as a supervisor would."""
        self.logs: dict[int, Path] = {}
        self.lock = threading.Lock()

    def start(self, slot: int) -> subprocess.Popen[bytes]:
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO_ROOT / "tests"),
            "CHAOS_QUEUE": self.base,
            "CHAOS_VT": str(self.vt),
            "CHAOS_HISTORY": str(self.work / "history"),
        }
        path = self.work / "logs" / f"worker-{slot}-{time.monotonic():.3f}.log"
        log = path.open("wb")
        cmd = [sys.executable, "-m", "delayq.cli", "--url", self.url, "worker", "chaos.app:handlers"]
        cmd += ["--concurrency", str(self.concurrency), "--shutdown-timeout", "10"]
        proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        with self.lock:
            self.procs[slot] = proc
            self.logs[proc.pid] = path
        self.rec.write({"ev": "worker_start", "slot": slot, "pid": proc.pid})
        return proc

    def kill(self, slot: int) -> None:
        with self.lock:
            proc = self.procs[slot]
            self.expected.add(proc.pid)
        t0 = time.monotonic()
        sigkill(proc)  # (the process may still run for a moment after t0: it is gone by t1)
        t1 = time.monotonic()
        self.rec.write({"ev": "fault", "fault": "kill", "slot": slot, "pid": proc.pid, "t0": t0, "t1": t1})
        self.start(slot)

    def freeze(self, slot: int, seconds: float) -> None:
        with self.lock:
            proc = self.procs[slot]
        if proc.poll() is not None:
            return
        t0 = time.monotonic()
        frozen = Frozen(proc.pid)
        time.sleep(seconds)
        if proc.poll() is None:
            frozen.thaw()  # (a worker killed meanwhile was reaped: its pid is not ours to signal)
        else:
            frozen.frozen = False
        self.rec.write(
            {"ev": "fault", "fault": "freeze", "slot": slot, "pid": proc.pid, "t0": t0, "t1": time.monotonic()}
        )

    def watch(self) -> None:
        """Restart a worker that exited by itself (and note it: a crash is a finding)."""
        with self.lock:
            gone = [(s, p) for s, p in self.procs.items() if p.poll() is not None and p.pid not in self.expected]
        for slot, proc in gone:
            what = f"worker pid {proc.pid} (slot {slot}) exited {proc.returncode}"
            output = self.logs[proc.pid].read_text(errors="replace")
            if proc.returncode == 2 and "Error: cannot use the database" in output and "worker started" not in output:
                self.refused.append(f"{what}: {output.strip()[:200]}")
            else:
                self.crashed.append(what)
            self.rec.write({"ev": "worker_exit", "slot": slot, "pid": proc.pid, "rc": proc.returncode})
            with self.lock:
                self.expected.add(proc.pid)
            self.start(slot)

    def stop_all(self, timeout: float = 30.0) -> None:
        """SIGTERM every worker (SIGCONT first, in case), then SIGKILL what is left after ``timeout``."""
        with self.lock:
            procs = [(s, p) for s, p in self.procs.items() if p.poll() is None]  # (never signal a reaped pid)
            self.expected.update(p.pid for _, p in procs)
        for _, p in procs:
            p.send_signal(signal.SIGCONT)
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for slot, p in procs:
            try:
                rc = p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.crashed.append(f"worker pid {p.pid} (slot {slot}) ignored SIGTERM for {timeout:.0f}s")
                p.kill()
                rc = p.wait(10)
            self.rec.write({"ev": "worker_exit", "slot": slot, "pid": p.pid, "rc": rc})


@dataclass
class Result:
    backend: str
    profile: str
    seed: int
    messages: int
    workers: int
    seconds: float
    report: Report
    proxy_cuts: int
    crashed: list[str]
    refused: list[str]
    work: Path | None

    @property
    def ok(self) -> bool:
        return self.report.ok and not self.crashed and not self.report.problems


def run(
    backend: str, profile_name: str, seed: int, *, keep: bool = False, say: Callable[[str], None] = print
) -> Result:
    """One run; the report says what the checker found. Servers, proxy and workers are always cleaned up."""
    profile = PROFILES[profile_name]
    backend = "mysql" if backend == "mariadb" else backend
    began = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=f"delayq-chaos-{backend}-{seed}-"))
    (work / "logs").mkdir()
    rec = Recorder(work / "history", "harness")
    server: PostgresServer | MariadbServer | SqliteFile | None = None
    proxy: FaultProxy | None = None
    workers: Workers | None = None
    threads: list[threading.Thread] = []
    ok = False
    try:
        server = start_server(backend)
        say(f"[chaos] {backend}: server at {server.url} (work dir {work})")
        migrations.upgrade(server.url)
        engine = make_engine(server.url)
        effects_metadata.create_all(engine)
        worker_url = server.url
        if not isinstance(server, SqliteFile):
            proxy = FaultProxy(server.host, server.port)
            worker_url = proxy.url_for(server.url)
        base = f"chaos-{seed}"
        workers = Workers(worker_url, base, profile.vt, profile.concurrency, work, rec)
        for slot in range(profile.workers):
            workers.start(slot)
        faults = schedule(profile, backend, seed)
        batches = plan(profile, backend, seed)
        window = profile.produce_seconds[backend]
        produced = threading.Event()
        start = time.monotonic()
        producer = threading.Thread(target=_produce, args=(engine, base, batches, window, start, rec, produced))
        producer.start()
        threads.append(producer)
        for fault in faults:
            _sleep_until(start + fault.at, workers)
            t = threading.Thread(target=_inject, args=(fault, server, proxy, workers, rec), daemon=True)
            t.start()
            threads.append(t)
        _sleep_until(start + window, workers)
        for t in threads:
            while t.is_alive():
                t.join(0.2)
                workers.watch()
        if proxy is not None:
            proxy.heal()
        say(f"[chaos] {backend}: produced and injected in {time.monotonic() - start:.0f}s; draining")
        drained = _drain(engine, base, profile.drain_seconds, workers)
        say(f"[chaos] {backend}: {'drained' if drained else 'NOT drained'} at {time.monotonic() - start:.0f}s")
        workers.stop_all()
        rec.write(_final(engine, base))
        engine.dispose()
        report = check(
            load(work / "history"),
            vt=profile.vt,
            stuck_after=2 * profile.vt + 5.0,
            freeze_is_outage=backend == "sqlite",
        )
        result = Result(
            backend,
            profile.name,
            seed,
            sum(len(b) for b in batches),
            profile.workers,
            time.monotonic() - began,
            report,
            proxy.stats.cuts if proxy is not None else 0,
            workers.crashed,
            workers.refused,
            None,
        )
        ok = result.ok
        if not ok or keep:
            result.work = work
        return result
    finally:
        if workers is not None:
            with contextlib.suppress(Exception):
                workers.stop_all(timeout=5.0)
        if proxy is not None:
            with contextlib.suppress(Exception):
                proxy.close()
        if server is not None:
            with contextlib.suppress(OSError):  # the server's log goes with the history
                shutil.copy(server.dir / "server.log", work / "logs" / "server.log")
            server.close()
        rec.close()
        if ok and not keep:
            shutil.rmtree(work, ignore_errors=True)


def _sleep_until(t: float, workers: Workers) -> None:
    while (left := t - time.monotonic()) > 0:
        time.sleep(min(left, 0.2))
        workers.watch()


def _produce(
    engine: sa.Engine,
    base: str,
    batches: list[list[Item]],
    window: float,
    start: float,
    rec: Recorder,
    done: threading.Event,
) -> None:
    """Offer every batch, paced over ``window``; a batch whose offer raised is offered again (keys dedup)."""
    queues = {k: DelayedQueue(engine, f"{base}-{k}") for k in ("plain", "tx")}
    total, sent = sum(len(b) for b in batches), 0
    pending = list(batches)
    while pending:
        batch = pending.pop(0)
        _sleep_until_plain(start + window * 0.9 * sent / total)
        by_kind: dict[str, list[Item]] = {}
        for item in batch:
            by_kind.setdefault(item.kind, []).append(item)
        for kind, items in by_kind.items():
            q = queues[kind]
            try:
                if items[0].via == "one":
                    x = items[0]
                    q.offer(x.key, {"sleep": x.sleep}, dt.timedelta(seconds=x.delay))
                else:
                    q.offer_many([(x.key, {"sleep": x.sleep}, dt.timedelta(seconds=x.delay)) for x in items])
            except Exception as exc:
                rec.write({"ev": "offer_error", "keys": [x.key for x in items], "error": repr(exc)[:300]})
                pending.append(items)
                time.sleep(0.5)
                continue
            for x in items:
                rec.write({"ev": "offer", "key": x.key, "kind": x.kind, "delay": x.delay, "via": x.via})
        sent += len(batch)
    done.set()


def _sleep_until_plain(t: float) -> None:
    left = t - time.monotonic()
    if left > 0:
        time.sleep(left)


def _inject(
    fault: Fault,
    server: PostgresServer | MariadbServer | SqliteFile,
    proxy: FaultProxy | None,
    workers: Workers,
    rec: Recorder,
) -> None:
    t0 = time.monotonic()
    event: dict[str, Any] = {"ev": "fault", "fault": fault.kind, "t0": t0, "t1": t0, "detail": fault.detail}
    if fault.kind == "kill":
        workers.kill(fault.slot)
        return
    if fault.kind == "freeze":
        workers.freeze(fault.slot, fault.seconds)
        return
    assert proxy is not None
    if fault.kind == "restart":
        event["t0"], event["t1"] = server.restart(fault.detail, fault.seconds)  # type: ignore[arg-type]
    elif fault.kind == "cut_all":
        proxy.cut_all()
    elif fault.kind == "cut_after":
        proxy.cut_after(CUT_PATTERNS[fault.detail])
    elif fault.kind == "black_hole":
        proxy.black_hole(fault.seconds)
        event["t1"] = t0 + fault.seconds
    rec.write(event)


def _left(engine: sa.Engine, base: str) -> int:
    m = metadata.tables["delayq_messages"]
    with engine.connect() as conn:
        q = sa.select(sa.func.count()).where(m.c.queue.in_([f"{base}-plain", f"{base}-tx"]))
        return int(conn.execute(q).scalar_one())


def _drain(engine: sa.Engine, base: str, seconds: float, workers: Workers) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        workers.watch()
        with contextlib.suppress(sa.exc.OperationalError):
            if _left(engine, base) == 0:
                return True
        time.sleep(0.25)
    return False


def _final(engine: sa.Engine, base: str) -> dict[str, Any]:
    m, d = metadata.tables["delayq_messages"], metadata.tables["delayq_dead_letters"]
    names = [f"{base}-plain", f"{base}-tx"]
    now_ms = time.time() * 1000
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(m.c.key, m.c.queue, m.c.scheduled_at, m.c.lock_token, m.c.attempts).where(m.c.queue.in_(names))
        ).all()
        dead = conn.execute(sa.select(d.c.key).where(d.c.queue.in_(names))).scalars().all()
        fx = conn.execute(sa.select(effects.c.key, effects.c.pid, effects.c.attempt, effects.c.token)).all()
    return {
        "ev": "final",
        "queued": [
            {
                "key": r.key,
                "queue": r.queue,
                "due_age_s": (now_ms - r.scheduled_at) / 1000,
                "locked": r.lock_token is not None,
                "attempts": r.attempts,
            }
            for r in rows
        ],
        "dead": list(dead),
        "effects": [{"key": r.key, "pid": r.pid, "attempt": r.attempt, "token": r.token} for r in fx],
    }


COLUMNS = [
    "backend",
    "profile",
    "seed",
    "msgs",
    "workers",
    "faults (kill/freeze/restart/cut_all/cut_after fired/hole)",
    "runs",
    "completed",
    "dup explained",
    "dup unexplained",
    "dup effects",
    "overlaps (explained)",
    "lost",
    "stuck",
    "dead",
    "crashes (refused starts)",
    "seconds",
    "verdict",
]


def row(r: Result) -> list[str]:
    rep, f = r.report, r.report.faults
    faults = "/".join(str(f.get(k, 0)) for k in ("kill", "freeze", "restart", "cut_all"))
    faults += f"/{f.get('cut_after', 0)} ({r.proxy_cuts})/{f.get('black_hole', 0)}"
    explained = ", ".join(f"{k} {v}" for k, v in sorted(rep.dup_explained.items())) or "0"
    return [
        r.backend,
        r.profile,
        str(r.seed),
        str(r.messages),
        str(r.workers),
        faults,
        str(rep.runs),
        str(rep.completed),
        explained,
        str(len(rep.dup_unexplained)),
        str(len(rep.dup_effects)),
        f"{len(rep.overlaps)} ({rep.overlaps_explained})",
        str(len(rep.lost)),
        str(len(rep.stuck)),
        str(len(rep.dead)),
        f"{len(r.crashed)} ({len(r.refused)})",
        f"{r.seconds:.0f}",
        "PASS" if r.ok else "FAIL",
    ]


def table(results: list[Result]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row(r)) + " |" for r in results]
    for r in results:
        for p in [*r.crashed, *r.report.problems][:20]:
            lines.append(f"  {r.backend} seed {r.seed}: {p}")
        if r.work is not None:
            lines.append(f"  {r.backend} seed {r.seed}: history and worker logs kept in {r.work}")
    return "\n".join(lines)
