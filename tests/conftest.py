"""One behavioural suite for every backend: the ``backend`` fixture runs each test on SQLite,
PostgreSQL and MariaDB/MySQL.

URLs come from ``DELAYQ_TEST_POSTGRES_URL`` and ``DELAYQ_TEST_MYSQL_URL`` (the local services by
default). A server that cannot be reached fails the run: green means the suite ran. Only where
a Docker engine answers and testcontainers is installed does an unreachable default start a
container instead.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from delayq import DelayedQueue, ManualClock, migrations
from delayq.schema import metadata

BACKENDS = ["sqlite", "postgresql", "mysql"]
DEFAULT_URLS = {
    "postgresql": "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    "mysql": "mysql+mysqldb://root@127.0.0.1:3306/test",
}
ENV_VARS = {"postgresql": "DELAYQ_TEST_POSTGRES_URL", "mysql": "DELAYQ_TEST_MYSQL_URL"}
START = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


@dataclass
class Backend:
    """A reachable database with delayq's tables, and a way to make engines on it."""

    name: str
    url: str
    engine: sa.Engine

    def make_engine(self, **kwargs: Any) -> sa.Engine:
        return make_engine(self.url, **kwargs)


def make_engine(url: str, **kwargs: Any) -> sa.Engine:
    """An engine as the tests use it; SQLite files run in WAL mode with a generous busy timeout."""
    if url.startswith("sqlite"):
        connect_args = {"timeout": 30.0, **kwargs.pop("connect_args", {})}
        engine = sa.create_engine(url, connect_args=connect_args, **kwargs)

        @sa.event.listens_for(engine, "connect")
        def _wal(dbapi_conn: Any, _: Any) -> None:
            dbapi_conn.execute("PRAGMA journal_mode=WAL")

        return engine
    if "poolclass" not in kwargs:
        kwargs = {"pool_size": 20, "max_overflow": 20, **kwargs}
    return sa.create_engine(url, **kwargs)


def _docker_answers() -> bool:
    docker = shutil.which("docker")
    if docker is None:
        return False
    return subprocess.run([docker, "info"], capture_output=True, timeout=20).returncode == 0


def _container_url(name: str) -> tuple[str, Any]:
    """Start a throwaway server in Docker (only where an engine answers)."""
    if name == "postgresql":
        from testcontainers.postgres import PostgresContainer

        pg = PostgresContainer("postgres:15", driver="psycopg").start()
        return pg.get_connection_url(), pg
    from testcontainers.mysql import MySqlContainer

    my = MySqlContainer("mariadb:10.11", dialect="mysqldb").start()
    return my.get_connection_url(), my


def _reachable(url: str) -> Exception | None:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect():
            return None
    except sa.exc.OperationalError as exc:
        return exc
    finally:
        engine.dispose()


def _migrated(url: str) -> None:
    """delayq's tables at head. Not dropped first: test sessions sharing a server must not clobber each
    other, and every test works in a queue of its own."""
    migrations.upgrade(url)


@pytest.fixture(scope="session")
def backend_urls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    urls = {"sqlite": f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'delayq.db'}"}
    containers: list[Any] = []
    for name, var in ENV_VARS.items():
        url = os.environ.get(var, DEFAULT_URLS[name])
        error = _reachable(url)
        if error is not None and var not in os.environ and _docker_answers():
            url, container = _container_url(name)
            containers.append(container)
            error = _reachable(url)
        if error is not None:
            pytest.fail(
                f"{name} at {url} cannot be reached ({error.orig}); set {var} or start the server", pytrace=False
            )
        urls[name] = url
    yield urls
    for container in containers:
        container.stop()


_backends: dict[str, Backend] = {}


def _backend(name: str, urls: dict[str, str]) -> Backend:
    """The named backend, migrated with delayq's own migrations at first use."""
    if name not in _backends:
        _migrated(urls[name])
        _backends[name] = Backend(name, urls[name], make_engine(urls[name]))
    return _backends[name]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, backend_urls: dict[str, str]) -> Backend:
    """Each backend in turn."""
    return _backend(request.param, backend_urls)


@pytest.fixture
def postgres(backend_urls: dict[str, str]) -> Backend:
    """PostgreSQL alone, for what only it has (planner settings, EXPLAIN)."""
    return _backend("postgresql", backend_urls)


@pytest.fixture
def engine(backend: Backend) -> sa.Engine:
    return backend.engine


@pytest.fixture
def queue_name() -> str:
    """A queue of its own for every test, so tests share tables but not messages."""
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(START)


@pytest.fixture
def make_queue(engine: sa.Engine, queue_name: str, clock: ManualClock) -> Callable[..., DelayedQueue]:
    """Queues on the test's engine and queue name, on the manual clock unless told otherwise."""

    def make(**kwargs: Any) -> DelayedQueue:
        kwargs.setdefault("clock", clock)
        return DelayedQueue(kwargs.pop("engine", engine), kwargs.pop("name", queue_name), **kwargs)

    return make


@pytest.fixture
def queue(make_queue: Callable[..., DelayedQueue]) -> DelayedQueue:
    """A queue on the manual clock with a one-minute visibility timeout."""
    return make_queue(visibility_timeout=dt.timedelta(minutes=1))


def count_rows(engine: sa.Engine, queue_name: str) -> int:
    """Live messages in a queue, read directly."""
    m = metadata.tables["delayq_messages"]
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).where(m.c.queue == queue_name)).scalar_one())


REPO_ROOT = Path(__file__).resolve().parent.parent
