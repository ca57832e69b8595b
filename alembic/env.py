"""delayq's own Alembic environment (standalone use; see delayq.migrations for embedding)."""

from __future__ import annotations

import asyncio
import logging.config
import os

import sqlalchemy as sa

from alembic import context
from delayq.engines import driver_url
from delayq.migrations import migration_options, version_table
from delayq.schema import make_tables

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    logging.config.fileConfig(config.config_file_name, disable_existing_loggers=False)

prefix, schema = migration_options()
target_metadata = make_tables(prefix, schema).metadata


def _run(connection: sa.Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        version_table=version_table(prefix),
        version_table_schema=schema,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def run() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = (
        config.attributes.get("url")
        or context.get_x_argument(as_dictionary=True).get("url")
        or os.environ.get("DELAYQ_URL")
        or config.get_main_option("sqlalchemy.url")
    )
    if not url:
        raise SystemExit("no database URL: pass -x url=... or set DELAYQ_URL")
    url = driver_url(url)  # (postgres://, as Heroku's DATABASE_URL has it: delayq's driver)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    if engine.dialect.is_async:  # an asyncio driver's URL (postgresql+asyncpg://...): through run_sync
        engine.dispose()
        asyncio.run(_run_async(url))
        return
    with engine.connect() as conn:
        _run(conn)
    engine.dispose()


async def _run_async(url: str) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(url, poolclass=sa.pool.NullPool)
    try:
        async with engine.connect() as conn:
            await conn.run_sync(_run)
    finally:
        await engine.dispose()


if context.is_offline_mode():
    raise SystemExit("delayq's migrations run online only (they need the backend to pick column types)")
run()
