"""Running workers: ``delayq worker MODULE:HANDLERS``, its engine, and its metrics server."""

from __future__ import annotations

import asyncio
import datetime as dt
import importlib
import inspect
import logging
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import click
import sqlalchemy as sa

from delayq import engines
from delayq.cli._common import Fail, check_schema, check_sqlite_file, check_url, friendly, opened
from delayq.cli._root import main
from delayq.errors import install_hint
from delayq.handler import Handler
from delayq.queue import DelayedQueue
from delayq.schema import DEFAULT_PREFIX
from delayq.topics import Topic, TopicHandler
from delayq.worker import Worker

LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


def load_handlers(spec: str) -> list[Handler | type[Handler]]:
    """Import ``module:attr`` where attr is a Handler class, an instance, or a list of them."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise Fail(f"expected module:attr, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise Fail(f"cannot load {spec!r}: {exc}") from None
    except SyntaxError as exc:
        raise Fail(f"cannot load {spec!r}: {exc.msg} at {exc.filename}:{exc.lineno}") from None
    except Exception as exc:  # the module's own code failed while it was imported: say where
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        raise Fail(f"cannot load {spec!r}: {type(exc).__name__}: {exc} (at {frame.filename}:{frame.lineno})") from None
    try:
        target = getattr(module, attr)
    except AttributeError as exc:
        raise Fail(f"cannot load {spec!r}: {exc}") from None
    items = list(target) if isinstance(target, list | tuple) else [target]
    for item in items:
        if not (isinstance(item, Handler) or (isinstance(item, type) and issubclass(item, Handler))):
            raise Fail(f"{spec!r} holds {item!r}, not a Handler class or instance")
    return items


@main.command()
@click.argument("handlers")
@click.option("--concurrency", default=4, show_default=True, type=click.IntRange(min=1), help="Handlers at once.")
@click.option(
    "--shutdown-timeout",
    default=30.0,
    show_default=True,
    type=click.FloatRange(min=0, max=86_400),
    help="Seconds in-flight handlers may run on after SIGINT/SIGTERM.",
)
@click.option(
    "--log-level",
    default="INFO",
    show_default=True,
    type=click.Choice(LOG_LEVELS, case_sensitive=False),
    help="DEBUG also logs each delivery's start; INFO each success; WARNING each failure (with its traceback).",
)
@click.option(
    "--driver",
    default="threads",
    show_default=True,
    type=click.Choice(["threads", "asyncio"]),
    help="threads: a Worker (def handle, the URL's driver); asyncio: an AsyncWorker on an event loop "
    "(async def handle; the database's asyncio driver: psycopg, asyncpg, aiosqlite, asyncmy).",
)
@click.option("--metrics-port", type=click.IntRange(0, 65535), help="Serve Prometheus metrics on this port.")
@click.option("--metrics-addr", default="0.0.0.0", show_default=True, help="Address the metrics server listens on.")
@click.pass_context
@friendly
def worker(
    ctx: click.Context,
    handlers: str,
    concurrency: int,
    shutdown_timeout: float,
    log_level: str,
    driver: str,
    metrics_port: int | None,
    metrics_addr: str,
) -> None:
    """Run the handlers HANDLERS (module:attr) until SIGINT or SIGTERM (a second one exits at once).

    --driver asyncio runs them with an AsyncWorker: queue handlers with an async def handle, topic
    handlers with either (a plain def one on a thread). The URL may name the sync driver (the
    database's asyncio one is used) or an asyncio one.
    """
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if "" not in sys.path:
        sys.path.insert(0, "")  # module:attr from the current directory, as python -m would
    loaded = load_handlers(handlers)
    check_driver(loaded, driver)
    if driver == "asyncio":
        check_sqlite_file(check_async_url(ctx.obj["url"]))
        options = {"concurrency": concurrency, "shutdown_timeout": dt.timedelta(seconds=shutdown_timeout)}
        asyncio.run(run_async(ctx.obj["url"], ctx.obj["prefix"], loaded, options, metrics_port, metrics_addr))
        return
    check_sqlite_file(check_url(ctx.obj["url"], async_hint=" (or run the worker with --driver asyncio)"))
    engine = worker_engine(ctx.obj["url"], concurrency)
    try:
        with engines.read_bound(engine), opened(engine) as conn:
            check_schema(conn, ctx.obj["prefix"])  # fail now, in one line, before any loop starts
        w = Worker(
            engine,
            loaded,
            concurrency=concurrency,
            table_prefix=ctx.obj["prefix"],
            shutdown_timeout=dt.timedelta(seconds=shutdown_timeout),
        )
        if metrics_port is not None:
            serve_metrics(metrics_port, metrics_addr, w, ctx.obj["prefix"])
        w.run()  # raises SchemaMissingError (exit 2, "run `delayq migrate`") when the tables are missing
    finally:
        engine.dispose()


def check_driver(loaded: list[Handler | type[Handler]], driver: str) -> None:
    """``Fail`` for a handler the driver cannot run: a coroutine queue handler on threads, a plain one
    (or a plain transactional topic handler) on asyncio."""
    for item in loaded:
        cls = item if isinstance(item, type) else type(item)
        is_async = inspect.iscoroutinefunction(cls.handle)
        topic = issubclass(cls, TopicHandler)
        if driver == "threads" and is_async:
            raise Fail(f"{cls.__name__}.handle is a coroutine (async def): run it with --driver asyncio")
        if driver == "asyncio" and not is_async and (not topic or cls.transactional):
            kind = "a transactional topic handler's" if topic else "a queue handler's"
            raise Fail(
                f"{cls.__name__}.handle is a plain def: --driver asyncio needs {kind} handle to be async def "
                "(or run it with --driver threads)"
            )


def check_async_url(url: str) -> sa.engine.URL | None:
    """``check_url`` for ``--driver asyncio``, which runs on the database's asyncio driver whichever
    driver the URL names (``engines.async_url``)."""
    try:
        parsed = sa.engine.make_url(url)
    except (sa.exc.ArgumentError, ValueError):
        return None  # the command reports a bad URL
    backend = parsed.get_backend_name()
    return check_url(parsed.set(drivername=backend).render_as_string(hide_password=False))


async def run_async(
    url: str,
    prefix: str,
    loaded: list[Handler | type[Handler]],
    options: dict[str, Any],
    metrics_port: int | None,
    metrics_addr: str,
) -> None:
    """Run an ``AsyncWorker`` of ``loaded`` on an ``AsyncEngine`` made from ``url`` until a signal stops it."""
    from delayq.aio.worker import AsyncWorker

    concurrency = options["concurrency"]
    # As for threads: a connection per handler besides the fetch, heartbeat, ack and listener tasks'.
    engine = engines.create_async_engine(
        url, pool_size=concurrency + 4, max_overflow=concurrency, pool_reset_on_return=None
    )
    try:
        async with engine.connect() as conn:
            await conn.run_sync(check_schema, prefix)  # fail now, in one line, before any loop starts
        w = AsyncWorker(engine, loaded, table_prefix=prefix, **options)  # type: ignore[arg-type]
        gauges: sa.Engine | None = None
        if metrics_port is not None:
            # The gauges are read by the metrics server's thread, which may not block the loop's engine:
            # they read through a sync engine of their own (a connection per scrape).
            gauges = engines.create_engine(engines.sync_url(url))
            queues = [DelayedQueue(gauges, name, table_prefix=prefix) for name in w.async_queues]
            serve_queue_metrics(metrics_port, metrics_addr, queues, topics_of(gauges, loaded, prefix))
        try:
            await w.run()
        finally:
            if gauges is not None:
                gauges.dispose()
    finally:
        await engine.dispose()


def serve_metrics(port: int, addr: str, w: Worker, prefix: str = DEFAULT_PREFIX) -> None:
    """Serve the worker's metrics on ``addr:port``, with the gauges of its queues and topics (tables named
    with ``prefix``; needs the ``metrics`` extra)."""
    serve_queue_metrics(port, addr, w.queues, topics_of(w.engine, w.handlers, prefix))


def topics_of(engine: sa.Engine, handlers: Sequence[Handler | type[Handler]], prefix: str) -> list[Topic]:
    """The topics the topic handlers among ``handlers`` read (for their metrics' gauges)."""
    names = {
        h.topic
        for h in handlers
        if isinstance(h, TopicHandler) or (isinstance(h, type) and issubclass(h, TopicHandler))
    }
    return [Topic(engine, name, table_prefix=prefix) for name in sorted(names)]


def serve_queue_metrics(port: int, addr: str, queues: Sequence[DelayedQueue], topics: Sequence[Topic] = ()) -> None:
    """Serve delayq's metrics, with the gauges of ``queues`` and ``topics``, on ``addr:port`` (needs the
    ``metrics`` extra)."""
    try:
        from delayq.metrics import serve
    except ImportError:
        raise Fail(f"--metrics-port needs prometheus-client: {install_hint('metrics')}") from None
    try:
        serve(port, queues, addr=addr, topics=topics)
    except OSError as exc:
        raise Fail(f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc}") from None
    logging.getLogger("delayq.metrics").info("metrics on http://%s:%d/metrics", addr, port)


def worker_engine(url: str, concurrency: int) -> sa.Engine:
    """An engine whose pool fits a worker of ``concurrency`` handlers, with delayq's network timeouts.

    Each handler may hold a connection for its whole run (a transactional one does), and the fetch
    loop, the heartbeat and the listener need one each besides: a smaller pool would make them
    wait on each other.
    """
    # delayq ends every transaction it begins (commit, or a rollback when its Connection closes on an
    # error), so the pool's ROLLBACK on return would only cost a round trip (on mysqlclient).
    return engines.create_engine(url, pool_size=concurrency + 3, max_overflow=concurrency, pool_reset_on_return=None)
