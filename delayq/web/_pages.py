"""The pages (GET): overview, a queue's messages, a message, dead letters, cron schedules, topics, workers; and the
small JSON reads the pages poll to stay live (one panel each)."""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from delayq.browse import State
from delayq.errors import InvalidInputError
from delayq.queue import check_queue_name
from delayq.tags import check_tag
from delayq.web import _reads
from delayq.web._render import Dashboard, json_response

LIVE_STATES = [s.value for s in State if s not in (State.DEAD, State.COMPLETED, State.CANCELLED)]


def _queue(request: Request, name: str = "queue") -> str:
    return check_queue_name(request.query_params.get(name, ""))


async def overview(dash: Dashboard, request: Request) -> Response:
    snap = await run_in_threadpool(dash.snapshots.latest)
    return dash.render(request, "overview.html", now=snap.taken_at, queues=[v.as_dict() for v in snap.queues])


async def overview_json(dash: Dashboard, request: Request) -> Response:
    snap = await run_in_threadpool(dash.snapshots.latest)
    rows = [v.as_dict() | {"series": dash.samples.series(v.name)} for v in snap.queues]
    return json_response({"now": snap.taken_at.isoformat(), "queues": rows})


def _counts(dash: Dashboard, name: str) -> _reads.QueueView:
    """A queue's counts from the shared snapshot (read on its own when the snapshot lacks it), and its flow
    settings as stored now (one row: a pause shows at once)."""
    found = dash.snapshots.latest().get(name)
    if found is None:
        return _reads.one_queue(dash.where, name)
    return _reads.QueueView(name, found.stats, dash.where.queue(name).flow())


async def queue_json(dash: Dashboard, request: Request) -> Response:
    view = await run_in_threadpool(_counts, dash, _queue(request))
    return json_response(view.as_dict())


async def messages(dash: Dashboard, request: Request) -> Response:
    name = _queue(request)
    state_text = request.query_params.get("state", "")
    if state_text and state_text not in LIVE_STATES:
        return dash.error(request, 400, f"no such state {state_text!r}: choose among {', '.join(LIVE_STATES)}")
    return await _listing(dash, request, name, State(state_text) if state_text else None, "messages.html")


async def dead_letters(dash: Dashboard, request: Request) -> Response:
    return await _listing(dash, request, _queue(request), State.DEAD, "dead.html")


async def _listing(dash: Dashboard, request: Request, name: str, state: State | None, template: str) -> Response:
    prefix = request.query_params.get("prefix", "")
    # (a tag filters the messages page only: the dead letters' bulk actions act by key prefix alone)
    tag = request.query_params.get("tag", "") if state is not State.DEAD else ""
    try:
        after = _reads.decode_cursor(request.query_params.get("after"))
    except ValueError:
        return dash.error(request, 400, "bad page cursor: follow the dashboard's own 'next' link")
    try:
        tag = check_tag(tag) if tag else ""
    except InvalidInputError as e:
        return dash.error(request, 400, str(e))
    page, view = await run_in_threadpool(_page_and_counts, dash, name, state, prefix, tag, after)
    rows = [_row(m) for m in page.messages]
    return dash.render(
        request,
        template,
        queue=name,
        state=state.value if state else "",
        states=LIVE_STATES,
        prefix=prefix,
        tag=tag,
        after=request.query_params.get("after", ""),
        page=page,
        rows=rows,
        counts=view.as_dict(),
        flow=view.flow,
    )


def _page_and_counts(
    dash: Dashboard, name: str, state: State | None, prefix: str, tag: str, after: tuple[int, int, str] | None
) -> tuple[_reads.Page, _reads.QueueView]:
    page = _reads.messages_page(dash.where, name, state=state, key_prefix=prefix, tag=tag, after=after)
    return page, _counts(dash, name)


def _row(m: Any) -> dict[str, Any]:
    return {
        "key": m.key,
        "state": m.state.value,
        "scheduled_at": m.scheduled_at,
        "failed_at": m.failed_at,
        "attempts": m.attempts,
        "last_error": m.last_error or "",
        "payload": _reads.short_payload(m.payload),
        "tags": ", ".join(getattr(m, "tags", ())),
    }


async def message(dash: Dashboard, request: Request) -> Response:
    name, key = _queue(request), request.query_params.get("key", "")
    view = await run_in_threadpool(_reads.message, dash.where, name, key)
    shown = view.shown
    if shown is None:
        return dash.error(
            request, 404, f"no message {key!r} in queue {name!r} (never offered, or finished and not kept)"
        )
    return dash.render(
        request,
        "message.html",
        queue=name,
        key=key,
        view=view,
        m=shown,
        payload=_reads.pretty(shown.payload),
        result=None if view.result is None else _reads.pretty(view.result),
    )


async def cron(dash: Dashboard, request: Request) -> Response:
    views = await run_in_threadpool(_reads.cron, dash.where)
    return dash.render(request, "cron.html", schedules=views)


async def topics(dash: Dashboard, request: Request) -> Response:
    found = await run_in_threadpool(_reads.topics, dash.where)
    return dash.render(request, "topics.html", topics=found)


async def topics_json(dash: Dashboard, request: Request) -> Response:
    found = await run_in_threadpool(_reads.topics, dash.where)
    rows = [
        {"topic": t.topic, "partitions": t.partitions, "published": t.published, "retained": t.retained} for t in found
    ]
    return json_response({"topics": rows})


async def topic(dash: Dashboard, request: Request) -> Response:
    name = request.query_params.get("topic", "")
    view = await run_in_threadpool(_reads.topic, dash.where, name)
    if view.summary is None:
        return dash.error(request, 404, f"no topic {name!r}")
    return dash.render(request, "topic.html", topic=name, view=view)


async def workers(dash: Dashboard, request: Request) -> Response:
    found = await run_in_threadpool(_reads.workers, dash.where)
    return dash.render(request, "workers.html", workers=[_reads.worker_row(w) for w in found])


async def workers_json(dash: Dashboard, request: Request) -> Response:
    found = await run_in_threadpool(_reads.workers, dash.where)
    return json_response({"workers": [_reads.worker_row(w) for w in found]})
