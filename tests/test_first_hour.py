"""The operator's first hour (issue 30): every command bounded against a silent server, the schema revision
checked before anything half-runs, and one clear line for each thing an operator can get wrong.

CLI cases run the real ``delayq`` command as a process. The lines docs/operations.md promises in its
"Failure modes" table are checked here (``documented``), so the table stays true.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import REPO_ROOT, Backend, make_async_engine

from delayq import DeadLetter, DelayedQueue, Delivery, Handler, Retry, Topic, Worker, migrations
from delayq.errors import SchemaRevisionError
from delayq.schema import make_tables

DOCS = REPO_ROOT / "docs" / "operations.md"
DOCUMENTED_BOUND = 15.0
"""What docs/operations.md promises: a server that never answers fails a command within this many seconds."""


# -- helpers --------------------------------------------------------------------------------------------
def delayq(*args: str, input: str | None = None, cwd: Path | None = None, timeout: float = 60) -> Any:
    """The real command, as a process, importing delayq from this tree."""
    env = {k: v for k, v in os.environ.items() if k != "DELAYQ_URL"}
    env["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{REPO_ROOT / 'tests'}"  # (handlers of this module, by name)
    return subprocess.run(
        [sys.executable, "-m", "delayq.cli", *args],
        input=input,
        cwd=cwd or REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def failure_modes() -> dict[str, tuple[str, int]]:
    """The "Failure modes" table of docs/operations.md: case -> (the line as a pattern, exit code)."""
    text = DOCS.read_text()
    table = text.split("<!-- failure-modes -->", 2)[1]
    found: dict[str, tuple[str, int]] = {}
    for row in table.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split(" | ")]
        if len(cells) != 4 or not cells[3].isdigit():
            continue
        line = cells[2].removeprefix("`` ").removesuffix(" ``").replace("\\|", "|")
        found[cells[0]] = (re.escape(line).replace("…", ".*"), int(cells[3]))
    return found


def documented(case: str, done: Any) -> None:
    """The command printed, as its only line on stderr, what the table says for ``case``, with its exit code."""
    pattern, code = failure_modes()[case]
    lines = done.stderr.strip().splitlines()
    assert done.returncode == code, (case, done.returncode, done.stderr)
    assert len(lines) == 1 and re.fullmatch(pattern, lines[0]), (case, done.stderr)


@pytest.fixture
def prefix(backend: Backend) -> Iterator[str]:
    """A table prefix of this test's own; its tables are dropped at the end."""
    p = f"fh{uuid.uuid4().hex[:8]}_"
    yield p
    tables = make_tables(p)
    with backend.engine.begin() as conn:
        tables.metadata.drop_all(conn, checkfirst=True)
        conn.execute(sa.text(f"DROP TABLE IF EXISTS {migrations.version_table(p)}"))


def migrated_to(backend: Backend, prefix: str, revision: str) -> None:
    migrations.upgrade(backend.url, revision, prefix=prefix)


def set_recorded_revision(backend: Backend, prefix: str, revision: str) -> None:
    table = sa.table(migrations.version_table(prefix), sa.column("version_num"))
    with backend.engine.begin() as conn:
        conn.execute(sa.update(table).values(version_num=revision))


class SilentServer:
    """A listening socket on 127.0.0.1 that accepts every connection and never says a word."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = int(self.sock.getsockname()[1])
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.held:
            c.close()


# -- row 1: a server that accepts TCP and never answers ----------------------------------------------------
SILENT_URLS = {
    "postgresql": "postgresql+psycopg://postgres@127.0.0.1:{port}/test",
    "mysql": "mysql+mysqldb://root@127.0.0.1:{port}/test",
}
COMMANDS = [
    ["stats"],
    ["migrate"],
    ["enqueue", "q", "k", "1"],
    ["ls", "q"],
    ["cron", "ls"],
    ["dead", "purge", "q", "--all", "--yes"],
    ["worker", "test_first_hour:handlers"],
    ["demo"],
]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SILENT_URLS))
def test_every_command_fails_in_bounded_time_against_a_server_that_never_answers(name: str) -> None:
    server = SilentServer()
    try:
        url = SILENT_URLS[name].format(port=server.port)
        env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{REPO_ROOT / 'tests'}"}
        env.pop("DELAYQ_URL", None)
        started = [
            subprocess.Popen(
                [sys.executable, "-m", "delayq.cli", "--url", url, *command],
                env=env,
                cwd=REPO_ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for command in COMMANDS
        ]
        for command, p in zip(COMMANDS, started, strict=True):
            try:
                out, err = p.communicate(timeout=DOCUMENTED_BOUND * 3)  # well above the documented bound
            except subprocess.TimeoutExpired:
                for q in started:
                    q.kill()
                pytest.fail(f"{command} still waits on a silent server after {DOCUMENTED_BOUND * 3:.0f}s")
            done = subprocess.CompletedProcess(p.args, p.returncode, out, err)
            documented(f"silent server ({name})", done)
    finally:
        server.close()


def test_every_engine_delayq_creates_comes_from_one_function() -> None:
    """CLI, demo, worker, migrations and Spark tasks: ``delayq.engines.create_engine`` (and the asyncio
    worker's ``create_async_engine``), with the timeouts."""
    made_elsewhere = [
        f"{p.relative_to(REPO_ROOT)}:{n}"
        for p in (REPO_ROOT / "delayq").rglob("*.py")
        if p.name != "engines.py"
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"\bsa\.create_engine\(|sqlalchemy\.create_engine\(|(?<!engines\.)create_async_engine\(", line)
        and not line.lstrip().startswith(("#", 'f"', '"', "'"))
    ]
    assert made_elsewhere == []


# -- row 2: the schema revision ------------------------------------------------------------------------------
class Noop(Handler):
    queue = "first-hour-noop"

    def handle(self, delivery: Delivery, conn: Any = None) -> None:
        pass


handlers = [Noop]


def test_an_older_schema_is_refused_on_first_use_naming_what_it_needs(
    backend: Backend, prefix: str, queue_name: str
) -> None:
    migrated_to(backend, prefix, "delayq_0002")
    head = ", ".join(migrations.head_revisions())
    says = f"database at delayq_0002, this delayq needs {head}: run `delayq migrate`"
    engine = backend.make_engine()
    try:
        q = DelayedQueue(engine, queue_name, table_prefix=prefix)
        with pytest.raises(SchemaRevisionError) as refused:
            q.offer("k", 1)
        assert str(refused.value) == says
        with pytest.raises(SchemaRevisionError):
            q.stats()  # reading is refused too: the columns it would read may not be there
    finally:
        engine.dispose()
    with pytest.raises(SchemaRevisionError, match="this delayq needs"):
        Topic(backend.make_engine(), f"t{uuid.uuid4().hex[:8]}", table_prefix=prefix).create(1)
    worker = Worker(backend.make_engine(), [type("H", (Noop,), {"queue": queue_name})()], table_prefix=prefix)
    with pytest.raises(SchemaRevisionError, match="this delayq needs"):
        worker.run_once()
    with backend.engine.connect() as conn:
        assert not sa.inspect(conn).has_table(f"{prefix}topics")  # nothing was created on the way
        assert conn.execute(sa.select(sa.func.count()).select_from(make_tables(prefix).messages)).scalar() == 0


def test_the_asyncio_api_refuses_an_older_schema_too(backend: Backend, prefix: str, queue_name: str) -> None:
    from delayq.aio import AsyncDelayedQueue

    migrated_to(backend, prefix, "delayq_0002")

    async def main() -> None:
        engine = make_async_engine(backend.url)
        try:
            q = AsyncDelayedQueue(engine, queue_name, table_prefix=prefix)
            with pytest.raises(SchemaRevisionError, match="database at delayq_0002, this delayq needs"):
                await q.offer("k", 1)
        finally:
            await engine.dispose()

    asyncio.run(main())


def test_the_revision_is_read_once_per_engine_and_a_refusal_is_not_remembered(
    backend: Backend, prefix: str, queue_name: str
) -> None:
    migrated_to(backend, prefix, "delayq_0002")
    engine = backend.make_engine()
    reads: list[str] = []
    sa.event.listen(
        engine,
        "before_cursor_execute",
        lambda conn, cursor, statement, *rest: reads.append(statement) if "alembic_version" in statement else None,
    )
    try:
        q = DelayedQueue(engine, queue_name, table_prefix=prefix)
        with pytest.raises(SchemaRevisionError):
            q.offer("k", 1)
        migrated_to(backend, prefix, "heads")  # the operator runs `delayq migrate`: the same process now works
        assert q.offer("k", 1).value == "created"
        before = len(reads)
        for i in range(5):
            q.offer(f"k{i}", i)
        assert q.stats().ready == 6
        assert DelayedQueue(engine, queue_name + "-b", table_prefix=prefix).stats().ready == 0
        assert len(reads) == before  # checked once for this engine and these tables, never again
    finally:
        engine.dispose()


def test_a_database_newer_than_this_delayq_is_refused(backend: Backend, prefix: str, queue_name: str) -> None:
    migrated_to(backend, prefix, "delayq_0002")
    set_recorded_revision(backend, prefix, "delayq_9999")
    with pytest.raises(SchemaRevisionError, match="database at delayq_9999, newer than this delayq"):
        DelayedQueue(backend.engine, queue_name, table_prefix=prefix).offer("k", 1)
    done = delayq("--url", backend.url, "--prefix", prefix, "stats")
    documented("newer schema", done)


def test_a_worker_on_an_older_schema_refuses_in_one_line_before_it_starts(backend: Backend, prefix: str) -> None:
    migrated_to(backend, prefix, "delayq_0002")
    done = delayq("--url", backend.url, "--prefix", prefix, "worker", "test_first_hour:handlers")
    documented("old schema", done)
    assert "started" not in done.stderr


# -- rows 3, 4, 8: one line, exit 2, nothing written -------------------------------------------------------
def test_migrate_to_a_revision_delayq_does_not_have_is_one_line(tmp_path: Path) -> None:
    done = delayq("--url", f"sqlite:///{tmp_path / 'x.db'}", "migrate", "--revision", "bogus")
    documented("unknown revision", done)
    assert list(tmp_path.iterdir()) == []


def test_uninstalling_a_schedule_that_does_not_exist_says_so(backend: Backend, queue_name: str) -> None:
    from delayq import CronService

    CronService(DelayedQueue(backend.engine, queue_name)).install_periodic("kept", every=dt.timedelta(hours=1))
    done = delayq("--url", backend.url, "cron", "uninstall", queue_name, "nope", "--yes")
    documented("no such schedule", done)
    assert "'kept'" in done.stderr
    kept = delayq("--url", backend.url, "cron", "uninstall", queue_name, "kept", "--yes")
    assert kept.returncode == 0 and "kept: uninstalled" in kept.stdout, kept.stderr


def test_an_in_memory_sqlite_url_is_refused_and_a_worker_before_migrate_leaves_nothing(tmp_path: Path) -> None:
    documented("in-memory SQLite", delayq("--url", "sqlite:///:memory:", "stats", cwd=tmp_path))
    done = delayq("--url", f"sqlite:///{tmp_path / 'app.db'}", "worker", "delayq.demo:SendEmail", cwd=tmp_path)
    documented("no database file", done)
    assert "started" not in done.stderr and list(tmp_path.iterdir()) == []


def test_server_down_wrong_password_and_missing_tables_are_one_line(backend: Backend, tmp_path: Path) -> None:
    if backend.name == "postgresql":
        documented("server down", delayq("--url", "postgresql+psycopg://postgres@127.0.0.1:1/test", "stats"))
    if backend.name == "mysql":
        wrong = sa.engine.make_url(backend.url).set(username="root", password="wrong")
        documented("wrong password", delayq("--url", wrong.render_as_string(hide_password=False), "stats"))
    documented("missing tables", delayq("--url", backend.url, "--prefix", f"none{uuid.uuid4().hex[:6]}_", "stats"))


# -- row 5: a requested retry or dead letter is no failure ---------------------------------------------------
def test_requested_retries_and_dead_letters_log_at_info_and_count_apart(
    backend: Backend, queue_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from test_metrics import samples

    from delayq.aio import AsyncDelivery, AsyncHandler, AsyncWorker
    from delayq.metrics import register, unregister

    class Asks(Handler):
        queue = queue_name

        def handle(self, delivery: Delivery, conn: Any = None) -> None:
            if delivery.key.startswith("retry"):
                raise Retry(after=dt.timedelta(hours=1), reason="not yet")
            raise DeadLetter("no such customer")

    class AsksAsync(AsyncHandler):
        queue = queue_name + "-a"

        async def handle(self, delivery: AsyncDelivery, conn: Any = None) -> None:
            if delivery.key.startswith("retry"):
                raise Retry(after=dt.timedelta(hours=1), reason="not yet")
            raise DeadLetter("no such customer")

    registry = CollectorRegistry()
    worker = Worker(backend.engine, [Asks()])
    metrics = register(registry, worker.queues)
    caplog.set_level(logging.INFO, logger="delayq")
    try:
        worker.queues[0].offer_many([("retry-1", 1, None), ("dead-1", 2, None)])
        assert worker.run_once() == 2

        async def main() -> None:
            engine = make_async_engine(backend.url)
            aw = AsyncWorker(engine, [AsksAsync()])
            await aw.async_queues[queue_name + "-a"].offer_many([("retry-1", 1, None), ("dead-1", 2, None)])
            assert await aw.run_once() == 2
            await engine.dispose()

        asyncio.run(main())
        scraped = generate_latest(registry).decode()
    finally:
        unregister(metrics, registry)
    records = [r for r in caplog.records if r.name == "delayq.delivery" and getattr(r, "delayq_event", "") != "start"]
    assert len(records) == 4
    assert all(r.levelno == logging.INFO and r.exc_info is None for r in records), [r.getMessage() for r in records]
    assert sorted(r.delayq_event for r in records) == ["dead_letter", "dead_letter", "retry", "retry"]  # type: ignore[attr-defined]
    for name in (queue_name, queue_name + "-a"):
        got = samples(scraped, name)
        assert got["delayq_handler_duration_seconds_count{retry}"] == 1
        assert got["delayq_handler_duration_seconds_count{dead_letter}"] == 1
        assert got.get("delayq_handler_duration_seconds_count{failure}", 0) == 0


# -- rows 6, 7: long payloads ---------------------------------------------------------------------------------
def test_listings_cut_long_payloads_and_enqueue_reads_a_file_or_stdin(
    backend: Backend, queue_name: str, tmp_path: Path
) -> None:
    big = {"blob": "x" * 400_000}
    (tmp_path / "big.json").write_text(json.dumps(big))
    from_file = delayq("--url", backend.url, "enqueue", queue_name, "big", f"@{tmp_path / 'big.json'}")
    assert from_file.returncode == 0 and "created" in from_file.stdout, from_file.stderr
    from_stdin = delayq("--url", backend.url, "enqueue", queue_name, "small", "-", input='{"n": 1}')
    assert from_stdin.returncode == 0 and "created" in from_stdin.stdout, from_stdin.stderr
    q = DelayedQueue(backend.engine, queue_name)
    assert q.get("big").payload == big and q.get("small").payload == {"n": 1}

    listed = delayq("--url", backend.url, "ls", queue_name)
    assert listed.returncode == 0 and len(listed.stdout) < 2_000, len(listed.stdout)
    assert "(400,012 characters)" in listed.stdout
    as_json = json.loads(delayq("--url", backend.url, "ls", queue_name, "--json").stdout)
    assert {m["key"]: m["payload"] for m in as_json}["small"] == {"n": 1}
    full = json.loads(delayq("--url", backend.url, "ls", queue_name, "--json", "--full").stdout)
    assert {m["key"]: m["payload"] for m in full}["big"] == big
    shown = json.loads(delayq("--url", backend.url, "show", queue_name, "big", "--json").stdout)
    assert shown[0]["payload"] == big

    documented("bad payload", delayq("--url", backend.url, "enqueue", queue_name, "k", "not json"))
    documented("bad payload file", delayq("--url", backend.url, "enqueue", queue_name, "k", f"@{tmp_path / 'none'}"))
    assert q.get("k") is None


# -- rows 9, 12: a missing extra -------------------------------------------------------------------------------
def test_a_missing_extra_is_one_line_that_works_from_the_source_tree(tmp_path: Path) -> None:
    blocked = (
        "import sys; sys.modules.update(dict.fromkeys({mods}));"
        "from delayq.cli import main; sys.argv[0] = 'delayq'; main()"
    )
    env = {**{k: v for k, v in os.environ.items() if k != "DELAYQ_URL"}, "PYTHONPATH": str(REPO_ROOT)}
    url = f"sqlite:///{tmp_path / 'x.db'}"
    assert delayq("--url", url, "migrate").returncode == 0

    def run(mods: list[str], *args: str) -> Any:
        code = blocked.format(mods=mods)
        return subprocess.run(
            [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=60, cwd=REPO_ROOT
        )

    documented("missing extra (top)", run(["rich"], "--url", url, "top"))
    metrics = run(["prometheus_client"], "--url", url, "worker", "delayq.demo:SendEmail", "--metrics-port", "0")
    documented("missing extra (metrics)", metrics)
    documented("missing driver", run(["psycopg"], "--url", "postgresql+psycopg://u@127.0.0.1/x", "stats"))
    traced = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.modules['opentelemetry'] = None\n"
            "import delayq.tracing\n"
            "try:\n    delayq.tracing.enable()\n"
            "except ImportError as exc:\n    print(type(exc).__name__, exc)",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert traced.stdout.strip() == (
        "MissingExtraError delayq.tracing needs opentelemetry-api (opentelemetry is not installed): "
        "pip install -e '.[otel]' in delayq's source tree"
    ), traced.stdout + traced.stderr


def test_no_hint_or_page_says_to_install_delayq_from_an_index() -> None:
    """delayq is not on a package index: every instruction installs from the source tree."""
    places = [REPO_ROOT / "README.md", *(REPO_ROOT / "docs").glob("*.md"), *(REPO_ROOT / "delayq").rglob("*.py")]
    offenders = [
        str(p.relative_to(REPO_ROOT))
        for p in places
        if re.search(r"pip install '?delayq\[", p.read_text()) and "spark" not in p.parts and p.name != "spark.md"
    ]
    assert offenders == []


# -- row 10: one time format -------------------------------------------------------------------------------------
def test_topic_lag_prints_times_in_iso_8601_as_every_command_does(backend: Backend) -> None:
    from delayq import Subscription

    name = f"fh-{uuid.uuid4().hex[:10]}"
    Topic(backend.engine, name).create(1)
    Topic(backend.engine, name).publish("k", "m1", {"i": 1})
    sub = Subscription(backend.engine, name, "g", "g-1")
    sub.rebalance()
    assert sub.poll(1)
    [row] = json.loads(delayq("--url", backend.url, "topics", "lag", name, "g", "--json").stdout)
    assert "T" in row["lease_expires"] and dt.datetime.fromisoformat(row["lease_expires"]).tzinfo is not None


# -- rows 11, 13: the demo and the test databases ------------------------------------------------------------------
@pytest.mark.slow
def test_the_demo_run_again_shows_the_same_tour(tmp_path: Path) -> None:
    first = delayq("demo", "--seconds", "1", cwd=tmp_path, timeout=120)
    second = delayq("demo", "--seconds", "1", cwd=tmp_path, timeout=120)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr

    def tour(out: str) -> list[str]:
        return [line for line in out.splitlines() if line.startswith(("summary", "  dead letter", "offered"))]

    assert tour(first.stdout) == tour(second.stdout)
    assert "2 dead letters" in tour(second.stdout)[1]
    cron = delayq("cron", "ls", "--json", cwd=tmp_path)
    assert json.loads(cron.stdout) == []  # nothing left to stall
    [emails] = [r for r in json.loads(delayq("stats", "--json", cwd=tmp_path).stdout) if r["queue"] == "demo-emails"]
    assert emails["dead"] == 2


def createdb(env: dict[str, str]) -> Any:
    script = str(REPO_ROOT / "scripts" / "createdb.py")
    return subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=60)


def test_the_test_command_creates_the_databases_it_needs(backend_urls: dict[str, str]) -> None:
    name = f"delayq_createdb_{uuid.uuid4().hex[:8]}"
    urls = {
        var: sa.engine.make_url(backend_urls[b]).set(database=name)
        for var, b in (("DELAYQ_TEST_POSTGRES_URL", "postgresql"), ("DELAYQ_TEST_MYSQL_URL", "mysql"))
    }
    env = {**os.environ, **{var: u.render_as_string(hide_password=False) for var, u in urls.items()}}
    try:
        done = createdb(env)
        assert done.returncode == 0 and done.stdout.count(": created") == 2, done.stdout + done.stderr
        for u in urls.values():
            engine = sa.create_engine(u, poolclass=sa.pool.NullPool)
            with engine.connect():
                pass
            engine.dispose()
        again = createdb(env)
        assert again.stdout.count(": exists") == 2, again.stdout + again.stderr
    finally:
        for u in urls.values():
            server = u._replace(database="postgres" if u.get_backend_name() == "postgresql" else None)
            engine = sa.create_engine(server, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
            with engine.connect() as conn:
                conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name}")
            engine.dispose()


def test_the_failure_modes_table_covers_what_an_operator_can_get_wrong() -> None:
    cases = set(failure_modes())
    needed = {"server down", "silent server (postgresql)", "silent server (mysql)", "wrong password", "old schema"}
    needed |= {"newer schema", "missing extra (top)", "bad payload", "missing tables"}
    assert needed <= cases, needed - cases


def test_a_missing_table_error_names_the_tables_that_are_missing(backend: Backend, prefix: str) -> None:
    """Tables made without Alembic (no revision to judge) but without the topic tables: the error names those."""
    from delayq.errors import SchemaMissingError

    tables = make_tables(prefix)
    with backend.engine.begin() as conn:
        tables.metadata.create_all(conn, tables=[tables.messages, tables.dead_letters, tables.schedules])
    with pytest.raises(SchemaMissingError) as refused:
        Topic(backend.engine, f"t{uuid.uuid4().hex[:8]}", table_prefix=prefix).create(1)
    assert f"{prefix}topic_" in str(refused.value) and f"{prefix}messages" not in str(refused.value)


@pytest.mark.parametrize("name", ["postgresql", "mysql"])
def test_a_statement_on_a_connection_that_went_silent_fails_within_the_read_bound(
    name: str, backend_urls: dict[str, str]
) -> None:
    """The command line's client-side read bound: a connection that answered, then went silent for good (a NAT
    that forgot it), fails its next statement as a lost connection instead of waiting forever. On PostgreSQL
    that is delayq's bound (psycopg has no read timeout); on MariaDB mysqlclient's ``read_timeout``, which the
    URL may set (as here, shorter than delayq's 60 s)."""
    from faults import FaultProxy

    from delayq.engines import create_engine, read_bound

    with FaultProxy.for_url(backend_urls[name]) as proxy:
        url = sa.engine.make_url(proxy.url_for(backend_urls[name]))
        engine = create_engine(url if name == "postgresql" else url.update_query_dict({"read_timeout": "1"}))
        try:
            with read_bound(engine, 1.0), engine.connect() as conn:
                assert conn.execute(sa.text("SELECT 1")).scalar() == 1
                proxy.stall_existing()
                with pytest.raises(sa.exc.DBAPIError):
                    conn.execute(sa.text("SELECT 2"))
        finally:
            engine.dispose()
