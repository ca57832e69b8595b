"""The ``delayq`` command."""

from __future__ import annotations

import datetime as dt
import importlib
import logging

import click
import sqlalchemy as sa

from delayq import migrations
from delayq.handler import Handler
from delayq.schema import DEFAULT_PREFIX
from delayq.worker import Worker

DEFAULT_URL = "sqlite:///delayq.db"


@click.group()
def main() -> None:
    """delayq: delayed messages and background jobs in your relational database."""


@main.command()
@click.option(
    "--url", envvar="DELAYQ_URL", default=DEFAULT_URL, show_default=True, help="Database URL (or DELAYQ_URL)."
)
@click.option("--revision", default="heads", show_default=True, help="Alembic revision to upgrade to.")
@click.option("--prefix", default=DEFAULT_PREFIX, show_default=True, help="Table name prefix.")
@click.option("--schema", default=None, help="Database schema of the tables.")
def migrate(url: str, revision: str, prefix: str, schema: str | None) -> None:
    """Create or upgrade delayq's tables (Alembic's upgrade on delayq's packaged migrations)."""
    try:
        parsed = sa.engine.make_url(url)
    except sa.exc.ArgumentError as exc:
        raise click.UsageError(f"bad database URL {url!r}: {exc}") from None
    try:
        migrations.upgrade(url, revision, prefix=prefix, schema=schema)
    except sa.exc.OperationalError as exc:
        raise click.ClickException(f"cannot reach {parsed.render_as_string()}: {exc.orig}") from None
    click.echo(f"delayq tables are at {revision} in {parsed.render_as_string()}")


def load_handlers(spec: str) -> list[Handler | type[Handler]]:
    """Import ``module:attr`` where attr is a Handler class, an instance, or a list of them."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise click.BadParameter(f"expected module:attr, got {spec!r}")
    try:
        target = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise click.BadParameter(f"cannot load {spec!r}: {exc}") from None
    items = list(target) if isinstance(target, list | tuple) else [target]
    for item in items:
        if not (isinstance(item, Handler) or (isinstance(item, type) and issubclass(item, Handler))):
            raise click.BadParameter(f"{spec!r} holds {item!r}, not a Handler class or instance")
    return items


@main.command()
@click.argument("handlers")
@click.option(
    "--url", envvar="DELAYQ_URL", default=DEFAULT_URL, show_default=True, help="Database URL (or DELAYQ_URL)."
)
@click.option("--concurrency", default=4, show_default=True, type=click.IntRange(min=1), help="Handlers at once.")
@click.option(
    "--shutdown-timeout",
    default=30.0,
    show_default=True,
    type=float,
    help="Seconds in-flight handlers may run on after SIGINT/SIGTERM.",
)
@click.option("--log-level", default="INFO", show_default=True)
def worker(handlers: str, url: str, concurrency: int, shutdown_timeout: float, log_level: str) -> None:
    """Run the handlers HANDLERS (module:attr) until SIGINT or SIGTERM."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    loaded = load_handlers(handlers)
    engine = sa.create_engine(url)
    Worker(engine, loaded, concurrency=concurrency, shutdown_timeout=dt.timedelta(seconds=shutdown_timeout)).run()
    engine.dispose()


if __name__ == "__main__":
    main()
