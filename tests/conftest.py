"""One behavioural suite for every backend: the ``backend`` fixture runs each test on SQLite,
PostgreSQL and MariaDB/MySQL.

URLs come from ``DELAYQ_TEST_POSTGRES_URL`` and ``DELAYQ_TEST_MYSQL_URL`` (the local services by
default). A server that cannot be reached fails the run: green means the suite ran.
``DELAYQ_TEST_BACKENDS=sqlite`` (a comma-separated subset) runs without servers: tests of the other
backends are skipped, and say so. ``postgresql-asyncpg`` is an async-only backend: the async API's tests
(``delayq.aio``) run on PostgreSQL through asyncpg too; it is selected by default where asyncpg is installed. Only where
a Docker engine answers and testcontainers is installed does an unreachable default start a
container instead.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
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
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from delayq import DelayedQueue, ManualClock, migrations
from delayq.schema import metadata
from delayq.tracing import disable, enable

ALL_BACKENDS = ("sqlite", "postgresql", "mysql", "postgresql-asyncpg")
ASYNC_ONLY = {"postgresql-asyncpg": "postgresql"}
"""Backends only the async API runs on, each with the backend whose server (and sync engine) it shares."""


def _selected_backends() -> list[str]:
    """The backends this run tests: ``DELAYQ_TEST_BACKENDS`` (comma-separated), or all (asyncpg's where installed)."""
    default = [n for n in ALL_BACKENDS if n not in ASYNC_ONLY or importlib.util.find_spec("asyncpg")]
    names = [n.strip() for n in os.environ.get("DELAYQ_TEST_BACKENDS", ",".join(default)).split(",") if n.strip()]
    unknown = sorted(set(names) - set(ALL_BACKENDS))
    if unknown or not names:
        raise pytest.UsageError(f"DELAYQ_TEST_BACKENDS={names}: choose among {', '.join(ALL_BACKENDS)}")
    return [n for n in ALL_BACKENDS if n in names]


SELECTED = _selected_backends()
BACKENDS = [n for n in SELECTED if n not in ASYNC_ONLY]
"""The selected backends both APIs run on (what a test parametrized by backend name runs on)."""
ASYNC_BACKENDS = [n for n in SELECTED if n in ASYNC_ONLY]
"""The selected async-only backends (``ASYNC_ONLY``)."""
DEFAULT_URLS = {
    "postgresql": "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    "mysql": "mysql+mysqldb://root@127.0.0.1:3306/test",
}
ENV_VARS = {"postgresql": "DELAYQ_TEST_POSTGRES_URL", "mysql": "DELAYQ_TEST_MYSQL_URL"}
START = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


@dataclass
class Backend:
    """A reachable database with delayq's tables, and a way to make engines on it.

    ``name`` is the database (sqlite, postgresql, mysql); ``url`` names the driver too: an async-only
    backend's URL (``postgresql+asyncpg://``) makes ``make_async_engine`` use that driver, while its
    ``engine`` and ``make_engine`` use the sync driver of the same database.
    """

    name: str
    url: str
    engine: sa.Engine

    def make_engine(self, **kwargs: Any) -> sa.Engine:
        return make_engine(self.url, **kwargs)


def make_engine(url: str, **kwargs: Any) -> sa.Engine:
    """An engine as the tests use it; SQLite files run in WAL mode with a generous busy timeout.
    An async-only backend's URL gets the sync driver of its database."""
    url = sync_url(url)
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
    migrations.upgrade(sync_url(url))


class _Urls(dict[str, str]):
    """The selected backends' URLs; asking for another one skips the test that asked."""

    def __missing__(self, name: str) -> str:
        pytest.skip(f"{name} is not in DELAYQ_TEST_BACKENDS")


@pytest.fixture(scope="session")
def backend_urls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    urls = _Urls(sqlite=f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'delayq.db'}")
    containers: list[Any] = []
    for name, var in ENV_VARS.items():
        if name not in BACKENDS:
            continue
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
    for name, server in ASYNC_ONLY.items():
        if name in ASYNC_BACKENDS:
            sync = urls[server] if server in BACKENDS else os.environ.get(ENV_VARS[server], DEFAULT_URLS[server])
            error = _reachable(sync)
            if error is not None:
                pytest.fail(f"{name} at {sync} cannot be reached ({error.orig}); set {ENV_VARS[server]}", pytrace=False)
            urls[name] = sa.make_url(sync).set(drivername="postgresql+asyncpg").render_as_string(hide_password=False)
    yield urls
    for container in containers:
        container.stop()


_backends: dict[str, Backend] = {}


def _backend(name: str, urls: dict[str, str]) -> Backend:
    """The named backend, migrated with delayq's own migrations at first use."""
    if name not in _backends:
        _migrated(urls[name])  # skips the test when the backend is not selected
        _backends[name] = Backend(ASYNC_ONLY.get(name, name), urls[name], make_engine(urls[name]))
    return _backends[name]


@pytest.fixture
def backend(request: pytest.FixtureRequest, backend_urls: dict[str, str]) -> Backend:
    """Each backend in turn (``pytest_generate_tests``: the async-only ones for tests of the async API)."""
    return _backend(request.param, backend_urls)


@pytest.fixture
def postgres(request: pytest.FixtureRequest, backend_urls: dict[str, str]) -> Backend:
    """PostgreSQL alone, for what only it has (planner settings, EXPLAIN, LISTEN); tests of the async API
    get it through each of its drivers."""
    return _backend(getattr(request, "param", "postgresql"), backend_urls)


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
def make_queue(
    engine: sa.Engine, queue_name: str, clock: ManualClock, api: str, request: pytest.FixtureRequest
) -> Callable[..., DelayedQueue]:
    """Queues on the test's engine and queue name, on the manual clock unless told otherwise.

    With ``api == "async"`` (the contract modules, see ``api``) the queue is a ``delayq.aio``
    queue behind the sync surface (``SyncFacade``).
    """

    def make(**kwargs: Any) -> DelayedQueue:
        kwargs.setdefault("clock", clock)
        if api == "async":
            return facade_queue(request.getfixturevalue("aio_runner"), engine, queue_name, **kwargs)
        return DelayedQueue(kwargs.pop("engine", engine), kwargs.pop("name", queue_name), **kwargs)

    return make


@pytest.fixture
def queue(make_queue: Callable[..., DelayedQueue]) -> DelayedQueue:
    """A queue on the manual clock with a one-minute visibility timeout."""
    return make_queue(visibility_timeout=dt.timedelta(minutes=1))


@pytest.fixture
def traced() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    """Tracing on (``delayq.tracing.enable``) with an in-memory exporter of finished spans; off after."""
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    enable(provider)
    try:
        yield provider, exporter
    finally:
        disable()
        provider.shutdown()


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts: whichever still runs at its end is killed."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def count_rows(engine: sa.Engine, queue_name: str) -> int:
    """Live messages in a queue, read directly."""
    m = metadata.tables["delayq_messages"]
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).where(m.c.queue == queue_name)).scalar_one())


REPO_ROOT = Path(__file__).resolve().parent.parent


# -- the async API (delayq.aio) ---------------------------------------------------------------
AIO_CONTRACT_MODULES = {
    "test_offer",
    "test_poll",
    "test_transactions",
    "test_held",
    "test_errors",
    "test_lifecycle",
    "test_cancel",
    "test_tags",
    "test_bulk",
}
"""Modules whose queue tests run for the sync and the async API alike (``api`` parameter)."""
AIO_SYNC_ONLY = {
    # Each builds sync engines of its own (connect_args, statement listeners) for the queue;
    # tests/test_aio_transactions.py covers retries and errors of the async API.
    "test_delayqs_own_transaction_is_retried_after_a_lock_timeout",
    "test_a_callers_transaction_gets_the_transient_error_unretried",
    "test_statement_listeners_see_every_statement_of_delayqs_own_operations",
    # A sync transaction held open while another thread cancels (the async API's is test_a_cancel_in_the_callers_...).
    "test_an_ack_that_commits_first_leaves_the_cancel_nothing_to_do",
}


FULL_PROFILE_MODULES = {
    "test_chaos",
    "test_spark",
    "test_spark_answers",
    "test_spark_cluster",
    "test_spark_source",
    "test_spark_streams",
    "test_examples",
    "test_benchmarks",
    "test_worker_network",
    "test_worker_processes",
    "test_worker_shutdown",
    "test_topics_processes",  # subscribers killed, frozen (SIGSTOP) and crashing, as processes
    # the fault-proxy and frozen-transaction suites (silent servers, lost COMMIT replies, held locks, racing
    # consumers): each case waits out a bound, so together they take minutes
    "test_idle_bounds",
    "test_seams_review",
    "test_aio_seams",
    "test_concurrency",
    "test_worker_faults",
    "test_topics_faults",
    "test_watchdog",
}
"""Modules that run in the full profile only (``scripts/test --full``): JVMs, the chaos soak, every example
as a subprocess, the benchmarks' smoke run, and the worker fault tests that signal or kill ``delayq worker``
processes or silence their network for seconds (on both drivers), and the fault-proxy and frozen-transaction
suites. Single tests elsewhere carry
``@pytest.mark.slow`` themselves."""


SPARK_MODULES = sorted(m for m in FULL_PROFILE_MODULES if m.startswith("test_spark"))
collect_ignore = [] if importlib.util.find_spec("pyspark") else [f"{m}.py" for m in SPARK_MODULES]
"""Without PySpark (an environment without the ``spark`` extra) its modules are not collected; the header says so."""


def pytest_report_header() -> str | None:
    return f"pyspark is not installed: {', '.join(collect_ignore)} not collected" if collect_ignore else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.module is not None and item.module.__name__ in FULL_PROFILE_MODULES:
            item.add_marker(pytest.mark.slow)


AIO_MODULES_SYNC_ONLY = {
    # In the async API's modules, tests that use no async engine of the backend's (or build their own).
    "test_a_sync_poll_returns_the_first_partitions_deliveries_when_the_second_partitions_connection_is_killed",
    "test_the_async_api_refuses_what_is_not_async_and_the_sync_api_points_to_it",
    "test_the_web_example_enqueues_in_the_orders_transaction_and_confirms",
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    module, function = metafunc.module.__name__, metafunc.function.__name__
    both_apis = "api" in metafunc.fixturenames and module in AIO_CONTRACT_MODULES and function not in AIO_SYNC_ONLY
    if both_apis and "backend" in metafunc.fixturenames:
        # Every sync backend with both APIs, then the async-only backends with the async API.
        pairs = [(b, a) for b in BACKENDS for a in ("sync", "async")] + [(b, "async") for b in ASYNC_BACKENDS]
        metafunc.parametrize(("backend", "api"), pairs, indirect=True, ids=[f"{b}-{a}" for b, a in pairs])
        return
    if both_apis:
        metafunc.parametrize("api", ["sync", "async"], indirect=True)
    # The async-only backends: for tests of the async API's modules that ask for a backend themselves
    # (a test that only asks for ``engine`` uses the sync API).
    code = metafunc.function.__code__
    requested = set(code.co_varnames[: code.co_argcount])
    async_api = module.startswith("test_aio_") and function not in AIO_MODULES_SYNC_ONLY
    marked = {n.strip() for m in metafunc.definition.iter_markers("parametrize") for n in _argnames(m.args[0])}

    def backends(name: str, sync: list[str]) -> None:
        if name in metafunc.fixturenames and name not in marked:
            also = ASYNC_BACKENDS if async_api and name in requested else []
            metafunc.parametrize(name, sync + also, indirect=True)

    backends("backend", BACKENDS)
    if module in ("test_aio_seams", "test_seams_review"):  # test_aio_seams's ``server``: the backends with a server
        backends("server", [b for b in BACKENDS if b != "sqlite"])
    if async_api and "postgres" in requested and "postgres" not in marked:
        metafunc.parametrize("postgres", ["postgresql", *ASYNC_BACKENDS], indirect=True)


def _argnames(names: str | list[str] | tuple[str, ...]) -> list[str]:
    return names.split(",") if isinstance(names, str) else list(names)


@pytest.fixture
def api(request: pytest.FixtureRequest) -> str:
    """Which API ``make_queue`` hands out: "sync", or "async" (``delayq.aio`` run on an event loop)."""
    return str(getattr(request, "param", "sync"))


def async_url(url: str) -> str:
    """The async driver's URL for a sync test URL: aiosqlite, psycopg (async), asyncmy; an async-only
    backend's URL (asyncpg) as it is."""
    parsed = sa.make_url(url)
    if parsed.get_driver_name() == "asyncpg":
        return url
    driver = {"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+psycopg", "mysql": "mysql+asyncmy"}
    return parsed.set(drivername=driver[parsed.get_backend_name()]).render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def aio_loop() -> Iterator[Any]:
    """One event loop for the tests that drive ``delayq.aio`` from sync code (``run_until_complete``)."""
    import asyncio

    loop = asyncio.new_event_loop()
    yield loop
    for engine in _aio_engines.values():
        loop.run_until_complete(engine.dispose())
    _aio_engines.clear()
    loop.close()


@pytest.fixture
def aio_runner(backend: Backend, aio_loop: Any) -> SyncRunner:
    """The backend's ``AsyncEngine`` (one per backend) and ``aio_loop``, to run coroutines from sync tests."""
    if backend.url not in _aio_engines:
        _aio_engines[backend.url] = make_async_engine(backend.url)
    return SyncRunner(_aio_engines[backend.url], aio_loop)


_aio_engines: dict[str, Any] = {}


def sync_url(url: str) -> str:
    """The sync driver's URL for a test URL: an async-only backend's (asyncpg) becomes psycopg's."""
    parsed = sa.make_url(url)
    if parsed.get_driver_name() != "asyncpg":
        return url
    return parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)


def make_async_engine(url: str, **kwargs: Any) -> Any:
    """An ``AsyncEngine`` on the database of a test URL; SQLite as ``make_engine`` sets it up. On asyncpg,
    psycopg's ``connect_args={"options": "-c name=value ..."}`` become its ``server_settings``."""
    from sqlalchemy.ext.asyncio import create_async_engine

    if sa.make_url(url).get_driver_name() == "asyncpg" and "options" in kwargs.get("connect_args", {}):
        connect_args = dict(kwargs.pop("connect_args"))
        settings = (s.removeprefix("-c").strip().split("=", 1) for s in connect_args.pop("options").split(" -c "))
        kwargs["connect_args"] = {**connect_args, "server_settings": {k: v for k, v in settings}}

    if url.startswith("sqlite"):
        kwargs["connect_args"] = {"timeout": 30.0, **kwargs.pop("connect_args", {})}
        engine = create_async_engine(async_url(url), **kwargs)

        @sa.event.listens_for(engine.sync_engine, "connect")
        def _wal(dbapi_conn: Any, _: Any) -> None:
            cursor = dbapi_conn.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.close()

        return engine
    return create_async_engine(async_url(url), **{"pool_size": 20, "max_overflow": 20, **kwargs})


@dataclass
class SyncRunner:
    """An ``AsyncEngine`` and the event loop its coroutines run on, called from sync test code."""

    engine: Any
    loop: Any

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)


class SyncFacade:
    """A ``delayq.aio`` object behind the sync API's surface: each coroutine method runs to completion
    on the event loop; sync ``using=`` objects and deliveries are translated both ways. The sync
    ``Connection`` / ``Session`` a test passes becomes an ``AsyncConnection`` / ``AsyncSession`` over
    it, so the async API joins the test's transaction exactly as it would join an async one."""

    def __init__(self, target: Any, runner: SyncRunner, sync_engine: sa.Engine) -> None:
        self._target, self._runner, self._sync_engine = target, runner, sync_engine

    def __repr__(self) -> str:
        return f"SyncFacade({self._target!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SyncFacade) and self._target == other._target

    def __hash__(self) -> int:
        return hash(self._target)

    def __getattr__(self, name: str) -> Any:
        import inspect

        if name == "engine":
            return self._sync_engine
        value = getattr(self._target, name)
        if not inspect.iscoroutinefunction(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            args = tuple(self._inward(a) for a in args)
            kwargs = {k: self._inward(v) for k, v in kwargs.items()}
            return self._outward(self._runner.run(value(*args, **kwargs)))

        return call

    def _inward(self, value: Any) -> Any:
        from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
        from sqlalchemy.orm import Session

        if isinstance(value, SyncFacade):
            return value._target
        if isinstance(value, list | tuple) and any(isinstance(v, SyncFacade) for v in value):  # deliveries
            return type(value)(self._inward(v) for v in value)  # (payloads are never walked)
        if isinstance(value, sa.Engine):
            return self._runner.engine
        if isinstance(value, sa.Connection):
            return AsyncConnection(self._runner.engine, value)
        if isinstance(value, Session):
            return AsyncSession(sync_session_class=lambda **_: value)
        return value

    def _outward(self, value: Any) -> Any:
        from delayq.aio import AsyncDelivery

        if isinstance(value, AsyncDelivery):
            return SyncFacade(value, self._runner, self._sync_engine)
        if isinstance(value, list | tuple):
            return type(value)(self._outward(v) for v in value)
        return value


def facade_queue(runner: SyncRunner, sync_engine: sa.Engine, queue_name: str, **kwargs: Any) -> Any:
    """An ``AsyncDelayedQueue`` on the runner's engine behind the sync surface."""
    from delayq.aio import AsyncDelayedQueue

    if "engine" in kwargs:
        raise ValueError("the async API's queues run on the backend's AsyncEngine")
    return SyncFacade(AsyncDelayedQueue(runner.engine, kwargs.pop("name", queue_name), **kwargs), runner, sync_engine)
