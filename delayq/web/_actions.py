"""The actions (POST only): run now, reschedule, cancel, requeue or purge dead letters (one, or in bulk after
a confirmation), pause, resume, limits. Each goes through ``DelayedQueue``'s public operations.

Refused (403, nothing changed) when the dashboard is read-only, the user's role is ``read`` or the CSRF token
is missing or wrong; bad input answers 400 with one line. A done action is recorded in the audit (``act``,
once for every action: ``delayq.audit``), then redirects (303) back to the page it came from. An action
returns what the next page says, a ``str``, or a ``Done`` that also says how many messages it affected.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import parse_qsl

import sqlalchemy as sa
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from delayq import audit
from delayq.errors import DelayqError, InvalidInputError
from delayq.messages import CancelOutcome
from delayq.queue import BulkOutcome, DelayedQueue, check_prefix, check_queue_name
from delayq.queue._bulk import BulkAction
from delayq.web import _csrf
from delayq.web._auth import actor
from delayq.web._reads import Where
from delayq.web._render import Dashboard, base_path, notice

MAX_PERIOD_S = 100 * 365 * 86400
"""The longest rate period the limits form takes (100 years, as a due time's reach)."""
COUNT_SHOWN = 10_000
"""A bulk confirmation counts the matching messages up to this many ("at least" beyond)."""


async def act(dash: Dashboard, request: Request) -> Response:
    """Check the request, then run the action its path names."""
    if not dash.actions:
        return dash.error(request, 403, "this dashboard is read-only (start it with --allow-actions)")
    if not dash.can_act(request):
        return dash.error(request, 403, "your role is read: you may look, not act")
    form = dict(parse_qsl((await request.body()).decode("utf-8", "replace"), keep_blank_values=True))
    if not _csrf.valid(request, form):
        return dash.error(request, 403, "missing or wrong CSRF token: reload the page and try again")
    name = request.path_params["action"]
    action = ACTIONS.get(name)
    if action is None:
        return dash.error(request, 404, f"no action {name!r}")
    try:
        queue = check_queue_name(form.get("queue", ""))
        if name in BULK and form.get("confirmed") != "yes":
            n, more = await run_in_threadpool(BULK[name], dash.where.queue(queue), form)
            back = _safe_target(request, form)
            return dash.render(request, "confirm.html", action=name, form=form, count=n, more=more, back=back)
        done = _done(await run_in_threadpool(action, dash.where.queue(queue), form, dash.where))
    except InvalidInputError as exc:
        return dash.error(request, 400, str(exc))
    dash.snapshots.refresh_soon()  # (the counts the next pages show)
    said = await run_in_threadpool(_recorded, dash.where, actor(request), name, queue, form, done)
    response = RedirectResponse(_safe_target(request, form), status_code=303)
    notice(response, said, base_path(request))
    return response


@dataclass(frozen=True)
class Done:
    """What an action did: the line the next page shows, and how many messages it affected (for the audit)."""

    text: str
    count: int | None = None


def _done(result: str | Done) -> Done:
    return result if isinstance(result, Done) else Done(result)


NOT_AUDITED = frozenset({_csrf.FIELD, "next", "confirmed", "queue"})
"""Form fields that are the form's plumbing: every other non-empty one is what the action selected or set."""
AUDITED_LENGTH = 200
"""The characters of a form value the audit keeps."""
log = logging.getLogger("delayq.web")


def _recorded(where: Where, who: str, name: str, queue: str, form: dict[str, str], done: Done) -> str:
    """Record a done action in the audit; what the next page says (the action was done, recorded or not)."""
    chosen = {k: v[:AUDITED_LENGTH] for k, v in form.items() if k not in NOT_AUDITED and v}
    try:
        audit.record(
            where.engine, where.tables, name, actor=who, source="web", queue=queue, filter=chosen, count=done.count
        )
    except (sa.exc.SQLAlchemyError, DelayqError) as exc:  # (whatever it is, the action stands: say so)
        log.exception("delayq web: %s on %r was done but not recorded in the audit", name, queue)
        return f"{done.text} (done, but not recorded in the audit: {type(exc).__name__})"
    return done.text


def _safe_target(request: Request, form: dict[str, str]) -> str:
    """The page the form came from: a path of this dashboard only (else the overview)."""
    base = base_path(request)
    target = form.get("next", "")
    if not target.startswith(base + "/") or target.startswith("//") or "\\" in target:
        return base + "/"
    return target


def _key(form: dict[str, str]) -> str:
    key = form.get("key", "")
    if not key:
        raise InvalidInputError("no key given")
    return key


def _prefix(form: dict[str, str]) -> str | None:
    prefix = form.get("prefix", "")
    return check_prefix(prefix) if prefix else None


def _found(ok: bool, what: str, key: str) -> Done:
    return Done(what, 1) if ok else Done(f"nothing done: no message {key!r} (gone meanwhile?)", 0)


def _run_now(q: DelayedQueue, form: dict[str, str], _: Where) -> Done:
    key = _key(form)
    return _found(q.reschedule(key), f"{key}: due now", key)


def _delay(form: dict[str, str]) -> float:
    """The form's ``in_seconds``: from 0 to 100 years."""
    try:
        seconds = float(form.get("in_seconds", ""))
    except ValueError:
        raise InvalidInputError("give the delay in seconds, e.g. 300") from None
    if not 0 <= seconds <= 100 * 365 * 86400:
        raise InvalidInputError("the delay must be from 0 to 100 years")
    return seconds


def _reschedule(q: DelayedQueue, form: dict[str, str], _: Where) -> Done:
    key = _key(form)
    seconds = _delay(form)
    return _found(q.reschedule(key, dt.timedelta(seconds=seconds)), f"{key}: due in {seconds:g}s", key)


def _cancel(q: DelayedQueue, form: dict[str, str], _: Where) -> Done:
    key = _key(form)
    outcome = q.cancel_job(key)
    told = ": its handler was running, its worker is told" if outcome is CancelOutcome.RUNNING else ""
    return _found(bool(outcome), f"{key}: cancelled{told}", key)


def _requeue(q: DelayedQueue, form: dict[str, str], _: Where) -> Done:
    key = _key(form)
    return _found(q.requeue_dead(key), f"{key}: requeued", key)


def _purge(q: DelayedQueue, form: dict[str, str], _: Where) -> Done:
    key = _key(form)
    n = q.purge_dead(key=key)
    return Done(f"{key}: {n} dead letter(s) purged", n) if n else _found(False, "", key)


def _filter(form: dict[str, str], default: str | None = None) -> tuple[str | None, str | None, str | None]:
    """The queue page's filter in a form (``state``, ``prefix``, ``tag``; empty: none) as a bulk action's state,
    key prefix and tag; an empty state is ``default``."""
    return form.get("state") or default, _prefix(form), form.get("tag") or None


def _counted(
    q: DelayedQueue, action: BulkAction, state: str | None, key_prefix: str | None, tag: str | None
) -> tuple[int, bool]:
    """How many rows ``action`` would act on (read up to ``COUNT_SHOWN``), and whether more match."""
    n = q.count_matching(state=state, key_prefix=key_prefix, tag=tag, at_most=COUNT_SHOWN + 1, action=action)
    return min(n, COUNT_SHOWN), n > COUNT_SHOWN


def _said(outcome: BulkOutcome, what: str) -> Done:
    """What the next page says of a bulk action: how many it did, and how many another transaction held."""
    held = ""
    if outcome.skipped:
        held = f"; {outcome.skipped} skipped: another transaction held them (a claim under way?): run it again"
    return Done(f"{outcome.done} {what}{held}", outcome.done)


def _count_requeued(q: DelayedQueue, form: dict[str, str]) -> tuple[int, bool]:
    return _counted(q, "requeue", "dead", _prefix(form), None)


def _count_dead(q: DelayedQueue, form: dict[str, str]) -> tuple[int, bool]:
    return _counted(q, "purge", "dead", _prefix(form), None)


def _requeue_all(q: DelayedQueue, form: dict[str, str], _: Where) -> Done:
    return _said(q.requeue_dead_matching(key_prefix=_prefix(form)), "dead letter(s) requeued")


def _purge_all(q: DelayedQueue, form: dict[str, str], _: Where) -> Done:
    return _said(q.purge(state="dead", key_prefix=_prefix(form)), "dead letter(s) purged")


def _count_cancelled(q: DelayedQueue, form: dict[str, str]) -> tuple[int, bool]:
    return _counted(q, "cancel", *_filter(form))


def _bulk_cancel(q: DelayedQueue, form: dict[str, str], _: Where) -> Done:
    state, prefix, tag = _filter(form)
    done = q.cancel_matching(state=state, key_prefix=prefix, tag=tag)
    return _said(done, "message(s) cancelled (a running one's worker is told)")


def _count_purged(q: DelayedQueue, form: dict[str, str]) -> tuple[int, bool]:
    return _counted(q, "purge", *_filter(form, "all"))


def _bulk_purge(q: DelayedQueue, form: dict[str, str], _: Where) -> Done:
    state, prefix, tag = _filter(form, "all")
    done = q.purge(state=state or "all", key_prefix=prefix, tag=tag)
    return _said(done, "dead letter(s) purged" if state == "dead" else "message(s) purged")


def _count_rescheduled(q: DelayedQueue, form: dict[str, str]) -> tuple[int, bool]:
    _delay(form)
    return _counted(q, "reschedule", *_filter(form))


def _bulk_reschedule(q: DelayedQueue, form: dict[str, str], _: Where) -> Done:
    seconds = _delay(form)
    state, prefix, tag = _filter(form)
    done = q.reschedule_matching(dt.timedelta(seconds=seconds), state=state, key_prefix=prefix, tag=tag)
    return _said(done, f"message(s) due in {seconds:g}s")


def _pause(q: DelayedQueue, form: dict[str, str], _: Where) -> str:
    q.pause()
    return f"{q.name}: paused"


def _resume(q: DelayedQueue, form: dict[str, str], _: Where) -> str:
    q.resume()
    return f"{q.name}: resumed"


def _limit_value(text: str, what: str) -> int | None:
    text = text.strip().lower()
    if text in ("", "none"):
        return None
    try:
        return int(text)
    except ValueError:
        raise InvalidInputError(f"the {what} must be a positive integer or empty (no limit), got {text!r}") from None


def _limits(q: DelayedQueue, form: dict[str, str], _: Where) -> str:
    concurrency = _limit_value(form.get("concurrency", ""), "concurrency limit")
    rate = _limit_value(form.get("rate", ""), "rate limit")
    try:
        seconds = float(form.get("per_seconds", "1") or "1")
    except ValueError:
        raise InvalidInputError("the rate's period must be a number of seconds") from None
    if not 0 < seconds <= MAX_PERIOD_S:  # (also refuses nan and inf, which timedelta cannot hold)
        raise InvalidInputError(f"the rate's period must be more than 0 and at most {MAX_PERIOD_S} seconds")
    per = dt.timedelta(seconds=seconds)
    q.set_concurrency_limit(concurrency)
    q.set_rate_limit(rate, per)
    return f"{q.name}: limits set"


Action = Callable[[DelayedQueue, dict[str, str], Where], str | Done]
ACTIONS: dict[str, Action] = {
    "run-now": _run_now,
    "reschedule": _reschedule,
    "cancel": _cancel,
    "requeue": _requeue,
    "purge": _purge,
    "requeue-all": _requeue_all,
    "purge-all": _purge_all,
    "pause": _pause,
    "resume": _resume,
    "limits": _limits,
    "bulk-cancel": _bulk_cancel,
    "bulk-purge": _bulk_purge,
    "bulk-reschedule": _bulk_reschedule,
}
Count = Callable[[DelayedQueue, dict[str, str]], tuple[int, bool]]
BULK: dict[str, Count] = {
    "requeue-all": _count_requeued,
    "purge-all": _count_dead,
    "bulk-cancel": _count_cancelled,
    "bulk-purge": _count_purged,
    "bulk-reschedule": _count_rescheduled,
}
"""Actions on many messages (the dead letters, or the queue page's filter: state, key prefix, tag), each with how
it counts what it would act on: they answer a confirmation page stating that count first, and act, in batches,
once it is confirmed."""
