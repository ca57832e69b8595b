"""Bulk actions on a filter from the command line: ``delayq purge``, and the filter forms of ``cancel``,
``reschedule`` and ``dead requeue|purge`` (``--key-prefix``, ``--tag``, ``--state``).

Each counts what matches first (``count_matching``: the same filter), asks unless ``--yes``, then runs the
action in batches with a progress bar on stderr, says how many it did and how many another transaction held
(skipped: run it again), and records itself in the audit. Interrupted, it says how many it did: those stay done,
and the same command finishes the rest.
"""

from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Callable

import click

from delayq.cli._common import Fail, audited, connect, friendly
from delayq.cli._root import _noted, admin_queue, main, unknown_queue_note
from delayq.queue import BulkOutcome, DelayedQueue, check_queue_name
from delayq.queue._bulk import BULK_BATCH, MAX_BATCH, STATES, BulkAction, Progress

PURGE_STATES = tuple(s for s in STATES if s != "in-flight")
"""What ``delayq purge --state`` takes: every state but a running message's."""

Action = Callable[[DelayedQueue, Progress], BulkOutcome]


def described(state: str | None, key_prefix: str | None, tag: str | None) -> str:
    """The filter in words, as the confirmation and the "nothing matches" line say it."""
    parts = [] if state is None else [f"in state {state}"]
    if key_prefix is not None:
        parts.append(f"whose key starts with {key_prefix!r}")
    if tag is not None:
        parts.append(f"tagged {tag!r}")
    return " " + ", ".join(parts) if parts else ""


def run(
    ctx: click.Context,
    queue: str,
    verb: str,
    action: Action,
    *,
    state: str | None,
    key_prefix: str | None,
    tag: str | None,
    yes: bool,
    audit: str,
    counted: BulkAction,
    **chosen: object,
) -> None:
    """Count, confirm, act in batches and report: the one path of every bulk command (see the module)."""
    check_queue_name(queue)
    what = "dead letter(s)" if state == "dead" else "message(s)"
    with connect(ctx) as (engine, conn):
        conn.rollback()  # hold nothing while the action runs on its own connections
        q = admin_queue(engine, ctx, queue)
        n = q.count_matching(state=state, key_prefix=key_prefix, tag=tag, action=counted)
        if not n:
            note = _noted(unknown_queue_note(ctx, conn, queue))
            raise Fail(f"no {what.removesuffix('(s)')} of queue {queue!r}{described(state, key_prefix, tag)}{note}")
        if not yes:
            click.confirm(f"{verb} {n} {what} of {queue!r}{described(state, key_prefix, tag)}?", abort=True)
        seen = BulkOutcome(0)
        with click.progressbar(length=n, label=verb, file=sys.stderr, show_pos=True) as bar:

            def progress(so_far: BulkOutcome) -> None:
                nonlocal seen
                bar.update(so_far.done + so_far.skipped - seen.done - seen.skipped)
                seen = so_far

            try:
                outcome = action(q, progress)
            except BaseException:
                click.echo(
                    f"\n{queue}: interrupted after {seen.done} {what} ({verb}); those stay done: run the same "
                    "command again to finish the rest",
                    err=True,
                )
                raise
    click.echo(f"{queue}: {outcome.done} {what} {_PAST.get(verb, verb + 'd')}")
    if outcome.skipped:
        click.echo(
            f"note: {outcome.skipped} matching {what} skipped: another transaction held them (a claim or an "
            "action under way): run the same command again",
            err=True,
        )
    audited(ctx, audit, queue, outcome.done, state=state, prefix=key_prefix, tag=tag, **chosen)


_PAST = {"cancel": "cancelled", "purge": "purged", "requeue": "requeued", "reschedule": "rescheduled"}


def batch_option(command: Callable[..., None]) -> Callable[..., None]:
    return click.option(
        "--batch-size",
        default=BULK_BATCH,
        show_default=True,
        type=click.IntRange(1, MAX_BATCH),
        help="Rows per batch (each batch its own transaction).",
    )(command)


@main.command()
@click.argument("queue")
@click.option(
    "--state", required=True, type=click.Choice(PURGE_STATES), help="What to purge (all: every live one not running)."
)
@click.option("--key-prefix", help="Only keys that start with this.")
@click.option("--tag", help="Only messages carrying this tag.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@batch_option
@click.pass_context
@friendly
def purge(
    ctx: click.Context, queue: str, state: str, key_prefix: str | None, tag: str | None, yes: bool, batch_size: int
) -> None:
    """Delete a queue's messages in a state, recording nothing (asks first unless --yes).

    ready, scheduled, expired-lock, or all (every live message that is not running); dead (dead letters);
    completed or cancelled (kept finished messages). A running message is never purged: `delayq cancel
    QUEUE --state in-flight` cancels it and tells its handler.
    """
    run(
        ctx,
        queue,
        "purge",
        lambda q, p: q.purge(state=state, key_prefix=key_prefix, tag=tag, batch_size=batch_size, progress=p),
        state=state,
        key_prefix=key_prefix,
        tag=tag,
        yes=yes,
        audit="purge-all",
        counted="purge",
    )


def cancel_matching(
    ctx: click.Context, queue: str, state: str | None, key_prefix: str | None, tag: str | None, yes: bool
) -> None:
    """``delayq cancel QUEUE`` with a filter: ``cancel_matching`` (a running message is recorded and told)."""
    run(
        ctx,
        queue,
        "cancel",
        lambda q, p: q.cancel_matching(state=state, key_prefix=key_prefix, tag=tag, progress=p),
        state=state,
        key_prefix=key_prefix,
        tag=tag,
        yes=yes,
        audit="cancel",
        counted="cancel",
    )


def reschedule_matching(
    ctx: click.Context,
    queue: str,
    at: dt.datetime | dt.timedelta,
    due: str,
    state: str | None,
    key_prefix: str | None,
    tag: str | None,
    yes: bool,
) -> None:
    """``delayq reschedule QUEUE`` with a filter: ``reschedule_matching`` (what is not running)."""
    run(
        ctx,
        queue,
        "reschedule",
        lambda q, p: q.reschedule_matching(at, state=state, key_prefix=key_prefix, tag=tag, progress=p),
        state=state,
        key_prefix=key_prefix,
        tag=tag,
        yes=yes,
        audit="reschedule",
        counted="reschedule",
        due=due,
    )


def dead_matching(
    ctx: click.Context, queue: str, verb: str, key_prefix: str | None, tag: str | None, yes: bool
) -> None:
    """``delayq dead requeue|purge`` of many: ``requeue_dead_matching`` or ``purge(state="dead")``."""

    def action(q: DelayedQueue, p: Progress) -> BulkOutcome:
        if verb == "requeue":
            return q.requeue_dead_matching(key_prefix=key_prefix, tag=tag, progress=p)
        return q.purge(state="dead", key_prefix=key_prefix, tag=tag, progress=p)

    run(
        ctx,
        queue,
        verb,
        action,
        state="dead",
        key_prefix=key_prefix,
        tag=tag,
        yes=yes,
        audit=f"{verb}-all",
        counted="requeue" if verb == "requeue" else "purge",
        all=(key_prefix is None and tag is None) or None,
    )
