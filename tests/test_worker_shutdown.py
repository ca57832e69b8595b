"""A worker's stop: what never started goes back uncounted, what still runs is never handed to anyone else.

In-process tests run workers on threads with the manual clock (locks, leases and visibility
timeouts expire only when a test moves it); the process tests run ``delayq worker`` and stop it
with SIGTERM, with a second worker process waiting for the same messages. Each keeps a history of
handler runs and checks it: nothing lost, nothing run by two holders at once.
"""

from __future__ import annotations

import datetime as dt
import signal
import subprocess
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from _history import spawn_worker
from conftest import Backend
from test_topics_worker import wait_until

from delayq import (
    DelayedQueue,
    ManualClock,
    Subscription,
    Topic,
)
from delayq.topics import group_lag

SECOND = dt.timedelta(seconds=1)
QUICK_STOP = {"poll_interval": dt.timedelta(milliseconds=20), "shutdown_timeout": dt.timedelta(milliseconds=200)}


@pytest.fixture
def topic_name() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


# -- topics: never-started deliveries go back uncounted (what still runs is kept: tests/test_worker_contract.py) --


def test_a_released_topic_delivery_comes_back_with_its_attempt_not_counted(
    engine: sa.Engine, topic_name: str, clock: ManualClock
) -> None:
    topic = Topic(engine, topic_name, clock=clock)
    topic.create(1)
    topic.publish("k", "m1", 1)
    sub = Subscription(engine, topic_name, "g", "s1", max_attempts=1, clock=clock, lease_duration=30 * SECOND)
    sub.rebalance()
    for _ in range(3):  # given back three times at a stop: never dead-lettered, always the first attempt
        (d,) = sub.poll(10)
        assert (d.message_id, d.attempts) == ("m1", 1)
        assert sub.release(d)
        assert not sub.release(d)  # once: the delivery is no longer held
    (d,) = sub.poll(10)
    assert d.ack()
    assert sub.poll(10) == []
    assert topic.dead_letters() == []


# (a handler running past the shutdown timeout keeps its lock or its partition until it returns, under both
# drivers: tests/test_worker_contract.py)
def locked_beyond(q: DelayedQueue, key: str, now: dt.datetime) -> bool:
    message = q.get(key)
    return message is not None and message.locked and message.scheduled_at > now


# -- `delayq worker` processes: SIGTERM while a handler outlives --shutdown-timeout -------------------------
def start_worker(
    backend: Backend,
    kind: str,
    name: str,
    markers: Path,
    *,
    seconds: float,
    exit_delay: float = 0,
    driver: str = "threads",
) -> subprocess.Popen[bytes]:
    env = {
        "DELAYQ_TEST_KIND": kind,
        "DELAYQ_TEST_NAME": name,
        "DELAYQ_TEST_MARKERS": str(markers),
        "DELAYQ_TEST_HANDLER_SECONDS": str(seconds),
        "DELAYQ_TEST_EXIT_DELAY": str(exit_delay),
        "DELAYQ_TEST_DRIVER": driver,
    }
    return spawn_worker(backend, "shutdown_app:handlers", env, ["--shutdown-timeout", "1", "--driver", driver])


def marker_times(markers: Path, suffix: str) -> dict[tuple[str, int], float]:
    """(message, pid) → when the marker was written."""
    found = {}
    for p in markers.glob(f"*.{suffix}"):
        message, pid, _ = p.name.rsplit(".", 2)
        found[message, int(pid)] = float(p.read_text())
    return found


@pytest.mark.parametrize("driver", ["threads", "asyncio"])
@pytest.mark.parametrize("kind", ["queue", "topic"])
def test_a_stopped_worker_process_never_hands_over_a_message_its_handler_still_runs(
    backend: Backend,
    kind: str,
    tmp_path: Path,
    processes: list[subprocess.Popen[bytes]],
    driver: str,
) -> None:
    name = f"s-{uuid.uuid4().hex[:12]}"
    if kind == "queue":
        DelayedQueue(backend.engine, name).offer("job", 1)
    else:
        Topic(backend.engine, name).create(1)
        Topic(backend.engine, name).publish("k", "job", 1)
    # The first worker's handler outlives its shutdown timeout (1 s) and its process lives 2 s more.
    first = start_worker(backend, kind, name, tmp_path, seconds=30, exit_delay=2, driver=driver)
    processes.append(first)
    wait_until(lambda: bool(marker_times(tmp_path, "started")), "the first worker's handler to start")
    second = start_worker(backend, kind, name, tmp_path, seconds=0, driver=driver)
    processes.append(second)
    first.send_signal(signal.SIGTERM)
    output = first.communicate(timeout=30)[0].decode()
    assert first.returncode == 0, output
    wait_until(lambda: ("job", second.pid) in marker_times(tmp_path, "done"), "the second worker to handle it")
    started = marker_times(tmp_path, "started")
    assert sorted(pid for _, pid in started) == sorted([first.pid, second.pid])  # once each: nothing else ran
    assert ("job", first.pid) not in marker_times(tmp_path, "done")  # (the first never finished)
    if driver == "threads":
        # Not while the first process lived: its last act was after the stop, with the handler running.
        first_exit = marker_times(tmp_path, "exit")["process", first.pid]
        assert started["job", second.pid] > first_exit, output
    else:
        # The coroutine that outlived the stop is cancelled as the worker exits (asyncio.run's end), and
        # its message given back only then: not while the handler still ran.
        ended = marker_times(tmp_path, "cancelled")["job", first.pid]
        assert started["job", second.pid] > ended, output
    if kind == "queue":
        wait_until(lambda: DelayedQueue(backend.engine, name).get("job") is None, "the second worker's ack")
    else:
        wait_until(lambda: not group_lag(backend.engine, name, "g")[0].lag, "the second worker's ack")
        assert Topic(backend.engine, name).dead_letters() == []
