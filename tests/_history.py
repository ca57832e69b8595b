"""Histories of handler runs, for the worker and flow tests: record, then check (nothing lost, nothing run twice at
once, never more running than a limit), rather than count what was done. Also how those tests start
``delayq worker`` processes.
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from conftest import REPO_ROOT, Backend

from delayq import DelayedQueue

Record = tuple[int, str, str]
"""(``time.monotonic_ns()``, "start" or "end", message key)."""


def overlap(history: Sequence[Record]) -> int:
    """The most handlers between their start and their end at once, from (ns, event, key) records."""
    running = most = 0
    for _, event, _ in sorted(history, key=lambda h: (h[0], h[1] == "start")):  # an end before a start at a tie
        running += 1 if event == "start" else -1
        most = max(most, running)
    return most


def started(history: Sequence[Record]) -> list[str]:
    """The keys of every start, sorted (a key started twice shows twice)."""
    return sorted(k for _, e, k in history if e == "start")


class History:
    """(ns, event, key) records appended from many threads, and what those threads raised."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()

    def record(self, event: str, key: str) -> None:
        with self._lock:
            self.records.append((time.monotonic_ns(), event, key))

    def in_threads(self, count: int, target: Callable[[int], None], limit: float = 180) -> None:
        """Run ``target(i)`` on ``count`` threads (i: 0 to count - 1) and join them; fail with what any raised."""

        def run(i: int) -> None:
            try:
                target(i)
            except BaseException as exc:
                self.errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(limit)
        assert not self.errors, self.errors

    def claim_and_hold(self, engine: sa.Engine, queue: str, batch: int, hold: float) -> None:
        """One claimer: claim up to ``batch``, record their starts, hold them ``hold`` s, record their ends, ack;
        until the queue has stayed empty (nothing ready or in flight) for 50 claims."""
        q = DelayedQueue(engine, queue, flow_refresh=dt.timedelta(0))
        idle = 0
        while idle < 50:
            claimed = q.try_poll_many(batch)
            if not claimed:
                idle += 1 if q.stats().ready == 0 and q.stats().in_flight == 0 else 0
                time.sleep(0.005)
                continue
            for d in claimed:
                self.record("start", d.key)
            time.sleep(hold)
            for d in claimed:
                self.record("end", d.key)
            q.ack_many(claimed)


class Runs:
    """Every handler run, as (holder, message, start, end): a history to find overlaps and losses."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.runs: list[list[Any]] = []

    def begin(self, holder: str, message: str) -> list[Any]:
        run = [holder, message, time.monotonic(), None]
        with self.lock:
            self.runs.append(run)
        return run

    def of(self, message: str) -> list[list[Any]]:
        with self.lock:
            return [list(r) for r in self.runs if r[1] == message]

    def check_no_overlap(self) -> None:
        with self.lock:
            runs = [list(r) for r in self.runs]
        for i, (h1, m1, s1, e1) in enumerate(runs):
            for h2, m2, s2, e2 in runs[i + 1 :]:
                if m1 == m2:
                    overlap = (e1 is None or s2 < e1) and (e2 is None or s1 < e2)
                    assert not overlap, f"{m1} run by {h1} and {h2} at once"


def spawn_worker(
    backend: Backend, app: str, env: Mapping[str, str], args: Sequence[str] = (), *, repo_on_path: bool = False
) -> subprocess.Popen[bytes]:
    """``delayq worker APP ARGS`` on ``backend``, its handlers imported from tests/ and configured by ``env``
    (DELAYQ_TEST_* variables); stdout and stderr together in its ``stdout`` pipe."""
    path = [str(REPO_ROOT), str(REPO_ROOT / "tests")] if repo_on_path else [str(REPO_ROOT / "tests")]
    full_env = {**os.environ, "DELAYQ_URL": backend.url, **env, "PYTHONPATH": os.pathsep.join(path)}
    command = [sys.executable, "-m", "delayq.cli", "worker", app, *args]
    return subprocess.Popen(command, env=full_env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
