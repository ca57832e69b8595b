"""``delayq web``: the web dashboard (``delayq.web``), served by uvicorn (the ``delayq[web]`` extra)."""

from __future__ import annotations

import ipaddress

import click

from delayq import engines
from delayq.cli._common import Fail, connect, friendly
from delayq.cli._root import main
from delayq.errors import install_hint


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (this machine only by default).")
@click.option("--port", default=8042, show_default=True, type=click.IntRange(0, 65535))
@click.option(
    "--allow-actions", is_flag=True, help="Allow actions (run now, cancel, requeue, pause, ...); else read-only."
)
@click.option(
    "--basic-auth",
    envvar="DELAYQ_WEB_BASIC_AUTH",
    metavar="USER:PASSWORD",
    help="Ask every request for this user and password (or DELAYQ_WEB_BASIC_AUTH; prefer the variable).",
)
@click.option(
    "--refresh", default=2.0, show_default=True, type=click.FloatRange(min=0.5), help="Seconds between live updates."
)
@click.pass_context
@friendly
def web(ctx: click.Context, host: str, port: int, allow_actions: bool, basic_auth: str | None, refresh: float) -> None:
    """Serve the web dashboard: queues, messages, dead letters, cron schedules, topics (Ctrl-C ends).

    It binds 127.0.0.1 unless --host says otherwise; anywhere else, protect it with --basic-auth behind
    TLS (a reverse proxy) or a network you trust. Read-only unless --allow-actions.
    """
    try:
        import uvicorn

        from delayq.web import BasicAuth, app
    except ImportError:
        raise Fail(f"delayq web needs starlette, jinja2 and uvicorn: {install_hint('web')}") from None
    if basic_auth is not None and (":" not in basic_auth or basic_auth.startswith(":")):
        raise Fail("--basic-auth takes USER:PASSWORD")
    with connect(ctx):
        pass  # the tables are there (and a SQLite file is never created)
    engine = engines.create_engine(ctx.obj["url"])
    asgi = app(engine, actions=allow_actions, table_prefix=ctx.obj["prefix"], refresh=refresh)
    if basic_auth is not None:
        asgi = BasicAuth(asgi, basic_auth)
    reach = "this machine only" if _loopback(host) else "every network this host is on"
    mode = "actions allowed" if allow_actions else "read-only"
    auth = "basic auth" if basic_auth else "no authentication"
    click.echo(f"delayq web: http://{host}:{port}/ ({reach}; {mode}; {auth}). Ctrl-C ends.")
    if not _loopback(host) and basic_auth is None:
        click.echo("warning: reachable from other machines without authentication: add --basic-auth", err=True)
    try:
        uvicorn.run(asgi, host=host, port=port, log_level="warning")
    finally:
        engine.dispose()
