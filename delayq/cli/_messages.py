"""The operator's commands on queued messages: enqueue, ls, search, show, reschedule, run-now, cancel."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Iterator
from typing import Any

import click
import sqlalchemy as sa

from delayq.browse import (
    STATE_NAMES,
    State,
    StoredMessage,
    database_now,
    list_messages,
    search_messages,
)
from delayq.cli import _bulk as bulk
from delayq.cli._common import (
    STATE_COLOURS,
    Fail,
    _cell,
    audited,
    connect,
    emit,
    friendly,
    json_value,
    read_payload,
    relative,
)
from delayq.cli._root import _noted, admin_queue, main, parse_duration, parse_time, unknown_queue_note
from delayq.humanize import human, shorten
from delayq.messages import CancelOutcome
from delayq.queue import DelayedQueue, check_prefix, check_queue_name
from delayq.schema import make_tables

CANCELLED = ("ready", "scheduled", "in-flight", "expired-lock", "all")
"""What ``cancel --state`` takes: a live message's states (all: every one not running)."""
RESCHEDULED = ("ready", "scheduled", "expired-lock", "all")
"""What ``reschedule --state`` takes: the states of a message not running."""
PAYLOAD_SHOWN = 200
"""Characters of a payload (as JSON) that listings show; ``show`` and ``ls --full`` show it whole."""


def _filters(command: Callable[..., None]) -> Callable[..., None]:
    """The options ``ls`` and ``search`` share: a state of ``STATE_NAMES``, a key prefix, a tag, the output."""
    for option in reversed(
        [
            click.option(
                "--state", type=click.Choice(STATE_NAMES), help="Only messages in this state (default: live)."
            ),
            click.option("--key-prefix", help="Only keys that start with this."),
            click.option("--tag", help="Only messages carrying this tag."),
            click.option("--limit", default=50, show_default=True, type=click.IntRange(min=1, max=1_000_000)),
            click.option("--json", "as_json", is_flag=True, help="Print JSON."),
            click.option("--full", is_flag=True, help=f"Payloads whole (else cut at {PAYLOAD_SHOWN} characters)."),
        ]
    ):
        command = option(command)
    return command


@main.command(name="ls")
@click.argument("queue")
@_filters
@click.pass_context
@friendly
def ls(
    ctx: click.Context,
    queue: str,
    state: str | None,
    key_prefix: str | None,
    tag: str | None,
    limit: int,
    as_json: bool,
    full: bool,
) -> None:
    """List a queue's messages in a state: live ones (the states `stats` counts) by due time; dead letters,
    completed and cancelled ones (kept after they finished) by when they did.

    A queue with nothing in it lists nothing (exit 0); when the database knows nothing of it at all,
    stderr says so, with the queues it does know. A payload longer than 200 characters (as JSON) is
    cut, with its length: `show` and `--full` print it whole. `search` lists every queue's.
    """
    check_queue_name(queue)
    with connect(ctx) as (_, conn):
        now = database_now(conn)
        found = list_messages(
            conn,
            make_tables(ctx.obj["prefix"]),
            queue,
            state=State.named(state) if state else None,
            now=now,
            key_prefix=None if key_prefix is None else check_prefix(key_prefix),
            limit=limit,
            tag=tag,
        )
        note = "" if found or as_json or tag else unknown_queue_note(ctx, conn, queue)
    if note:
        click.echo(f"note: {note}", err=True)
    _listed(found, state, now, as_json, full, [])


@main.command()
@_filters
@click.pass_context
@friendly
def search(
    ctx: click.Context,
    state: str | None,
    key_prefix: str | None,
    tag: str | None,
    limit: int,
    as_json: bool,
    full: bool,
) -> None:
    """List the messages of every queue in a state (default: live) under a key prefix, carrying a tag:
    queue by queue in name order, each as `ls` lists it (under a key prefix, by key)."""
    with connect(ctx) as (_, conn):
        now = database_now(conn)
        found = search_messages(
            conn,
            make_tables(ctx.obj["prefix"]),
            state=State.named(state) if state else None,
            now=now,
            key_prefix=None if key_prefix is None else check_prefix(key_prefix),
            tag=tag,
            limit=limit,
        )
    _listed(found, state, now, as_json, full, ["queue"])


def _listed(
    found: list[StoredMessage], state: str | None, now: dt.datetime, as_json: bool, full: bool, first: list[str]
) -> None:
    """Print a listing: a table whose time columns fit ``state``, or JSON."""
    if as_json:
        listed = [m.as_dict() for m in found]
        for d in listed:
            d["payload"] = d["payload"] if full else shorten(d["payload"], PAYLOAD_SHOWN)
        emit(listed, True, [])
        return
    dead_only = state == State.DEAD.value
    kept = state in (State.COMPLETED.value, State.CANCELLED.value)
    rows = [_row(m, now, full) for m in found]
    when = ["failed"] if dead_only else ["finished", "took"] if kept else ["due", "running"]
    if state == State.IN_FLIGHT.value:  # a held message's time is when its lock expires, not when it is due
        when = ["lock_expires", "running"]
    extra = ["result"] if kept else []
    tagged = ["tags"] if any(m.tags for m in found) else []
    emit(rows, False, [*first, "key", "state", *when, "attempts", "last_error", *tagged, "payload", *extra])


def _row(m: StoredMessage, now: dt.datetime, full: bool) -> dict[str, Any]:
    return {
        "queue": m.queue,
        "key": m.key,
        "state": m.state.value,
        "due": relative(m.scheduled_at, now),
        "lock_expires": relative(m.scheduled_at, now),
        "failed": relative(m.failed_at, now),
        "finished": relative(m.finished_at, now),
        "took": "" if m.duration is None else human(m.duration),
        "result": m.result if full else shorten(m.result, PAYLOAD_SHOWN),
        "running": "" if (ran := m.running_for(now)) is None else human(ran),
        "attempts": m.attempts,
        "last_error": m.last_error,
        "tags": ",".join(m.tags),
        "payload": m.payload if full else shorten(m.payload, PAYLOAD_SHOWN),
    }


QUIET_UNSET = ("failed_at", "finished_at", "duration", "result", "worker")
"""Fields ``show`` leaves out when unset (they belong to dead letters or kept messages)."""
NOT_RECORDED = ("priority", "group")
"""Fields that dead letters and kept messages of an older delayq (before delayq_0013) do not record: ``show``
says so where a kept row's priority is unset."""


@main.command()
@click.argument("queue")
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
@friendly
def show(ctx: click.Context, queue: str, key: str, as_json: bool) -> None:
    """Everything about one message, its priority and group included (or its dead letters, or what was kept
    after it completed or was cancelled: its result and how long it ran)."""
    tables = make_tables(ctx.obj["prefix"])
    check_queue_name(queue)
    with connect(ctx) as (_, conn):
        now = database_now(conn)
        found = list_messages(conn, tables, queue, state=None, now=now, key=key, limit=1)
        for kept in (State.COMPLETED, State.CANCELLED, State.DEAD):
            found += list_messages(conn, tables, queue, state=kept, now=now, key=key, limit=20)
        if not found:
            raise Fail(f"no message {key!r} in queue {queue!r}{_noted(unknown_queue_note(ctx, conn, queue))}")
    if as_json:
        click.echo(json.dumps([m.as_dict() for m in found], indent=2, default=json_value))
        return
    for m in found:
        for name, value in m.as_dict().items():
            if name == "attempt_history" or (name in QUIET_UNSET and value is None):
                continue
            if name in NOT_RECORDED and m.state.kept and m.priority is None:
                value = "(not recorded)"
            if name == "duration":
                value = human(dt.timedelta(seconds=value))
            if name == "state":
                value = click.style(value, fg=STATE_COLOURS.get(value))
            when = {"scheduled_at": m.scheduled_at, "failed_at": m.failed_at, "finished_at": m.finished_at}.get(name)
            shown = _cell(value) if when is None else f"{value} ({relative(when, now)})"
            click.echo(f"{name:>13}: {shown}")
        for r in m.attempt_history:
            click.echo(
                click.style(f"\n  attempt {r.attempt} failed {relative(r.at, now)} ({r.at.isoformat()})", bold=True)
            )
            click.echo(f"  {r.message}")
            for line in (r.traceback or "").rstrip().splitlines():
                click.echo(click.style(f"    {line}", dim=True))
        click.echo()


@main.command()
@click.argument("queue")
@click.argument("key", required=False)
@click.option("--at", "at_text", help="When, ISO 8601 with an offset.")
@click.option("--in", "in_text", help="How long from now, e.g. 90s, 5m, 1h30m.")
@click.option("--key-prefix", help="Every message not running whose key starts with this (asks first unless --yes).")
@click.option("--tag", help="Every message not running that carries this tag (asks first unless --yes).")
@click.option("--state", type=click.Choice(RESCHEDULED), help="Every message in this state (all: not running).")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
@friendly
def reschedule(
    ctx: click.Context,
    queue: str,
    key: str | None,
    at_text: str | None,
    in_text: str | None,
    key_prefix: str | None,
    tag: str | None,
    state: str | None,
    yes: bool,
) -> None:
    """Change when a message runs, or (with --key-prefix, --tag, --state) when every matching one that is not
    running does, in batches."""
    if (at_text is None) == (in_text is None):
        raise Fail("give exactly one of --at TIME or --in DURATION")
    at: dt.datetime | dt.timedelta = parse_time(at_text) if at_text else parse_duration(in_text or "")
    if (key is None) == (key_prefix is None and tag is None and state is None):
        raise Fail("give a KEY, or a filter: --key-prefix P, --tag T, --state S (not both)")
    if key is None:
        due = at_text or f"in {in_text}"
        return bulk.reschedule_matching(ctx, queue, at, due, state, key_prefix, tag, yes)
    _act(ctx, queue, key, lambda q: q.reschedule(key, at), "rescheduled")
    audited(ctx, "reschedule", queue, 1, key=key, due=at_text or f"in {in_text}")


@main.command(name="run-now")
@click.argument("queue")
@click.argument("key")
@click.pass_context
@friendly
def run_now(ctx: click.Context, queue: str, key: str) -> None:
    """Make a message due now."""
    _act(ctx, queue, key, lambda q: q.reschedule(key), "due now")
    audited(ctx, "run-now", queue, 1, key=key)


CANCEL_CHUNK = 1000
"""At most this many keys per ``prefix_chunks`` chunk, as ``cancel --key-prefix`` once deleted them (it now cancels
in ``cancel_matching``'s batches); kept importable from ``delayq.cli``."""


def prefix_chunks(prefix: str, keys: list[str], size: int) -> Iterator[tuple[str, bool, int]]:
    """Cover ``keys`` (each starts with ``prefix``) with longer prefixes that hold at most ``size`` of them each.

    Yields ``(sub, exact, n)``: ``cancel_prefix(sub)`` deletes ``n`` of the keys, or, when ``exact``,
    ``sub`` is itself one of the keys (shorter than the prefixes below it) for ``cancel(sub)``.
    """
    if len(keys) <= size:
        yield prefix, False, len(keys)
        return
    prefix = _common_prefix(keys)  # at least ``prefix``: skip the characters every key shares
    groups: dict[str, list[str]] = {}
    exact = 0
    for k in keys:
        if len(k) == len(prefix):
            exact += 1
        else:
            groups.setdefault(k[: len(prefix) + 1], []).append(k)
    if exact:
        yield prefix, True, exact
    for sub in sorted(groups):
        yield from prefix_chunks(sub, groups[sub], size)


def _common_prefix(keys: list[str]) -> str:
    lo, hi = min(keys), max(keys)  # what the first and the last share, all share
    n = 0
    while n < len(lo) and lo[n] == hi[n]:
        n += 1
    return lo[:n]


@main.command()
@click.argument("queue")
@click.argument("key", required=False)
@click.option("--key-prefix", help="Every message whose key starts with this (asks first unless --yes).")
@click.option("--tag", help="Every message that carries this tag (asks first unless --yes).")
@click.option("--state", type=click.Choice(CANCELLED), help="Every message in this state (all: not running).")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
@friendly
def cancel(
    ctx: click.Context,
    queue: str,
    key: str | None,
    key_prefix: str | None,
    tag: str | None,
    state: str | None,
    yes: bool,
) -> None:
    """Cancel a message, or every one a filter (--key-prefix, --tag, --state) matches.

    A message whose handler runs is recorded as cancelled and its worker told (it stops, and what it does after
    changes nothing); the line says which it was. With a filter, the matching messages are counted, confirmed
    (unless --yes) and cancelled in batches as one is (`cancel_matching`), with a progress bar on stderr: a
    queued one deleted, a running one recorded as cancelled and its worker told.
    """
    if key is None and (key_prefix is not None or tag is not None or state is not None):
        return bulk.cancel_matching(ctx, queue, state, key_prefix, tag, yes)
    if key is None or key_prefix is not None or tag is not None or state is not None:
        raise Fail("give a KEY, or --key-prefix PREFIX, --tag T, --state S (not both)")
    with connect(ctx) as (engine, conn):
        conn.rollback()  # hold nothing while the cancel runs on its own connection
        outcome = admin_queue(engine, ctx, queue).cancel_job(key)
        if not outcome:
            raise Fail(_nothing_to_cancel(ctx, conn, queue, key))
    if outcome is CancelOutcome.RUNNING:
        click.echo(f"{queue}: cancelled running message {key}: its worker is told")
    else:
        click.echo(f"{queue}: cancelled queued message {key}")
    audited(ctx, "cancel", queue, 1, key=key)


def _nothing_to_cancel(ctx: click.Context, conn: sa.Connection, queue: str, key: str) -> str:
    """Why ``cancel QUEUE KEY`` cancelled nothing: the message is kept as cancelled or completed, or is a dead
    letter (it finished already), or there is none."""
    tables, now = make_tables(ctx.obj["prefix"]), database_now(conn)
    for kept in (State.CANCELLED, State.COMPLETED, State.DEAD):
        if list_messages(conn, tables, queue, state=kept, now=now, key=key, limit=1):
            hint = " (a dead letter: `delayq dead purge` deletes it)" if kept is State.DEAD else ""
            return f"message {key!r} of queue {queue!r} is already {kept.value}{hint}: nothing to cancel"
    return f"no message {key!r} in queue {queue!r}{_noted(unknown_queue_note(ctx, conn, queue))}"


@main.command()
@click.argument("queue")
@click.argument("key")
@click.argument("payload")
@click.option("--at", "at_text", help="When it is due, ISO 8601 with an offset (default: now).")
@click.option("--in", "in_text", help="How long from now it is due, e.g. 90s, 5m, 1h30m.")
@click.option("--update", is_flag=True, help="Replace a message already under KEY.")
@click.option("--priority", default=0, show_default=True, help="Higher is claimed first (-1000 to 1000).")
@click.option("--group", help="At most the queue's group concurrency (1) of one group run at once, in due order.")
@click.option("--tag", "tags", multiple=True, help="A tag kept with the message (repeat for more).")
@click.pass_context
@friendly
def enqueue(
    ctx: click.Context,
    queue: str,
    key: str,
    payload: str,
    at_text: str | None,
    in_text: str | None,
    update: bool,
    priority: int,
    group: str | None,
    tags: tuple[str, ...],
) -> None:
    """Offer a message: PAYLOAD is JSON (a string needs its quotes: '"hello"'), @FILE for a file's, - for stdin's."""
    if at_text is not None and in_text is not None:
        raise Fail("give at most one of --at TIME or --in DURATION")
    text, where = read_payload(payload)
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise Fail(f"{where} is not JSON ({exc}): write a string with its quotes, e.g. '\"hello\"'") from None
    at: dt.datetime | dt.timedelta | None = None
    if at_text is not None:
        at = parse_time(at_text)
    elif in_text is not None:
        at = parse_duration(in_text)
    with connect(ctx) as (engine, conn):
        conn.rollback()
        q = DelayedQueue(engine, queue, table_prefix=ctx.obj["prefix"])
        outcome = q.offer(key, value, at, update=update, priority=priority, group=group, tags=list(tags) or None)
    click.echo(f"{queue} {key}: {outcome.value}")


def _act(ctx: click.Context, queue: str, key: str, action: Callable[[DelayedQueue], bool], done: str) -> None:
    with connect(ctx) as (engine, conn):
        conn.rollback()  # hold nothing while the action runs on its own connection
        if not action(admin_queue(engine, ctx, queue)):
            raise Fail(f"no message {key!r} in queue {queue!r}{_noted(unknown_queue_note(ctx, conn, queue))}")
    click.echo(f"{queue} {key}: {done}")
