"""The fault-injection layer (tests/faults.py) against the real PostgreSQL and MariaDB servers."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from faults import FaultProxy, exhausted_pool, freeze, hold_row_lock, sigkill
from sqlalchemy.pool import NullPool

SERVERS = ["postgresql", "mysql"]


@pytest.fixture(params=SERVERS)
def server_url(request: pytest.FixtureRequest, backend_urls: dict[str, str]) -> str:
    """Each database server in turn."""
    return backend_urls[request.param]


@pytest.fixture
def probe(server_url: str) -> Iterator[sa.Table]:
    """A table of this test's own (``faults_probe_<random>``) holding rows 1 and 2, dropped afterwards."""
    table = sa.Table(
        f"faults_probe_{uuid.uuid4().hex[:10]}",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("v", sa.Integer, nullable=False),
    )
    engine = sa.create_engine(server_url, poolclass=NullPool)
    table.create(engine)
    with engine.begin() as conn:
        conn.execute(table.insert(), [{"id": 1, "v": 0}, {"id": 2, "v": 0}])
    try:
        yield table
    finally:
        table.drop(engine)
        engine.dispose()


@pytest.fixture
def proxy(server_url: str) -> Iterator[FaultProxy]:
    with FaultProxy.for_url(server_url) as p:
        yield p
    assert not [t for t in threading.enumerate() if t.name.startswith(f"faultproxy-{p.port}")]


def ids(url: str, table: sa.Table) -> list[int]:
    """The table's ids, read directly (not through any proxy)."""
    engine = sa.create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return list(conn.execute(sa.select(table.c.id).order_by(table.c.id)).scalars())
    finally:
        engine.dispose()


def test_cut_after_autocommit_statement_commits_but_the_client_errors(
    server_url: str, probe: sa.Table, proxy: FaultProxy
) -> None:
    engine = sa.create_engine(proxy.url_for(server_url), poolclass=NullPool)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(probe.insert(), {"id": 3, "v": 0})  # untouched: not armed yet
        proxy.cut_after(f"INSERT INTO {probe.name}".encode())
        with pytest.raises(sa.exc.OperationalError):
            conn.execute(probe.insert(), {"id": 4, "v": 0})
    assert proxy.stats.cuts == 1
    assert ids(server_url, probe) == [1, 2, 3, 4]  # the server committed what the client never heard of
    with engine.connect() as conn:  # disarmed after one cut
        conn.execute(probe.insert(), {"id": 5, "v": 0})
        conn.commit()
    assert ids(server_url, probe) == [1, 2, 3, 4, 5]
    engine.dispose()


def test_cut_after_pipelined_executemany(server_url: str, probe: sa.Table, proxy: FaultProxy) -> None:
    """psycopg pipelines an executemany and sends Sync last: the server commits the lot (autocommit) before it
    replies. mysqlclient runs the statements one by one: only the first reaches the server."""
    engine = sa.create_engine(proxy.url_for(server_url), poolclass=NullPool)
    update = probe.update().where(probe.c.id == sa.bindparam("k")).values(v=sa.bindparam("nv"))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        proxy.cut_after(f"UPDATE {probe.name}".encode())
        with pytest.raises(sa.exc.OperationalError):
            conn.execute(update, [{"k": 1, "nv": 7}, {"k": 2, "nv": 7}])
    with sa.create_engine(server_url, poolclass=NullPool).connect() as conn:
        updated = list(conn.execute(sa.select(probe.c.id).where(probe.c.v == 7).order_by(probe.c.id)).scalars())
    assert updated == ([1, 2] if engine.dialect.name == "postgresql" else [1])
    engine.dispose()


def test_cut_after_commit_and_skip(server_url: str, probe: sa.Table, proxy: FaultProxy) -> None:
    engine = sa.create_engine(proxy.url_for(server_url), poolclass=NullPool)
    proxy.cut_after(b"COMMIT", skip=1)
    for key in (3, 4):
        with engine.connect() as conn:
            conn.execute(probe.insert(), {"id": key, "v": 0})
            if key == 3:
                conn.commit()  # skipped
            else:
                with pytest.raises(sa.exc.OperationalError):
                    conn.commit()
    assert proxy.stats.cuts == 1
    assert ids(server_url, probe) == [1, 2, 3, 4]
    engine.dispose()


def test_cut_after_finds_a_pattern_split_across_reads() -> None:
    """Against a local echo server: the bytes completing the pattern go through, their echo does not."""
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def echo() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(5)
                while data := conn.recv(1024):
                    conn.sendall(data)

        server = threading.Thread(target=echo, daemon=True)
        server.start()
        with FaultProxy("127.0.0.1", listener.getsockname()[1]) as proxy:
            proxy.cut_after(b"WORLD")
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as client:
                client.sendall(b"HELLO WO")
                assert client.recv(1024) == b"HELLO WO"
                client.sendall(b"RLD!")
                assert client.recv(1024) == b""  # closed, echo dropped
            assert proxy.stats.cuts == 1
        server.join(5)
        assert not server.is_alive()


def test_cut_all_fails_pooled_connections_and_new_ones_work(server_url: str, proxy: FaultProxy) -> None:
    engine = sa.create_engine(proxy.url_for(server_url), pool_size=1, max_overflow=0)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1
    proxy.cut_all()
    with pytest.raises(sa.exc.OperationalError), engine.connect() as conn:
        conn.execute(sa.text("SELECT 1"))
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1
    stats = proxy.stats
    assert (stats.accepted, stats.dropped) == (2, 1)
    engine.dispose()


def test_black_hole_delays_statements_and_new_connections(server_url: str, proxy: FaultProxy) -> None:
    engine = sa.create_engine(proxy.url_for(server_url), poolclass=NullPool)
    with engine.connect() as conn:
        proxy.black_hole(1.0)
        started = time.monotonic()
        assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1
        assert time.monotonic() - started > 0.5
        proxy.black_hole(1.0)
        started = time.monotonic()
        with engine.connect() as other:
            assert other.execute(sa.text("SELECT 2")).scalar_one() == 2
        assert time.monotonic() - started > 0.5
        proxy.black_hole(60)
        threading.Timer(0.3, proxy.heal).start()
        started = time.monotonic()
        assert conn.execute(sa.text("SELECT 3")).scalar_one() == 3
        assert time.monotonic() - started < 10
    assert proxy.stats.cuts == proxy.stats.dropped == 0
    engine.dispose()


def test_hold_row_lock(server_url: str, probe: sa.Table) -> None:
    engine = sa.create_engine(server_url, poolclass=NullPool)
    locked = sa.select(probe.c.id).where(probe.c.id == 1).with_for_update(nowait=True)
    free = sa.select(probe.c.id).order_by(probe.c.id).with_for_update(skip_locked=True)
    with hold_row_lock(server_url, probe.name, "id = :id", {"id": 1}) as rows:
        assert [r.id for r in rows] == [1]
        with engine.connect() as conn:
            with pytest.raises(sa.exc.OperationalError):
                conn.execute(locked)
            conn.rollback()
            assert list(conn.execute(free).scalars()) == [2]
    with engine.connect() as conn:
        assert list(conn.execute(locked).scalars()) == [1]
    engine.dispose()


def test_hold_row_lock_on_sqlite_holds_the_write_lock(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'faults.db'}"
    engine = sa.create_engine(url, poolclass=NullPool, connect_args={"timeout": 0.1})
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE probe (id INTEGER PRIMARY KEY)")
        conn.exec_driver_sql("INSERT INTO probe VALUES (1)")
    with hold_row_lock(url, "probe", "id = :id", {"id": 1}) as rows:
        assert [r.id for r in rows] == [1]
        with pytest.raises(sa.exc.OperationalError, match="locked"), engine.begin() as conn:
            conn.exec_driver_sql("INSERT INTO probe VALUES (2)")
    with engine.begin() as conn:
        conn.exec_driver_sql("INSERT INTO probe VALUES (2)")
    engine.dispose()


def test_exhausted_pool(server_url: str) -> None:
    engine = sa.create_engine(server_url, pool_size=2, max_overflow=1, pool_timeout=0.2)
    with engine.connect(), exhausted_pool(engine) as held:
        assert len(held) == 2
        with pytest.raises(sa.exc.TimeoutError):
            engine.connect()
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1
    engine.dispose()


def test_freeze_and_sigkill(tmp_path: Path) -> None:
    ticks = tmp_path / "ticks"
    child = subprocess.Popen(
        [sys.executable, "-c", f"import time\nwhile True:\n open({str(ticks)!r}, 'a').write('.'); time.sleep(0.01)"]
    )
    try:
        deadline = time.monotonic() + 10
        while not ticks.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        with freeze(child.pid):
            before = ticks.read_text()
            time.sleep(0.2)
            assert ticks.read_text() == before
        time.sleep(0.2)
        assert len(ticks.read_text()) > len(before)
        with freeze(child.pid):
            assert sigkill(child.pid) == -9  # a frozen process dies too; reaped here
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(5)
