"""``delayq topics``: the topics, how far each consumer group has read them, and their dead letters."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import uuid
from collections.abc import Callable

import click
import sqlalchemy as sa

from delayq.browse import database_now
from delayq.cli._common import Fail, connect, emit, friendly, read_payload, relative
from delayq.cli._root import parse_duration
from delayq.humanize import human
from delayq.schema import make_tables
from delayq.topics import _gc
from delayq.topics._context import TopicContext
from delayq.topics.names import check_topic, partition_for
from delayq.topics.topic import Topic
from delayq.topics.views import group_lag, list_groups, list_topics


@click.group()
def topics() -> None:
    """Look at topics and consumer groups; act on dead letters."""


def _checked(ctx: click.Context, conn: sa.Connection) -> None:
    name = make_tables(ctx.obj["prefix"]).topics.topics.name
    if not sa.inspect(conn).has_table(name):
        raise Fail(f"the topic tables ({name}, ...) are not in this database: run `delayq migrate` with the same --url")


def _existing(ctx: click.Context, engine: sa.Engine, conn: sa.Connection, topic: str) -> None:
    _checked(ctx, conn)
    known = {t.topic for t in list_topics(engine, table_prefix=ctx.obj["prefix"])}
    if topic not in known:
        raise Fail(f"no topic named {topic!r} (topics: {', '.join(sorted(known)) or 'none yet'})")


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


@topics.command(name="create")
@click.argument("topic")
@click.option("--partitions", required=True, type=int, help="How many partitions (fixed once created).")
@click.pass_context
@friendly
def topics_create(ctx: click.Context, topic: str, partitions: int) -> None:
    """Create TOPIC (and its dead-letter topic TOPIC_dlq) with --partitions N, unless it exists with N already
    (another count is refused)."""
    check_topic(topic)
    with connect(ctx) as (engine, conn):
        _checked(ctx, conn)
        existed = topic in {t.topic for t in list_topics(engine, table_prefix=ctx.obj["prefix"])}
        conn.rollback()  # hold nothing while the topic works on its own connection
        n = _topic(engine, ctx, topic).create(partitions)
    click.echo(f"{topic}: {'exists' if existed else 'created'} with {n} partition{'s' * (n != 1)}")


@topics.command(name="publish")
@click.argument("topic")
@click.argument("key")
@click.argument("payload")
@click.option("--id", "message_id", help="The message's id (publishing it again is ignored); a new UUID by default.")
@click.pass_context
@friendly
def topics_publish(ctx: click.Context, topic: str, key: str, payload: str, message_id: str | None) -> None:
    """Publish a message to TOPIC under partition KEY: PAYLOAD is JSON (a string needs its quotes:
    '"hello"'), @FILE for a file's, - for stdin's. Prints its partition, id and outcome."""
    text, where = read_payload(payload)
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise Fail(f"{where} is not JSON ({exc}): write a string with its quotes, e.g. '\"hello\"'") from None
    mid = message_id if message_id is not None else uuid.uuid4().hex
    with connect(ctx) as (engine, conn):
        _existing(ctx, engine, conn, topic)
        conn.rollback()
        t = _topic(engine, ctx, topic)
        outcome = t.publish(key, mid, value)
        partition = partition_for(key, t.partitions())
    click.echo(f"{topic}[{partition}] {key} {mid}: {outcome.value}")


@topics.command(name="gc")
@click.argument("names", metavar="[TOPIC]...", nargs=-1)
@click.option("--keep-for", "keep_text", help="Keep messages younger than this, e.g. 1h, 7d (default: 0).")
@click.option("--batch", default=_gc.BATCH, show_default=True, type=int, help="Messages per transaction at most.")
@click.option("--max-batches", type=int, help="Stop after this many transactions per topic (default: until done).")
@click.pass_context
@friendly
def topics_gc(
    ctx: click.Context, names: tuple[str, ...], keep_text: str | None, batch: int, max_batches: int | None
) -> None:
    """Delete the messages of each TOPIC (default: every topic) that all its consumer groups are done with,
    in transactions of --batch messages; a topic no group reads is kept whole. Safe beside running workers
    (they collect too: each partition is collected by one at a time)."""
    keep_for = parse_duration(keep_text) if keep_text is not None else dt.timedelta(0)
    _gc.check_retention(keep_for, batch)
    if max_batches is not None and max_batches < 1:
        raise Fail(f"--max-batches must be at least 1, got {max_batches}")
    with connect(ctx) as (engine, conn):
        _checked(ctx, conn)
        known = sorted(t.topic for t in list_topics(engine, table_prefix=ctx.obj["prefix"]))
        unknown = [n for n in names if n not in known]
        if unknown:
            raise Fail(f"no topic named {unknown[0]!r} (topics: {', '.join(known) or 'none yet'})")
        conn.rollback()
        # (not through ``Topic``: a dead-letter topic's name may be longer than a topic's own)
        where = TopicContext(engine, clock=None, table_prefix=ctx.obj["prefix"])
        for name in names or known:
            done = _gc.collect(where, name, keep_for=keep_for, batch=batch, max_batches=max_batches)
            passed = f" ({done.skipped} partition(s) held by another collector or a publisher: later)" * bool(
                done.skipped
            )
            click.echo(f"{name}: {done.deleted} message(s) collected{passed}")


@topics.command(name="lag")
@click.argument("topic")
@click.argument("group")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
@friendly
def topics_lag(ctx: click.Context, topic: str, group: str, as_json: bool) -> None:
    """Per partition of TOPIC as GROUP reads it: head, watermark, lag, deliveries in flight, and the lease
    (its holder, epoch, age and expiry, on the database's clock; in JSON the age in milliseconds)."""
    with connect(ctx) as (engine, conn):
        _existing(ctx, engine, conn, topic)
        lag = group_lag(engine, topic, group, table_prefix=ctx.obj["prefix"])
        now = database_now(conn)
    if not lag:
        raise Fail(f"group {group!r} has not joined topic {topic!r}")
    rows = [
        {
            "partition": p.partition,
            "head": p.head,
            "watermark": p.watermark,
            "lag": p.lag,
            "in_flight": p.pending,
            "leased_by": p.holder,
            "epoch": p.epoch,
        }
        | (
            {
                "lease_age_ms": None if p.lease_age is None else p.lease_age // dt.timedelta(milliseconds=1),
                "lease_expires": p.lease_expires_at,
            }
            if as_json
            else {
                "lease_age": None if p.lease_age is None else human(p.lease_age),
                "lease_expires": relative(p.lease_expires_at, now),
            }
        )
        for p in lag
    ]
    columns = ["partition", "head", "watermark", "lag", "in_flight", "leased_by", "epoch", "lease_age", "lease_expires"]
    emit(rows, as_json, columns)


# -- consumer groups -------------------------------------------------------------------------------------
@topics.group(name="groups")
def topics_groups() -> None:
    """List a topic's consumer groups; drop one."""


@topics_groups.command(name="ls")
@click.argument("topic")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
@friendly
def groups_ls(ctx: click.Context, topic: str, as_json: bool) -> None:
    """TOPIC's consumer groups: partitions with a watermark, lag, deliveries in flight, live subscribers."""
    with connect(ctx) as (engine, conn):
        _existing(ctx, engine, conn, topic)
        found = list_groups(engine, topic, table_prefix=ctx.obj["prefix"])
    rows = [
        {"group": g.group, "partitions": g.partitions, "lag": g.lag, "in_flight": g.pending}
        | {"subscribers": g.subscribers}
        for g in found
    ]
    emit(rows, as_json, ["group", "partitions", "lag", "in_flight", "subscribers"])


@topics_groups.command(name="drop")
@click.argument("topic")
@click.argument("group")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--force", is_flag=True, help="Drop it even while subscribers hold its partitions.")
@click.pass_context
@friendly
def groups_drop(ctx: click.Context, topic: str, group: str, yes: bool, force: bool) -> None:
    """Drop GROUP from TOPIC: its watermarks, leases, delivery states and subscribers, in one transaction
    (asks first unless --yes; refused while a subscriber holds a partition, unless --force). Garbage
    collection stops waiting for it; its dead letters stay."""
    with connect(ctx) as (engine, conn):
        _existing(ctx, engine, conn, topic)
        conn.rollback()  # hold nothing while the topic works on its own connection
        if not yes:
            click.confirm(f"drop group {group!r} of topic {topic!r}?", abort=True)
        if not _topic(engine, ctx, topic).drop_group(group, force=force):
            raise Fail(f"group {group!r} does not read topic {topic!r}: nothing dropped")
    click.echo(f"{topic}: group {group!r} dropped")


# -- dead letters ----------------------------------------------------------------------------------------
@topics.group(name="dead")
def topics_dead() -> None:
    """List, requeue or purge a topic's dead letters (the topic TOPIC_dlq), per consumer group."""


def _topic(engine: sa.Engine, ctx: click.Context, name: str) -> Topic:
    return Topic(engine, name, table_prefix=ctx.obj["prefix"])


@topics_dead.command(name="ls")
@click.argument("topic")
@click.option("--group", help="Only this consumer group's dead letters.")
@click.option("--key", help="Only this partition key's.")
@click.option("--id", "message_id", help="Only the message published under this id.")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(min=1))
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
@friendly
def dead_ls(
    ctx: click.Context,
    topic: str,
    group: str | None,
    key: str | None,
    message_id: str | None,
    limit: int,
    as_json: bool,
) -> None:
    """TOPIC's dead letters, by partition and offset: the group that gave up, the message, why and when."""
    with connect(ctx) as (engine, conn):
        _existing(ctx, engine, conn, topic)
        now = database_now(conn)
        conn.rollback()
        found = _topic(engine, ctx, topic).dead_letters(group=group, key=key, message_id=message_id, limit=limit)
    if as_json:
        emit([d.as_dict() for d in found], True, [])
        return
    rows = [d.as_dict() | {"failed": relative(d.failed_at, now), "failures": d.failure_count} for d in found]
    columns = ["group", "partition", "offset", "partition_key", "message_id", "failed", "failures", "last_error"]
    emit(rows, False, [*columns, "payload"])


def _dead_command(verb: str) -> Callable[..., None]:
    @click.argument("topic")
    @click.option("--group", help="Only this consumer group's dead letters.")
    @click.option("--id", "message_id", help="The message published under this id.")
    @click.option("--key", help="The messages of this partition key.")
    @click.option("--all", "everything", is_flag=True, help="All of them (of --group, if given).")
    @click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
    @click.pass_context
    @friendly
    def command(
        ctx: click.Context,
        topic: str,
        group: str | None,
        message_id: str | None,
        key: str | None,
        everything: bool,
        yes: bool,
    ) -> None:
        if everything == (message_id is not None or key is not None):
            raise Fail("give --id ID and/or --key KEY, or --all (--group G narrows any of them)")
        with connect(ctx) as (engine, conn):
            _existing(ctx, engine, conn, topic)
            conn.rollback()  # hold nothing while the topic works on its own connections
            t = _topic(engine, ctx, topic)
            found = t.dead_letters(group=group, key=key, message_id=message_id, limit=10_000_000)
            whose = "" if group is None else f" of group {group!r}"
            if not found:
                raise Fail(f"no dead letters{whose} match in topic {topic!r}")
            if not yes:
                click.confirm(f"{verb} {len(found)} dead letter(s){whose} of topic {topic!r}?", abort=True)
            act = t.requeue_dead if verb == "requeue" else t.purge_dead
            done = act(group=group, key=key, message_id=message_id, everything=everything)
        note = ""
        if done < len(found):
            note = f"; {len(found) - done} not {verb}d (gone meanwhile, or their group no longer reads {topic!r})"
        click.echo(f"{topic}: {done} dead letter(s) {verb}d{note}")

    command.__doc__ = f"{verb.capitalize()} TOPIC's dead letters (asks first unless --yes)." + (
        " Each is published again on TOPIC, under the id ID~requeue-N, for the group that gave up on it"
        " only, and leaves the dead letters in the same transaction."
        if verb == "requeue"
        else ""
    )
    return command


topics_dead.command(name="requeue")(_dead_command("requeue"))
topics_dead.command(name="purge")(_dead_command("purge"))
