"""The migrations build exactly delayq.schema, standalone, after pip install, and embedded in an app."""

from __future__ import annotations

import datetime as dt
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from conftest import BACKENDS, REPO_ROOT, Backend

from delayq import migrations
from delayq.schema import make_tables

PREFIX = "mig_"


def schema_diff(engine: sa.Engine, prefix: str) -> list[object]:
    tables = make_tables(prefix)
    ours = {t.name for t in tables.metadata.sorted_tables}
    with engine.connect() as conn:
        ctx = MigrationContext.configure(
            conn,
            opts={
                "compare_type": True,
                "include_name": lambda name, type_, _: type_ != "table" or name in ours,
            },
        )
        return list(compare_metadata(ctx, tables.metadata))


def table_exists(engine: sa.Engine, name: str) -> bool:
    return sa.inspect(engine).has_table(name)


def alembic_cli(*args: str, cwd: Path = REPO_ROOT) -> None:
    subprocess.run([sys.executable, "-m", "alembic", *args], cwd=cwd, check=True, capture_output=True)


def test_alembic_upgrade_and_downgrade_from_the_repo_root(backend: Backend) -> None:
    x = ["-x", f"url={backend.url}", "-x", f"delayq_prefix={PREFIX}"]
    alembic_cli(*x, "downgrade", "base")
    alembic_cli(*x, "upgrade", "heads")
    try:
        assert schema_diff(backend.engine, PREFIX) == []
        assert table_exists(backend.engine, f"{PREFIX}alembic_version")
    finally:
        alembic_cli(*x, "downgrade", "base")
    assert not table_exists(backend.engine, f"{PREFIX}messages")
    assert not table_exists(backend.engine, f"{PREFIX}dead_letters")


def test_migrate_is_idempotent_and_matches_the_schema(backend: Backend) -> None:
    prefix = "mig2_"
    migrations.downgrade(backend.url, prefix=prefix)
    try:
        migrations.upgrade(backend.url, prefix=prefix)
        migrations.upgrade(backend.url, prefix=prefix)
        assert schema_diff(backend.engine, prefix) == []
    finally:
        migrations.downgrade(backend.url, prefix=prefix)


APP_ENV = """
import sqlalchemy as sa
from alembic import context
from delayq.migrations import include_name_for

app_metadata = sa.MetaData()
sa.Table("app_orders", app_metadata, sa.Column("id", sa.Integer, primary_key=True))
config = context.config
url = context.get_x_argument(as_dictionary=True)["url"]
prefix = context.get_x_argument(as_dictionary=True)["delayq_prefix"]

engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
with engine.connect() as conn:
    context.configure(connection=conn, target_metadata=app_metadata, version_table="app_alembic_version",
                      include_name=include_name_for(prefix))
    with context.begin_transaction():
        context.run_migrations()
"""

APP_REVISION = """
import sqlalchemy as sa
from alembic import op

revision = "app_0001"
down_revision = None
branch_labels = ("app",)
depends_on = None


def upgrade():
    op.create_table("app_orders", sa.Column("id", sa.Integer, primary_key=True))


def downgrade():
    op.drop_table("app_orders")
"""


@pytest.mark.parametrize("name", BACKENDS)
def test_delayq_as_a_branch_of_an_applications_alembic(name: str, backend_urls: dict[str, str], tmp_path: Path) -> None:
    url = backend_urls[name] if name != "sqlite" else f"sqlite:///{tmp_path / 'app.db'}"
    prefix = "app_dq_"
    (tmp_path / "migrations" / "versions").mkdir(parents=True)
    (tmp_path / "migrations" / "env.py").write_text(APP_ENV)
    (tmp_path / "migrations" / "versions" / "app_0001.py").write_text(APP_REVISION)
    (tmp_path / "migrations" / "script.py.mako").write_text((REPO_ROOT / "alembic" / "script.py.mako").read_text())
    # A package-resource path may hold spaces: separate the locations with spaces only if none do.
    (tmp_path / "alembic.ini").write_text(
        textwrap.dedent(f"""
        [alembic]
        script_location = %(here)s/migrations
        path_separator = newline
        version_locations =
            %(here)s/migrations/versions
            {migrations.versions_location()}
    """)
    )
    x = ["-x", f"url={url}", "-x", f"delayq_prefix={prefix}"]
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    alembic_cli(*x, "downgrade", "base", cwd=tmp_path)
    try:
        alembic_cli(*x, "upgrade", "heads", cwd=tmp_path)
        assert table_exists(engine, f"{prefix}messages") and table_exists(engine, "app_orders")
        assert schema_diff(engine, prefix) == []
        alembic_cli(*x, "revision", "--autogenerate", "--head", "app@head", "-m", "check", cwd=tmp_path)
        [generated] = [p for p in (tmp_path / "migrations" / "versions").glob("*.py") if p.name != "app_0001.py"]
        body = generated.read_text()
        # Nothing for delayq's tables (nor the app's). The shared servers hold other tests' tables,
        # which autogenerate rightly proposes to drop; the SQLite file holds only this app's.
        assert prefix not in body and "app_orders" not in body, body
        if name == "sqlite":
            assert "op." not in body, body
        generated.unlink()
    finally:
        alembic_cli(*x, "downgrade", "base", cwd=tmp_path)
        engine.dispose()


@pytest.mark.slow
def test_delayq_migrate_and_demo_after_a_pip_install_into_a_fresh_venv(
    backend_urls: dict[str, str], tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, f"{REPO_ROOT}[postgres,mysql]"], check=True, capture_output=True)
    delayq_cli = str(venv / "bin" / "delayq")
    for name in BACKENDS:
        url = backend_urls[name] if name != "sqlite" else f"sqlite:///{tmp_path / 'fresh.db'}"
        env = {**os.environ, "DELAYQ_URL": url}
        done = subprocess.run(
            [delayq_cli, "--prefix", "pip_", "migrate"], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        try:
            assert schema_diff(engine, "pip_") == []
        finally:
            migrations.downgrade(url, prefix="pip_")
            engine.dispose()
    # The demo, as a newcomer runs it after `pip install .`: no URL, the embedded default.
    env = {k: v for k, v in os.environ.items() if k != "DELAYQ_URL"}
    demo_dir = tmp_path / "newcomer"
    demo_dir.mkdir()
    demo = subprocess.run(
        [delayq_cli, "demo", "--seconds", "6"], cwd=demo_dir, env=env, capture_output=True, text=True, timeout=60
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert (demo_dir / "delayq.db").exists()
    for look, expected in ((["stats"], "demo-emails"), (["ls", "demo-emails", "--state", "dead"], "email-7")):
        shown = subprocess.run([delayq_cli, *look], cwd=demo_dir, env=env, capture_output=True, text=True)
        assert shown.returncode == 0 and expected in shown.stdout, shown.stdout + shown.stderr


DOC_ENV = """
import datetime as dt
import os

import sqlalchemy as sa
from alembic import context

app_metadata = sa.MetaData()
sa.Table("orders", app_metadata, sa.Column("id", sa.Integer, primary_key=True))

engine = sa.create_engine(os.environ["DATABASE_URL"], poolclass=sa.pool.NullPool)
with engine.connect() as conn:
{documented}
    with context.begin_transaction():
        context.run_migrations()
"""


def documented_embedding() -> tuple[str, str, list[list[str]]]:
    """docs/migrations.md's section on embedding: its alembic.ini, its env.py lines, its command blocks."""
    doc = (REPO_ROOT / "docs" / "migrations.md").read_text()
    section = doc.split("## Inside your application's Alembic", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    [ini] = [body for lang, body in blocks if lang == "ini"]
    [env] = [body for lang, body in blocks if lang == "python"]
    commands = [[line for line in body.splitlines() if line.strip()] for lang, body in blocks if lang == "bash"]
    return ini, env, commands


@pytest.mark.slow  # (subprocesses: the full profile; the fast one stays under 8 minutes)
def test_the_documented_embedding_commands_run_as_written(tmp_path: Path) -> None:
    """On a fresh database, and switching a standalone one (``delayq migrate``) to the app's environment."""
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "alembic").exists() or not (bin_dir / "delayq").exists():
        pytest.skip(f"no alembic or delayq script next to {sys.executable}")
    ini, env, (first_steps, stamp_steps) = documented_embedding()
    assert first_steps[0].startswith("alembic upgrade heads")  # before any autogenerate, on a fresh database
    assert [c.split("#")[0].split()[:2] for c in stamp_steps] == [
        ["delayq", "migrate"],
        ["alembic", "stamp"],
        ["alembic", "upgrade"],
    ]
    app = tmp_path / "app"
    (app / "migrations" / "versions").mkdir(parents=True)
    assert "/site-packages/delayq/_alembic/versions" in ini
    (app / "alembic.ini").write_text(
        ini.replace("/site-packages/delayq/_alembic/versions", migrations.versions_location())
    )
    (app / "migrations" / "env.py").write_text(DOC_ENV.format(documented=textwrap.indent(env, "    ")))
    (app / "migrations" / "script.py.mako").write_text((REPO_ROOT / "alembic" / "script.py.mako").read_text())

    def run(commands: list[str], url: str) -> None:
        env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "DATABASE_URL": url}
        env.pop("DELAYQ_URL", None)
        for command in commands:
            done = subprocess.run(command, shell=True, cwd=app, env=env, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, f"{command}\n{done.stdout}{done.stderr}"

    def tables(url: str) -> set[str]:
        engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        try:
            return set(sa.inspect(engine).get_table_names())
        finally:
            engine.dispose()

    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    run(first_steps, fresh)
    revisions = {p.read_text() for p in (app / "migrations" / "versions").glob("*.py")}
    [first] = [r for r in revisions if "create_table('orders'" in r or 'create_table("orders"' in r]
    assert "branch_labels = ('app',)" in first or 'branch_labels = ("app",)' in first
    assert all("delayq_" not in r for r in revisions)  # autogenerate left delayq's tables alone
    assert {"orders", "delayq_messages", "alembic_version"} <= tables(fresh)
    assert "delayq_alembic_version" not in tables(fresh)  # the app's environment, not delayq's own

    standalone = f"sqlite:///{tmp_path / 'standalone.db'}"
    run(stamp_steps, standalone)  # delayq migrate, stamp, upgrade heads: no "table already exists"
    assert {"orders", "delayq_messages", "delayq_alembic_version", "alembic_version"} <= tables(standalone)


def test_delayq_0005_keeps_the_rows_and_makes_trailing_spaces_count(backend: Backend) -> None:
    # Keys that differ by trailing spaces only: one key on MariaDB before delayq_0005 (utf8mb4_bin
    # pads with spaces), two after it, as on every other backend; down again once they are one. Below
    # head delayq refuses to run (the revision check), so the old schema is written to directly.
    from delayq import DelayedQueue, OfferOutcome

    prefix = "mig5_"
    m = make_tables(prefix).messages
    copied = [
        c.name for c in m.c if c.name not in ("id", "key", "priority", "group_key", "tags", "unique_for_ms")
    ]  # (added later)

    def copy_as(key: str) -> None:  # "job" again under another key, in one INSERT … SELECT
        rows = sa.select(sa.literal(key), *(m.c[c] for c in copied)).where(m.c.queue == "q", m.c.key == "job")
        with backend.engine.begin() as conn:
            conn.execute(sa.insert(m).from_select(["key", *copied], rows))

    def payloads() -> list[bytes]:
        with backend.engine.connect() as conn:
            return list(conn.execute(sa.select(m.c.payload).where(m.c.queue == "q").order_by(m.c.key)).scalars())

    migrations.downgrade(backend.url, prefix=prefix)
    migrations.upgrade(backend.url, "delayq_0004", prefix=prefix)
    try:
        migrations.upgrade(backend.url, prefix=prefix)
        queue = DelayedQueue(backend.engine, "q", table_prefix=prefix)
        assert queue.offer("job", 1) is OfferOutcome.CREATED
        migrations.downgrade(backend.url, "delayq_0004", prefix=prefix)
        padded = backend.name == "mysql"
        if padded:  # the old collation: "job " is "job"
            with pytest.raises(sa.exc.IntegrityError):
                copy_as("job ")
        else:
            copy_as("job ")
        migrations.upgrade(backend.url, prefix=prefix)
        assert schema_diff(backend.engine, prefix) == []
        assert queue.offer("job ", 2) is (OfferOutcome.CREATED if padded else OfferOutcome.IGNORED)
        assert [x.payload for k in ("job", "job ") if (x := queue.get(k)) is not None] == [1, 2 if padded else 1]
        assert queue.cancel("job ")
        migrations.downgrade(backend.url, "delayq_0004", prefix=prefix)
        assert len(payloads()) == 1
    finally:
        migrations.downgrade(backend.url, prefix=prefix)


def test_delayq_0006_gives_existing_messages_priority_0_and_goes_down_again(backend: Backend) -> None:
    # Messages of delayq_0005 keep coming in due order after the upgrade (priority 0, no flow row); down again,
    # the priority column, its index and the flow table are gone and the rows stay.
    from delayq import DelayedQueue

    prefix = "mig6_"
    m = make_tables(prefix).messages
    old = [c.name for c in m.c if c.name not in ("id", "priority", "group_key")]
    migrations.downgrade(backend.url, prefix=prefix)
    migrations.upgrade(backend.url, "delayq_0005", prefix=prefix)
    try:
        with backend.engine.begin() as conn:  # below head delayq refuses to run: the old schema, written directly
            for i, key in enumerate(["b", "a"]):
                row = {"queue": "q", "key": key, "payload": b"1", "payload_type": "json", "scheduled_at": i}
                row |= {"scheduled_at_initially": i, "created_at": i, "attempts": 0}
                conn.execute(sa.insert(m).values({k: v for k, v in row.items() if k in old}))
        migrations.upgrade(backend.url, prefix=prefix)
        assert schema_diff(backend.engine, prefix) == []
        queue = DelayedQueue(backend.engine, "q", table_prefix=prefix)
        assert queue.flow().priorities is False
        queue.offer("c", 1, priority=1)
        assert [d.key for d in queue.try_poll_many(10)] == ["c", "b", "a"]
        migrations.downgrade(backend.url, "delayq_0005", prefix=prefix)
        with backend.engine.connect() as conn:
            names = {c["name"] for c in sa.inspect(conn).get_columns(f"{prefix}messages")}
            assert "priority" not in names and "group_key" not in names
            assert not sa.inspect(conn).has_table(f"{prefix}queue_flow")
            assert conn.execute(sa.text(f"SELECT count(*) FROM {prefix}messages")).scalar_one() == 3
    finally:
        migrations.downgrade(backend.url, prefix=prefix)


def test_delayq_0010_keeps_the_keys_collates_them_c_on_postgresql_and_goes_down_again(backend: Backend) -> None:
    # Keys offered at delayq_0007 stay found, unique and selectable by prefix after the upgrade; on PostgreSQL the
    # key columns are in "C" (byte order: "B" < "a"), elsewhere unchanged; down again, the registry table goes and
    # the database's collation is back.
    from delayq import DelayedQueue

    prefix = "mig10_"
    m = make_tables(prefix).messages
    migrations.downgrade(backend.url, prefix=prefix)
    migrations.upgrade(backend.url, "delayq_0007", prefix=prefix)

    def collations() -> set[str | None]:
        if backend.name != "postgresql":
            return set()
        with backend.engine.connect() as conn:
            return set(
                conn.execute(
                    sa.text(
                        "SELECT collation_name FROM information_schema.columns WHERE column_name = 'key' "
                        "AND table_name IN (:m, :d, :f)"
                    ),
                    {"m": f"{prefix}messages", "d": f"{prefix}dead_letters", "f": f"{prefix}finished"},
                ).scalars()
            )

    try:
        with backend.engine.begin() as conn:  # below head delayq refuses to run: the old schema, written directly
            for key in ["order/a", "order/B", "other"]:
                row = {"queue": "q", "key": key, "payload": b"1", "payload_type": "json", "scheduled_at": 0}
                conn.execute(sa.insert(m).values(row | {"scheduled_at_initially": 0, "created_at": 0}))
        assert collations() == ({None} if backend.name == "postgresql" else set())
        migrations.upgrade(backend.url, prefix=prefix)
        assert schema_diff(backend.engine, prefix) == []
        assert collations() == ({"C"} if backend.name == "postgresql" else set())
        queue = DelayedQueue(backend.engine, "q", table_prefix=prefix)
        assert queue.get("order/B") is not None and queue.offer("order/a", 2).name == "IGNORED"
        with backend.engine.connect() as conn:
            from delayq.browse import keys_under

            assert keys_under(conn, make_tables(prefix), "q", "order/") == ["order/B", "order/a"]
        assert queue.cancel_prefix("order/") == 2
        migrations.downgrade(backend.url, "delayq_0007", prefix=prefix)
        assert collations() == ({None} if backend.name == "postgresql" else set())
        with backend.engine.connect() as conn:
            assert not sa.inspect(conn).has_table(f"{prefix}workers")
            assert conn.execute(sa.select(m.c.key)).scalars().all() == ["other"]
    finally:
        migrations.downgrade(backend.url, prefix=prefix)


def test_delayq_0007_upgrades_live_in_flight_and_dead_messages_without_losing_or_rerunning_any(
    backend: Backend,
) -> None:
    # At delayq_0006: a ready message, one in flight (its lock unexpired), a dead letter. `delayq migrate`
    # takes them to 0007: the in-flight one is not delivered again and its holder's ack (the token it
    # holds) completes it; the ready one is delivered once; the dead letter is kept (no expiry). Down
    # again, the rows stay and the new tables and columns are gone.
    from click.testing import CliRunner

    from delayq import DelayedQueue, Delivery
    from delayq.cli import main

    prefix = "mig7_"
    t = make_tables(prefix)
    new_columns = {"tags", "unique_for_ms", "expires_at"}
    migrations.downgrade(backend.url, prefix=prefix)
    migrations.upgrade(backend.url, "delayq_0006", prefix=prefix)
    far = 4_102_444_800_000  # 2100: the in-flight message's lock expiry
    try:
        with backend.engine.begin() as conn:  # below head delayq refuses to run: the old schema, written directly
            base = {"queue": "q", "payload": b"1", "payload_type": "json", "scheduled_at_initially": 0, "created_at": 0}
            conn.execute(sa.insert(t.messages).values(key="ready", scheduled_at=0, attempts=0, **base))
            conn.execute(
                sa.insert(t.messages).values(key="held", scheduled_at=far, attempts=1, lock_token="tok-held", **base)
            )
            dead = {k: v for k, v in base.items() if k != "scheduled_at"}
            conn.execute(
                sa.insert(t.dead_letters).values(key="dead", attempts=3, last_error="boom", failed_at=5, **dead)
            )
            held_id = conn.execute(sa.select(t.messages.c.id).where(t.messages.c.key == "held")).scalar_one()
        out = CliRunner().invoke(main, ["--url", backend.url, "--prefix", prefix, "migrate"], catch_exceptions=False)
        assert out.exit_code == 0, out.output
        assert schema_diff(backend.engine, prefix) == []
        queue = DelayedQueue(backend.engine, "q", table_prefix=prefix, retention=dt.timedelta(hours=1))
        assert queue.stats().dead == 1 and queue.stats().in_flight == 1
        [ready] = queue.try_poll_many(10)  # the held one is not delivered again
        assert (ready.key, ready.attempts) == ("ready", 1)
        at = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
        held = Delivery(held_id, "held", 1, 1, at, at, at, at, "tok-held", queue)
        assert queue.ack_many([held, ready]) == 2
        done = queue.get("held")
        assert done is not None and (done.state, done.attempts) == ("completed", 1)
        with backend.engine.connect() as conn:
            assert conn.execute(sa.select(t.dead_letters.c.expires_at)).scalars().all() == [None]
        assert queue.requeue_dead("dead")
        migrations.downgrade(backend.url, "delayq_0006", prefix=prefix)
        with backend.engine.connect() as conn:
            names = {c["name"] for c in sa.inspect(conn).get_columns(f"{prefix}messages")}
            names |= {c["name"] for c in sa.inspect(conn).get_columns(f"{prefix}dead_letters")}
            assert not names & new_columns
            assert not sa.inspect(conn).has_table(f"{prefix}finished")
            assert not sa.inspect(conn).has_table(f"{prefix}chores")
            assert conn.execute(sa.text(f"SELECT count(*) FROM {prefix}messages")).scalar_one() == 1  # requeued
    finally:
        migrations.downgrade(backend.url, prefix=prefix)


def test_delayq_0008_keeps_the_topic_deliveries_in_flight_and_goes_down_again(backend: Backend) -> None:
    # Delivery states of delayq_0006 (a message in flight, one acked out of order) keep their meaning after
    # the upgrade: the in-flight one comes back after its visibility timeout at attempt 2, the acked one
    # is not delivered again. Down again, a message in a range (no row since delayq_0008) gets its row.
    from conftest import START

    from delayq import ManualClock, Subscription, Topic

    prefix = "mig8_"
    t = make_tables(prefix).topics
    now = int(START.timestamp() * 1000)
    migrations.downgrade(backend.url, prefix=prefix)
    migrations.upgrade(backend.url, "delayq_0006", prefix=prefix)
    try:
        with backend.engine.begin() as conn:  # below head delayq refuses to run: the old schema, written directly
            for name in ("orders", "orders_dlq"):
                conn.execute(sa.insert(t.topics).values(topic=name, partitions=1, created_at=now))
                head = 3 if name == "orders" else 0
                conn.execute(sa.insert(t.heads).values(topic=name, partition=0, head=head, collected=0))
            conn.execute(
                sa.insert(t.log),
                [
                    {"topic": "orders", "partition": 0, "message_offset": o, "partition_key": "k"}
                    | {"message_id": f"m{o}", "payload": b"1", "payload_type": "json", "published_at": now}
                    for o in (1, 2, 3)
                ],
            )
            g = {"consumer_group": "g", "topic": "orders", "partition": 0}
            conn.execute(sa.insert(t.leases).values(**g, holder=None, epoch=0, acquired_at=0, expires_at=0))
            conn.execute(sa.insert(t.offsets).values(**g, acked_offset=0, updated_at=now))
            conn.execute(
                sa.insert(t.deliveries),
                [
                    {**g, "message_offset": 1, "status": 0, "invisible_until": now + 60_000, "attempts": 1},
                    {**g, "message_offset": 2, "status": 1, "invisible_until": now, "attempts": 1},
                ],
            )
        migrations.upgrade(backend.url, prefix=prefix)
        assert schema_diff(backend.engine, prefix) == []
        clock = ManualClock(START)
        sub = Subscription(backend.engine, "orders", "g", "s", clock=clock, table_prefix=prefix)
        sub.rebalance()
        (third,) = sub.poll(10)  # 1 in flight, 2 acked
        assert (third.message_id, third.attempts) == ("m3", 1)
        clock.advance(dt.timedelta(seconds=61))
        (first,) = sub.poll(10)
        assert (first.message_id, first.attempts) == ("m1", 2)
        assert sub.ack_many([third, first]) == [True, True]
        assert sub.advance_watermarks() == {0: 3}
        Topic(backend.engine, "orders", clock=clock, table_prefix=prefix).publish("k", "m4", 4)
        (fourth,) = sub.poll(10)
        migrations.downgrade(backend.url, "delayq_0006", prefix=prefix)
        with backend.engine.connect() as conn:
            rows = conn.execute(sa.select(t.deliveries.c.message_offset, t.deliveries.c.attempts)).all()
        assert [tuple(r) for r in rows] == [(fourth.offset, 1)]
    finally:
        migrations.downgrade(backend.url, prefix=prefix)
