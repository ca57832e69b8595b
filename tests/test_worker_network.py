"""A worker behind a network that stops answering: it stops on SIGTERM in bounded time, and (where the
driver has a read timeout, as ``delayq worker`` sets on MariaDB) it resumes by itself after the heal."""

from __future__ import annotations

import datetime as dt
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import Backend, _backend, make_engine
from faults import FaultProxy
from test_worker import wait_until
from test_worker_contract import Driver
from test_worker_processes import start_worker

from delayq import DelayedQueue, Delivery
from delayq.worker import SIGNAL_GRACE

SERVERS = ["postgresql", "mysql"]


@pytest.mark.parametrize("driver", ["threads", "asyncio"])
@pytest.mark.parametrize("server", SERVERS)
def test_sigterm_stops_a_worker_whose_database_went_silent_in_bounded_time(
    server: str, backend_urls: dict[str, str], queue_name: str, tmp_path: Path, driver: str
) -> None:
    b = _backend(server, backend_urls)
    with FaultProxy.for_url(b.url) as proxy:
        through = Backend(server, proxy.url_for(b.url), b.engine)
        worker = start_worker(through, queue_name, tmp_path, seconds=0, shutdown_timeout=1, driver=driver)
        try:
            DelayedQueue(b.engine, queue_name).offer("before", 1)
            wait_until(lambda: any(tmp_path.glob("before.*.done")), "the worker handles a message")
            proxy.black_hole(120)  # every connection, old and new, stops answering
            time.sleep(1.5)  # the worker is now blocked inside the driver
            worker.send_signal(signal.SIGTERM)
            worker.wait(timeout=1 + SIGNAL_GRACE + 10)
        finally:
            proxy.heal()
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    assert worker.returncode is not None


def test_a_mariadb_worker_gets_past_connections_that_went_silent_for_good(
    backend_urls: dict[str, str], queue_name: str, tmp_path: Path
) -> None:
    """Its open connections stop answering and never will: the driver's read timeout (which ``delayq
    worker`` sets on MariaDB) fails the stuck statement, the pool drops the dead connections, and work
    goes on over new ones."""
    b = _backend("mysql", backend_urls)
    with FaultProxy.for_url(b.url) as proxy:
        url = proxy.url_for(b.url) + "?read_timeout=2&write_timeout=2"
        worker = start_worker(Backend("mysql", url, b.engine), queue_name, tmp_path, seconds=0)
        try:
            queue = DelayedQueue(b.engine, queue_name)
            queue.offer("before", 1)
            wait_until(lambda: any(tmp_path.glob("before.*.done")), "the worker handles a message")
            proxy.stall_existing()
            queue.offer("after", 2)
            wait_until(lambda: any(tmp_path.glob("after.*.done")), "the worker resumes after the heal", limit=30)
        finally:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()


@pytest.mark.parametrize("kind", ["threads", "asyncio"])
@pytest.mark.parametrize("server", SERVERS)
def test_a_worker_whose_connections_went_silent_for_good_resumes_on_new_ones(
    server: str, backend_urls: dict[str, str], queue_name: str, kind: str
) -> None:
    """In process, so the watchdog's deadline can be short: PostgreSQL by the watchdog dropping the stuck
    socket, MariaDB by the read timeout (both set here as ``delayq worker`` sets them, only shorter; asyncmy
    has no read timeout: the watchdog's deadline alone)."""
    b = _backend(server, backend_urls)
    handled: list[str] = []

    def record(d: Delivery, _: object) -> None:
        handled.append(d.key)

    with FaultProxy.for_url(b.url) as proxy:
        timeouts = "?read_timeout=2&write_timeout=2" if server == "mysql" and kind == "threads" else ""
        url = proxy.url_for(b.url) + timeouts
        engine = make_engine(url, pool_size=6, max_overflow=2)
        driver = Driver(kind, Backend(server, url, engine))
        worker = driver.worker(
            [driver.queue_handler(queue_name, record)],
            listen=False,
            poll_interval=dt.timedelta(seconds=0.2),
            stall_timeout=dt.timedelta(seconds=2),
        )
        worker.start()
        try:
            queue = DelayedQueue(b.engine, queue_name)
            queue.offer("before", 1)
            wait_until(lambda: "before" in handled, "the worker handles a message")
            proxy.stall_existing()
            queue.offer("after", 2)
            wait_until(lambda: "after" in handled, "the worker resumes on new connections", limit=30)
        finally:
            worker.stop()
            driver.close()
            engine.dispose()


def test_listen_gives_up_on_a_connection_that_went_silent(
    backend_urls: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A half-open LISTEN connection delivers nothing and raises nothing: the listener notifies itself
    through another connection after a quiet spell, and gives up on its own when that does not arrive
    (the worker then reconnects and logs it; polling goes on meanwhile)."""
    import delayq.dialects.postgresql as pg
    from delayq.dialects import dialect_for

    monkeypatch.setattr(pg, "LISTEN_PING_AFTER", 0.5)
    monkeypatch.setattr(pg, "LISTEN_PING_TIMEOUT", 1.0)
    b = _backend("postgresql", backend_urls)
    failures: list[BaseException] = []
    heard: list[str] = []
    with FaultProxy.for_url(b.url) as proxy:
        engine = make_engine(proxy.url_for(b.url))
        stop = threading.Event()

        def listen() -> None:
            try:
                heard.extend(dialect_for(engine).listen(engine, "delayq-listen-probe", stop))
            except Exception as exc:
                failures.append(exc)

        listener = threading.Thread(target=listen, daemon=True)
        listener.start()
        time.sleep(2)  # listening, and its self-checks answered
        assert listener.is_alive() and not failures
        proxy.stall_existing()
        listener.join(15)
        stop.set()
        engine.dispose()
    assert failures and isinstance(failures[0], pg.ListenStalledError), failures
    assert heard == []  # the self-notifications are not reported as queue names
