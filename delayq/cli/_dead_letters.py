"""The dead letters: ``delayq dead requeue`` and ``delayq dead purge``."""

from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import click
import sqlalchemy as sa

from delayq import engines
from delayq.browse import State, list_messages
from delayq.cli import _bulk as bulk
from delayq.cli._common import Fail, audited, connect, friendly
from delayq.cli._root import _noted, admin_queue, main, unknown_queue_note
from delayq.schema import make_tables


@main.group()
def dead() -> None:
    """Act on dead letters."""


def _dead_keys(
    ctx: click.Context, conn: sa.Connection, queue: str, key: str | None, key_prefix: str | None, everything: bool
) -> list[str]:
    if sum((key is not None, key_prefix is not None, everything)) != 1:
        raise Fail("give exactly one of --key K, --key-prefix P or --all")
    found = list_messages(
        conn,
        make_tables(ctx.obj["prefix"]),
        queue,
        state=State.DEAD,
        now=dt.datetime.now(dt.UTC),
        key=key,
        key_prefix=key_prefix,
        limit=10_000_000,
    )
    return list(dict.fromkeys(m.key for m in found))


def _dead_command(verb: str) -> Callable[..., None]:
    @click.argument("queue")
    @click.option("--key", help="One key.")
    @click.option("--key-prefix", help="Keys that start with this.")
    @click.option("--all", "everything", is_flag=True, help="All of the queue's dead letters.")
    @click.option("--tag", help="Those that carry this tag (with --key-prefix: both).")
    @click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
    @click.pass_context
    @friendly
    def command(
        ctx: click.Context,
        queue: str,
        key: str | None,
        key_prefix: str | None,
        everything: bool,
        tag: str | None,
        yes: bool,
    ) -> None:
        if key is None and everything != (key_prefix is not None or tag is not None):  # in batches
            return bulk.dead_matching(ctx, queue, verb, key_prefix, tag, yes)
        if tag is not None:
            raise Fail("give exactly one of --key K, --key-prefix P / --tag T or --all")
        with connect(ctx) as (engine, conn):
            keys = _dead_keys(ctx, conn, queue, key, key_prefix, everything)
            if not keys:
                raise Fail(f"no dead letters match in queue {queue!r}{_noted(unknown_queue_note(ctx, conn, queue))}")
        if not yes:
            click.confirm(f"{verb} {len(keys)} dead letter key(s) of {queue!r}?", abort=True)
        engine = engines.create_engine(ctx.obj["url"], pool_size=1)
        q, done = admin_queue(engine, ctx, queue), 0
        try:
            with engines.read_bound(engine):
                if verb == "purge":  # one statement, whatever the number of keys
                    done = q.purge_dead(key=key, key_prefix=key_prefix, everything=everything)
                else:
                    with (
                        click.progressbar(keys, label=f"{verb}", file=sys.stderr, show_pos=True)
                        if len(keys) > 100
                        else _plain(keys) as bar
                    ):
                        for k in bar:
                            done += q.requeue_dead(k)
        finally:
            engine.dispose()
        click.echo(f"{queue}: {done} dead letter(s) {'requeued' if verb == 'requeue' else 'purged'}")
        audited(ctx, verb if key else f"{verb}-all", queue, done, key=key, prefix=key_prefix, all=everything or None)

    command.__doc__ = (
        f"{verb.capitalize()} dead letters (asks first unless --yes): one key's, or in batches those under a key "
        "prefix, with a tag, or all."
    )
    return command


@contextmanager
def _plain(keys: list[str]) -> Iterator[list[str]]:
    yield keys


dead.command(name="requeue")(_dead_command("requeue"))
dead.command(name="purge")(_dead_command("purge"))
