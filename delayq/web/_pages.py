"""The pages (GET): overview, a queue's messages, a message, dead letters, cron schedules, topics, workers; and the
small JSON reads the pages poll to stay live (one panel each)."""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from delayq.browse import STATE_NAMES, State
from delayq.errors import InvalidInputError
from delayq.queue import check_queue_name
from delayq.tags import check_tag
from delayq.web import _reads
from delayq.web._render import Dashboard, json_response


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


def _state(request: Request) -> State | None:
    """The ``state`` asked for (one of ``STATE_NAMES``, as ``delayq ls --state``); None (every live one) when empty."""
    text = request.query_params.get("state", "")
    return State.named(text) if text else None


def _cursor(request: Request) -> tuple[int, int, str] | None:
    try:
        return _reads.decode_cursor(request.query_params.get("after"))
    except ValueError:
        raise InvalidInputError("bad page cursor: follow the dashboard's own 'next' link") from None


def _tag(request: Request) -> str:
    tag = request.query_params.get("tag", "")
    return check_tag(tag) if tag else ""


async def messages(dash: Dashboard, request: Request) -> Response:
    return await _listing(dash, request, _queue(request), _state(request), "messages.html")


async def dead_letters(dash: Dashboard, request: Request) -> Response:
    return await _listing(dash, request, _queue(request), State.DEAD, "dead.html")


async def _listing(dash: Dashboard, request: Request, name: str, state: State | None, template: str) -> Response:
    prefix = request.query_params.get("prefix", "")
    # (a tag filters the messages page only: the dead letters' bulk actions act by key prefix alone)
    tag = _tag(request) if template == "messages.html" else ""
    after = _cursor(request)
    page, view = await run_in_threadpool(_page_and_counts, dash, name, state, prefix, tag, after)
    rows = [_row(m) for m in page.messages]
    return dash.render(
        request,
        template,
        queue=name,
        state=state.value if state else "",
        states=STATE_NAMES,
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
        "queue": m.queue,
        "key": m.key,
        "state": m.state.value,
        "kept": m.state.kept,
        "scheduled_at": m.scheduled_at,
        "failed_at": m.failed_at,
        "finished_at": m.finished_at,
        "duration": m.duration,
        "result": "" if m.result is None else _reads.short_payload(m.result),
        "attempts": m.attempts,
        "last_error": m.last_error or "",
        "payload": _reads.short_payload(m.payload),
        "tags": ", ".join(getattr(m, "tags", ())),
    }


async def search(dash: Dashboard, request: Request) -> Response:
    """Every queue's messages in a state under a key prefix carrying a tag, a keyset page at a time."""
    state, prefix, tag, after = _state(request), request.query_params.get("prefix", ""), _tag(request), _cursor(request)
    after_queue = request.query_params.get("after_queue", "")
    if (after is None) != (not after_queue):
        raise InvalidInputError("bad page cursor: follow the dashboard's own 'next' link")
    where = None if after is None else (check_queue_name(after_queue), after)
    page = await run_in_threadpool(_reads.search_page, dash.where, state=state, key_prefix=prefix, tag=tag, after=where)
    return dash.render(
        request,
        "search.html",
        state=state.value if state else "",
        states=STATE_NAMES,
        prefix=prefix,
        tag=tag,
        after=request.query_params.get("after", ""),
        page=page,
        rows=[_row(m) for m in page.messages],
    )


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
    rows, running = [_reads.worker_row(w) for w in found], _reads.running_rows(found)
    return dash.render(request, "workers.html", workers=rows, running=running)


async def workers_json(dash: Dashboard, request: Request) -> Response:
    found = await run_in_threadpool(_reads.workers, dash.where)
    return json_response({"workers": [_reads.worker_row(w) for w in found], "running": _reads.running_rows(found)})
