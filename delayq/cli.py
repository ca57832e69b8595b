"""The ``delayq`` command."""

from __future__ import annotations

import click
import sqlalchemy as sa

from delayq import migrations
from delayq.schema import DEFAULT_PREFIX

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
