"""Real worker processes: killed with SIGKILL mid-handler, stopped with SIGTERM while handlers run."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
import sqlalchemy as sa
from _history import spawn_worker
from conftest import Backend
from test_worker import wait_until

from delayq import DelayedQueue


def start_worker(
    backend: Backend,
    queue: str,
    markers: Path,
    *,
    seconds: float,
    concurrency: int = 4,
    visibility: float = 2.0,
    shutdown_timeout: float = 20.0,
    driver: str = "threads",
) -> subprocess.Popen[bytes]:
    env = {
        "DELAYQ_TEST_QUEUE": queue,
        "DELAYQ_TEST_MARKERS": str(markers),
        "DELAYQ_TEST_HANDLER_SECONDS": str(seconds),
        "DELAYQ_TEST_VISIBILITY": str(visibility),
        "DELAYQ_TEST_DRIVER": driver,
    }
    args = ["--concurrency", str(concurrency), "--shutdown-timeout", str(shutdown_timeout), "--driver", driver]
    return spawn_worker(backend, "worker_app:handlers", env, args)


def markers_of(markers: Path, suffix: str) -> dict[str, str]:
    return {p.name: p.read_text() for p in markers.glob(f"*.{suffix}")}


DRIVERS = pytest.mark.parametrize("driver", ["threads", "asyncio"])


@DRIVERS
def test_a_killed_worker_loses_nothing(
    backend: Backend, queue_name: str, tmp_path: Path, processes: list[subprocess.Popen[bytes]], driver: str
) -> None:
    q = DelayedQueue(backend.engine, queue_name)
    q.offer("job", {"n": 1})
    doomed = start_worker(backend, queue_name, tmp_path, seconds=120, visibility=1.0, driver=driver)
    processes.append(doomed)
    wait_until(lambda: bool(markers_of(tmp_path, "started")), "the first worker to start the handler")
    doomed.send_signal(signal.SIGKILL)
    doomed.wait(10)
    survivor = start_worker(backend, queue_name, tmp_path, seconds=0, visibility=1.0, driver=driver)
    processes.append(survivor)
    wait_until(lambda: q.get("job") is None, "another worker to handle the message")
    done = markers_of(tmp_path, "done")
    assert list(done) == [f"job.{survivor.pid}.done"]
    assert done[f"job.{survivor.pid}.done"] == "2"  # the second delivery


@DRIVERS
def test_sigterm_lets_running_handlers_finish_and_exits_zero(
    backend: Backend, queue_name: str, tmp_path: Path, processes: list[subprocess.Popen[bytes]], driver: str
) -> None:
    q = DelayedQueue(backend.engine, queue_name)
    q.offer_many([(f"m{i}", i, None) for i in range(15)])
    worker = start_worker(backend, queue_name, tmp_path, seconds=2.0, concurrency=10, visibility=30.0, driver=driver)
    processes.append(worker)
    wait_until(lambda: len(markers_of(tmp_path, "started")) == 10, "ten handlers to start")
    worker.send_signal(signal.SIGTERM)
    output = worker.communicate(timeout=60)[0].decode()
    assert worker.returncode == 0, output
    assert len(markers_of(tmp_path, "done")) == 10
    stats = q.stats()
    assert (stats.ready, stats.in_flight, stats.expired_locks) == (5, 0, 0), output
    m = q.tables.messages
    with backend.engine.connect() as conn:
        left = conn.execute(sa.select(m.c.attempts, m.c.lock_token).where(m.c.queue == queue_name)).all()
    assert left == [(0, None)] * 5


@DRIVERS
def test_a_second_signal_exits_at_once_keeping_the_running_handlers_message(
    backend: Backend, queue_name: str, tmp_path: Path, processes: list[subprocess.Popen[bytes]], driver: str
) -> None:
    q = DelayedQueue(backend.engine, queue_name)
    q.offer("job", 1)
    worker = start_worker(backend, queue_name, tmp_path, seconds=120, visibility=30.0, driver=driver)
    processes.append(worker)
    wait_until(lambda: bool(markers_of(tmp_path, "started")), "the handler to start")
    worker.send_signal(signal.SIGTERM)  # graceful: the handler may run on for --shutdown-timeout (20 s)
    worker.send_signal(signal.SIGINT)  # a second signal: no more waiting
    output = worker.communicate(timeout=15)[0].decode()
    # Both may be pending when the process next runs; the kernel then hands over the lower number first, so the
    # second one taken (the exit status) is either signal.
    assert worker.returncode in (128 + signal.SIGINT, 128 + signal.SIGTERM), output
    assert "second signal: exiting at once" in output
    assert markers_of(tmp_path, "done") == {}
    message = q.get("job")  # not released: it returns after its visibility timeout, the attempt counted
    assert message is not None and message.locked and message.attempts == 1, output
