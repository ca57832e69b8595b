"""``delayq topics``: the topics and how far each consumer group has read them."""

from __future__ import annotations

import dataclasses
import datetime as dt

import click
import sqlalchemy as sa

from delayq.cli import Fail, connect, emit, friendly, relative
from delayq.schema import make_tables
from delayq.topics.views import group_lag, list_topics


@click.group()
def topics() -> None:
    """Look at topics and consumer groups."""


def _checked(ctx: click.Context, conn: sa.Connection) -> None:
    name = make_tables(ctx.obj["prefix"]).topics.topics.name
    if not sa.inspect(conn).has_table(name):
        raise Fail(f"the topic tables ({name}, ...) are not in this database: run `delayq migrate` with the same --url")


@topics.command(name="ls")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
@friendly
def topics_ls(ctx: click.Context, as_json: bool) -> None:
    """Every topic: partitions, messages published (the sum of head offsets) and still in the log."""
    with connect(ctx) as (engine, conn):
        _checked(ctx, conn)
        found = list_topics(engine, table_prefix=ctx.obj["prefix"])
    emit([dataclasses.asdict(t) for t in found], as_json, ["topic", "partitions", "published", "retained"])


@topics.command(name="lag")
@click.argument("topic")
@click.argument("group")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
@friendly
def topics_lag(ctx: click.Context, topic: str, group: str, as_json: bool) -> None:
    """Per partition of TOPIC as GROUP reads it: head, watermark, lag, deliveries in flight, and the lease."""
    with connect(ctx) as (engine, conn):
        _checked(ctx, conn)
        known = {t.topic for t in list_topics(engine, table_prefix=ctx.obj["prefix"])}
        if topic not in known:
            raise Fail(f"no topic named {topic!r} (topics: {', '.join(sorted(known)) or 'none yet'})")
        lag = group_lag(engine, topic, group, table_prefix=ctx.obj["prefix"])
    if not lag:
        raise Fail(f"group {group!r} has not joined topic {topic!r}")
    now = dt.datetime.now(dt.UTC)
    rows = [
        {
            "partition": p.partition,
            "head": p.head,
            "watermark": p.watermark,
            "lag": p.lag,
            "in_flight": p.pending,
            "leased_by": p.holder,
            "epoch": p.epoch,
            "lease_expires": p.lease_expires_at if as_json else relative(p.lease_expires_at, now),
        }
        for p in lag
    ]
    emit(rows, as_json, ["partition", "head", "watermark", "lag", "in_flight", "leased_by", "epoch", "lease_expires"])
