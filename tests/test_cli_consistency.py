"""The command line's consistency (issue 42, item 7): each failure one line with the documented exit code, the
URLs people have, and what the dashboard's browsers ask for; on every backend."""

from __future__ import annotations

import datetime as dt
import re

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result
from conftest import Backend, SyncRunner
from test_first_hour import failure_modes

from delayq import DelayedQueue, FlowState, InvalidInputError
from delayq.aio import AsyncDelayedQueue
from delayq.cli import main
from delayq.engines import create_engine, driver_url
from delayq.humanize import exact
from delayq.schema import make_tables

HOUR = dt.timedelta(hours=1)


def cli(url: str, *args: str) -> Result:
    return CliRunner().invoke(main, ["--url", url, *args], catch_exceptions=False)


def one_line(result: Result, case: str | None = None) -> str:
    """The failure's one line (``Error: ...``), exit code 2 as docs/operations.md has it for bad input; with
    ``case``, the line and the code of that row of its "Failure modes" table."""
    pattern, code = failure_modes()[case] if case else ("Error: .*", 2)
    assert result.exit_code == code, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(pattern, lines[0]), result.output
    return lines[0]


def flow_rows(backend: Backend, queue: str) -> int:
    flow = make_tables().flow
    with backend.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).where(flow.c.queue == queue)).scalar_one())


@pytest.mark.parametrize("command", [["pause"], ["resume"], ["limit", "--concurrency", "2"]])
def test_flow_commands_on_a_queue_the_database_knows_nothing_of_fail_unless_create(
    backend: Backend, queue_name: str, command: list[str]
) -> None:
    name, *options = command
    line = one_line(cli(backend.url, name, queue_name, *options), "unknown queue (flow)")
    assert f"no queue {queue_name!r}" in line and "--create" in line
    assert flow_rows(backend, queue_name) == 0  # nothing written
    done = cli(backend.url, name, queue_name, *options, "--create")
    assert done.exit_code == 0, done.output
    assert flow_rows(backend, queue_name) == 1
    again = cli(backend.url, name, queue_name, *options)  # its flow row makes it known
    assert again.exit_code == 0, again.output


def test_flow_commands_on_a_queue_with_messages_or_dead_letters_need_no_create(
    backend: Backend, queue_name: str
) -> None:
    q = DelayedQueue(backend.engine, queue_name)
    q.offer("k", 1)
    [d] = q.try_poll_many(1)
    assert d.dead_letter("bad")  # a dead letter and nothing else
    assert cli(backend.url, "pause", queue_name).exit_code == 0 and q.flow().paused


def test_cancelling_a_job_that_finished_says_so(backend: Backend, queue_name: str) -> None:
    q = DelayedQueue(backend.engine, queue_name, retention=HOUR)
    q.offer_many([("running", 1, None), ("done", 2, None)])
    held = {d.key: d for d in q.try_poll_many(2)}
    assert cli(backend.url, "cancel", queue_name, "running").exit_code == 0
    assert held["done"].ack()
    line = one_line(cli(backend.url, "cancel", queue_name, "running"), "finished already")
    assert line == f"Error: message 'running' of queue {queue_name!r} is already cancelled: nothing to cancel"
    line = one_line(cli(backend.url, "cancel", queue_name, "done"))
    assert line == f"Error: message 'done' of queue {queue_name!r} is already completed: nothing to cancel"
    assert "no message 'never'" in one_line(cli(backend.url, "cancel", queue_name, "never"))


def bare(url: str) -> list[str]:
    """The test URL spelled without its driver, as a ``DATABASE_URL`` has it (SQLite's names none)."""
    if url.startswith("postgresql+psycopg://"):
        rest = url.removeprefix("postgresql+psycopg://")
        return [f"postgres://{rest}", f"postgresql://{rest}"]
    if url.startswith("mysql+mysqldb://"):
        return [f"mysql://{url.removeprefix('mysql+mysqldb://')}"]
    return [url]


def test_urls_without_a_driver_use_delayqs(backend: Backend, queue_name: str) -> None:
    DelayedQueue(backend.engine, queue_name).offer("k", 1)
    for url in bare(backend.url):
        listed = cli(url, "ls", queue_name, "--json")
        assert listed.exit_code == 0 and '"key": "k"' in listed.output, (url, listed.output)
        assert cli(url, "pause", queue_name).exit_code == 0
        engine = create_engine(url)
        try:
            assert engine.url.drivername == sa.make_url(backend.url).drivername
            assert DelayedQueue(engine, queue_name).flow().paused
        finally:
            engine.dispose()


def test_migrations_take_urls_without_a_driver(backend: Backend) -> None:
    """``delayq.migrations.upgrade`` and ``downgrade`` called from Python, and Alembic's own command line
    (``-x url=``, ``DELAYQ_URL``), take them as ``delayq migrate`` does (``delayq.engines.driver_url``)."""
    from test_migrations import alembic_cli, schema_diff, table_exists

    from delayq import migrations

    prefix = "bareurl_"
    for url in bare(backend.url):
        migrations.downgrade(url, prefix=prefix)
        try:
            migrations.upgrade(url, prefix=prefix)
            assert schema_diff(backend.engine, prefix) == []
        finally:
            migrations.downgrade(url, prefix=prefix)
        assert not table_exists(backend.engine, f"{prefix}messages")
    x = ["-x", f"url={bare(backend.url)[0]}", "-x", f"delayq_prefix={prefix}"]
    alembic_cli(*x, "upgrade", "heads")
    try:
        assert table_exists(backend.engine, f"{prefix}messages")
    finally:
        alembic_cli(*x, "downgrade", "base")
    assert not table_exists(backend.engine, f"{prefix}messages")


def test_the_spark_source_takes_urls_without_a_driver(backend: Backend) -> None:
    """Its options' check (``delayq.spark.check_url``) takes them as the executors' engines do."""
    from delayq.spark.options import SourceOptions

    for url in bare(backend.url):
        engine = SourceOptions.parse({"url": url, "queue": "q"}).engine()
        try:
            with engine.connect() as conn:
                assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1
            assert engine.url.drivername == sa.make_url(backend.url).drivername
        finally:
            engine.dispose()


def test_driver_url_names_delayqs_driver_where_the_scheme_names_none() -> None:
    assert (
        driver_url("postgres://u:p%40ss@h:5/db?sslmode=require")
        == "postgresql+psycopg://u:p%40ss@h:5/db?sslmode=require"
    )
    assert driver_url("postgresql://h/db") == "postgresql+psycopg://h/db"
    assert driver_url("mysql://h/db") == "mysql+mysqldb://h/db"
    for kept in ("postgresql+psycopg2://h/db", "mysql+pymysql://h/db", "sqlite:///x.db", "not a url"):
        assert driver_url(kept) == kept
    assert driver_url(sa.make_url("postgres://h/db")).drivername == "postgresql+psycopg"


def test_group_concurrency_none_sets_the_default_again(backend: Backend, queue_name: str) -> None:
    q = DelayedQueue(backend.engine, queue_name)
    q.offer("k", 1, group="g")
    set_three = cli(backend.url, "limit", queue_name, "--group-concurrency", "3")
    assert set_three.exit_code == 0 and q.flow().group_concurrency == 3
    reset = cli(backend.url, "limit", queue_name, "--group-concurrency", "none")
    assert reset.exit_code == 0, reset.output
    assert reset.output.strip().endswith("group concurrency 1") and q.flow().group_concurrency == 1
    assert "--group-concurrency" in one_line(cli(backend.url, "limit", queue_name, "--group-concurrency", "0"))


def test_set_group_concurrency_none_is_the_default_as_its_message_says(
    backend: Backend, queue_name: str, aio_runner: SyncRunner
) -> None:
    q = DelayedQueue(backend.engine, queue_name)
    aq = AsyncDelayedQueue(aio_runner.engine, queue_name)
    for setting in (lambda n: q.set_group_concurrency(n), lambda n: aio_runner.run(aq.set_group_concurrency(n))):
        setting(4)
        assert q.flow().group_concurrency == 4
        setting(None)
        assert q.flow() == FlowState(group_concurrency=1)
        with pytest.raises(InvalidInputError, match=r"positive integer or None \(the default, 1\), got 0$"):
            setting(0)


def test_ls_in_flight_labels_the_lock_expiry(backend: Backend, queue_name: str) -> None:
    q = DelayedQueue(backend.engine, queue_name)
    q.offer("k", 1)
    assert len(q.try_poll_many(1)) == 1
    listed = cli(backend.url, "ls", queue_name, "--state", "in-flight")
    assert listed.exit_code == 0, listed.output
    header = listed.output.splitlines()[0].split()
    assert header[:4] == ["KEY", "STATE", "LOCK_EXPIRES", "RUNNING"] and "DUE" not in header


@pytest.mark.parametrize(
    ("span", "text"),
    [
        (dt.timedelta(seconds=-1), "-1s"),
        (dt.timedelta(0), "0ms"),
        (dt.timedelta(milliseconds=250), "250ms"),
        (dt.timedelta(seconds=1.5), "1.5s"),
        (dt.timedelta(seconds=90), "1m 30s"),
        (-dt.timedelta(days=2, hours=4), "-2d 4h"),
        (dt.timedelta.min, "-999999999d"),
    ],
)
def test_exact_durations(span: dt.timedelta, text: str) -> None:
    assert exact(span) == text


def test_an_out_of_range_duration_reads_as_people_write_it(backend: Backend, queue_name: str) -> None:
    q = DelayedQueue(backend.engine, queue_name)
    with pytest.raises(InvalidInputError, match=r"^at -40000d is out of range"):
        q.offer("k", 1, at=-dt.timedelta(days=40000))


def test_the_dashboard_has_a_favicon_also_under_a_mount_path(engine: sa.Engine) -> None:
    from starlette.applications import Starlette
    from starlette.routing import Mount
    from starlette.testclient import TestClient

    from delayq.web import app

    for prefix, asgi in (("", app(engine)), ("/ops/delayq", Starlette(routes=[Mount("/ops/delayq", app(engine))]))):
        c = TestClient(asgi)
        icon = c.get(f"{prefix}/favicon.ico")
        assert icon.status_code == 200 and icon.headers["content-type"] == "image/x-icon"
        assert icon.content[:4] == b"\x00\x00\x01\x00"  # an ICO
        assert f'<link rel="icon" href="{prefix}/favicon.ico">' in c.get(f"{prefix}/").text
