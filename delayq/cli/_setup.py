"""Setting up: ``delayq migrate`` creates or upgrades the tables; ``delayq demo`` shows a worker at work."""

from __future__ import annotations

import click

from delayq import migrations
from delayq.cli._common import check_url, friendly
from delayq.cli._root import main, shown_url


@main.command()
@click.option("--revision", default="heads", show_default=True, help="Alembic revision to upgrade to.")
@click.option("--schema", default=None, help="Database schema of the tables.")
@click.pass_context
@friendly
def migrate(ctx: click.Context, revision: str, schema: str | None) -> None:
    """Create or upgrade delayq's tables (Alembic's upgrade on delayq's packaged migrations)."""
    url = ctx.obj["url"]
    check_url(url)
    shown = shown_url(url)
    migrations.upgrade(url, revision, prefix=ctx.obj["prefix"], schema=schema)
    click.echo(f"delayq tables are at {revision} in {shown}")


@main.command()
@click.option(
    "--seconds",
    default=6.0,
    show_default=True,
    type=click.FloatRange(min=0, max=3600),
    help="The worker runs at least this long, then until every email is sent or dead (at most 60 s more).",
)
@click.pass_context
@friendly
def demo(ctx: click.Context, seconds: float) -> None:
    """A tour on the embedded default: offers, retries, a dead letter, a cron schedule, a worker."""
    from delayq.demo import run_demo

    run_demo(ctx.obj["url"], seconds)
