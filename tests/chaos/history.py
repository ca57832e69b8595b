"""The history of a chaos run, and the checker: a pure function from events to a report.

Events are dicts, one JSON line each, in one file per process (``O_APPEND`` writes of whole lines, so a
process killed with SIGKILL loses at most the line it was writing). Every event has ``t`` (``time.monotonic()``,
one clock for every process of the machine) and ``w`` (wall time). Kinds (``ev``):

- ``offer``: key, kind (``plain``/``tx``), delay (s), via (``one``/``many``): an offer that returned.
- ``offer_error``: keys, error: an offer that raised (the producer offers them again).
- ``start`` / ``end`` / ``fail``: key, kind, pid, attempt, token: a handler run began / returned / raised.
- ``log``: pid, msg, keys: a warning a worker logged (``lock lost`` ones explain redeliveries).
- ``worker_start`` / ``worker_exit``: slot, pid (, rc).
- ``fault``: fault (``kill``, ``freeze``, ``restart``, ``cut_all``, ``cut_after``, ``black_hole``), t0, t1, pid
  (kill, freeze), detail.
- ``final``: the end state: queued (key, kind, due_age_s, locked, attempts), dead (keys), effects (key, pid,
  attempt, token).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import threading
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Event = dict[str, Any]
OUTAGES = ("black_hole", "restart")
"""Faults that cut every worker off from the database for a while (its locks may run out meanwhile)."""


class Recorder:
    """Appends events to ``{directory}/{name}.jsonl``; thread-safe, one ``write`` per line."""

    def __init__(self, directory: Path, name: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.pid = os.getpid()
        self._fd = os.open(directory / f"{name}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def write(self, event: Event) -> None:
        event.setdefault("t", time.monotonic())
        event.setdefault("w", time.time())
        line = (json.dumps(event, separators=(",", ":")) + "\n").encode()
        with self._lock:
            os.write(self._fd, line)

    def close(self) -> None:
        os.close(self._fd)


def load(directory: Path) -> list[Event]:
    """Every event of every file, in monotonic order (a torn last line of a killed process is skipped)."""
    events: list[Event] = []
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    events.sort(key=lambda e: e.get("t", 0.0))
    return events


@dataclass
class Report:
    """What the checker found. ``problems`` has one line per failure, with the history it rests on."""

    offered: int = 0
    completed: int = 0
    runs: int = 0
    lost: list[str] = field(default_factory=list)
    dup_explained: dict[str, int] = field(default_factory=dict)
    """Duplicate completions by explanation (killed, frozen, lock_lost, cut_off, reoffered)."""
    dup_unexplained: list[str] = field(default_factory=list)
    dup_effects: list[str] = field(default_factory=list)
    overlaps_explained: int = 0
    overlaps: list[str] = field(default_factory=list)
    stuck: list[str] = field(default_factory=list)
    unfinished: list[str] = field(default_factory=list)
    dead: list[str] = field(default_factory=list)
    faults: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.lost or self.dup_unexplained or self.dup_effects or self.overlaps or self.stuck or self.dead)


@dataclass
class _Run:
    key: str
    kind: str
    pid: int
    attempt: int
    token: str
    start: float
    end: float | None = None
    stop: float = math.inf
    """When it stopped running: its end, its failure, or its process's death."""


def _overlaps(t0: float, t1: float, a: float, b: float) -> bool:
    return t0 <= b and t1 >= a


def check(events: Iterable[Event], vt: float, stuck_after: float, *, freeze_is_outage: bool = False) -> Report:
    """Check a history. ``vt``: the handlers' visibility timeout (s); ``stuck_after``: how long a message may
    sit due and unlocked at the end before it counts as stuck (s). ``freeze_is_outage`` (SQLite): a frozen
    worker may hold the database's single write lock, which stops every other worker's heartbeats and acks
    too, so a freeze cuts everyone off."""
    events = sorted(events, key=lambda e: e.get("t", 0.0))
    r = Report()
    kinds: dict[str, str] = {}
    offers: dict[str, list[float]] = defaultdict(list)
    runs: dict[tuple[int, str, str], _Run] = {}
    """By (pid, token, key): one claim of many messages gives them one token."""
    by_key: dict[str, list[_Run]] = defaultdict(list)
    deaths: dict[int, float] = {}
    gone_by: dict[int, float] = {}  # when each process that died was surely gone (a kill takes effect in [t0, t1])
    frozen: dict[int, list[tuple[float, float]]] = defaultdict(list)
    outages: list[tuple[float, float]] = []
    lock_lost: dict[tuple[int, str], list[float]] = defaultdict(list)
    final: Event | None = None
    for e in events:
        ev = e["ev"]
        if ev == "offer":
            kinds[e["key"]] = e["kind"]
            offers[e["key"]].append(e["t"])
        elif ev == "start":
            run = _Run(e["key"], e["kind"], e["pid"], e["attempt"], e["token"], e["t"])
            runs[(run.pid, run.token, run.key)] = run
            by_key[run.key].append(run)
        elif ev in ("end", "fail"):
            found = runs.get((e["pid"], e["token"], e["key"]))
            if found is not None:
                found.stop = min(found.stop, e["t"])
                if ev == "end":
                    found.end = e["t"]
        elif ev == "log":
            if "lock" in e["msg"] and ("lost" in e["msg"] or "expired" in e["msg"]):
                for key in e.get("keys", []):
                    lock_lost[(e["pid"], key)].append(e["t"])
        elif ev == "worker_exit":
            deaths.setdefault(e["pid"], e["t"])
            gone_by.setdefault(e["pid"], e["t"])
        elif ev == "fault":
            r.faults[e["fault"]] = r.faults.get(e["fault"], 0) + 1
            if e["fault"] == "kill":
                deaths[e["pid"]] = min(deaths.get(e["pid"], math.inf), e["t0"])
                gone_by[e["pid"]] = min(gone_by.get(e["pid"], math.inf), e["t1"])
            elif e["fault"] == "freeze":
                frozen[e["pid"]].append((e["t0"], e["t1"]))
                if freeze_is_outage:
                    outages.append((e["t0"], e["t1"]))
            elif e["fault"] in OUTAGES:
                outages.append((e["t0"], e["t1"]))
        elif ev == "final":
            final = e
    for run in runs.values():
        run.stop = min(run.stop, deaths.get(run.pid, math.inf))
    r.offered = len(kinds)
    r.runs = len(runs)

    def impaired(a: _Run, until: float) -> str | None:
        """Why ``a``'s lock may have run out before ``until``, or None."""
        if any(_overlaps(f0, f1, a.start, until) for f0, f1 in frozen.get(a.pid, [])):
            return "frozen"
        if any(t >= a.start for t in lock_lost.get((a.pid, a.key), [])):
            return "lock_lost"
        if any(_overlaps(f0, f1, a.start - vt, until) for f0, f1 in outages):
            return "cut_off"
        return None

    # Overlapping holders: b started while a (an earlier run of the key) still ran.
    why: str | None
    for key, rs in by_key.items():
        rs.sort(key=lambda x: x.start)
        for i, a in enumerate(rs):
            for b in rs[i + 1 :]:
                if b.start < a.stop:
                    why = impaired(a, b.start)
                    if why is None:
                        r.overlaps.append(
                            f"{key}: attempt {b.attempt} (pid {b.pid}, token {b.token}) started at {b.start:.3f} "
                            f"while attempt {a.attempt} (pid {a.pid}, token {a.token}, started {a.start:.3f}) ran "
                            f"until {a.stop:.3f}, neither frozen nor cut off"
                        )
                    else:
                        r.overlaps_explained += 1

    # Final state.
    queued: dict[str, Event] = {}
    dead: set[str] = set()
    effects: dict[str, list[Event]] = defaultdict(list)
    if final is not None:
        queued = {q["key"]: q for q in final.get("queued", [])}
        dead = set(final.get("dead", []))
        for fx in final.get("effects", []):
            effects[fx["key"]].append(fx)

    # Completions: plain ones are runs that returned, transactional ones are committed effects.
    for key, kind in sorted(kinds.items()):
        if kind == "tx":
            done = [(fx["pid"], fx["token"], key) for fx in effects.get(key, [])]
            completions = sorted(
                (runs[d] for d in done if d in runs), key=lambda x: x.end if x.end is not None else x.start
            )
            if len(done) > 1:
                r.dup_effects.append(f"{key}: {len(done)} effects: {effects[key]}")
        else:
            completions = sorted((x for x in by_key.get(key, []) if x.end is not None), key=lambda x: x.start)
        if completions:
            r.completed += 1
        elif key in dead:
            r.dead.append(key)
        elif key in queued:
            q = queued[key]
            r.unfinished.append(key)
            if q["due_age_s"] > stuck_after:
                r.stuck.append(f"{key}: queued, due for {q['due_age_s']:.1f}s, attempts {q['attempts']}")
        else:
            runs_of = [(x.pid, x.attempt, x.token, x.start, x.end) for x in by_key.get(key, [])]
            r.lost.append(f"{key} ({kind}): offered at {offers[key]}, runs {runs_of}, not queued, not dead")
        if kind == "tx":
            continue  # a transactional message's duplicate is an effect: counted above
        for first, later in itertools.pairwise(completions):
            assert first.end is not None
            if first.end <= gone_by.get(first.pid, math.inf) and deaths.get(first.pid, math.inf) <= later.start:
                why = "killed"  # it completed and died before its ack: a SIGKILL lands a moment after it is sent
            elif any(t > first.end for t in offers[key]):
                why = "reoffered"
            else:
                why = impaired(first, later.start)
            if why is None:
                r.dup_unexplained.append(
                    f"{key}: completed by attempt {first.attempt} (pid {first.pid}, token {first.token}, "
                    f"{first.start:.3f}-{first.end:.3f}) and again by attempt {later.attempt} (pid {later.pid}, "
                    f"token {later.token}, started {later.start:.3f}); no kill, freeze, lost lock or outage"
                )
            else:
                r.dup_explained[why] = r.dup_explained.get(why, 0) + 1
    for key in sorted(set(queued) - set(kinds)):
        r.problems.append(f"{key}: queued at the end but never offered")
    r.problems += [f"lost: {x}" for x in r.lost]
    r.problems += [f"unexplained duplicate: {x}" for x in r.dup_unexplained]
    r.problems += [f"duplicate effect: {x}" for x in r.dup_effects]
    r.problems += [f"overlap: {x}" for x in r.overlaps]
    r.problems += [f"stuck: {x}" for x in r.stuck]
    r.problems += [f"dead-lettered: {x}" for x in r.dead]
    return r
