"""OpenTelemetry: a publish span per offer, a process span per handler call linked to it (SDK in-memory exporter)."""

from __future__ import annotations

import asyncio
import datetime as dt
import warnings
from typing import Any

import sqlalchemy as sa
from conftest import Backend, make_async_engine
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from delayq import Delivery, Handler, ManualClock, RetryPolicy, Worker
from delayq.aio import AsyncDelivery, AsyncHandler, AsyncWorker


def test_the_handlers_span_links_to_the_span_that_offered_the_message(
    engine: sa.Engine, queue_name: str, clock: ManualClock, traced: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = traced
    app = provider.get_tracer("app")

    class Welcome(Handler):
        queue = queue_name
        retry = RetryPolicy(max_attempts=1)

        def handle(self, delivery: Delivery, conn: Any = None) -> None:
            with app.start_as_current_span("send the email"):
                if delivery.key == "bad":
                    raise ValueError("no such mailbox")

    worker = Worker(engine, [Welcome], clock=clock)
    q = worker.queues[0]
    with app.start_as_current_span("POST /signup") as request:
        q.offer("welcome-1", {"user": 1})
    with app.start_as_current_span("POST /import") as batch_request:
        q.offer_many([("welcome-2", {"user": 2}, None), ("bad", {"user": 3}, None)])
    q.offer("untraced", 0, at=dt.timedelta(hours=1))  # outside any request: a root publish span
    assert worker.run_once() == 3
    spans = exporter.get_finished_spans()

    def named(name: str) -> list[ReadableSpan]:
        return [s for s in spans if s.name == name]

    publish_one, publish_batch, publish_root = named(f"publish {queue_name}")
    assert publish_one.kind is SpanKind.PRODUCER and publish_one.parent is not None
    assert publish_one.parent.span_id == request.get_span_context().span_id
    assert publish_batch.parent is not None and publish_batch.parent.span_id == batch_request.get_span_context().span_id
    assert publish_root.parent is None
    assert publish_one.attributes is not None and publish_one.attributes["messaging.destination.name"] == queue_name
    assert publish_batch.attributes is not None and publish_batch.attributes["messaging.batch.message_count"] == 2

    processes = {s.attributes["messaging.message.conversation_id"]: s for s in named(f"process {queue_name}")}  # type: ignore[index]
    assert set(processes) == {"welcome-1", "welcome-2", "bad"}
    for key, publish in (("welcome-1", publish_one), ("welcome-2", publish_batch), ("bad", publish_batch)):
        process = processes[key]
        assert process.kind is SpanKind.CONSUMER
        [link] = process.links
        assert (link.context.trace_id, link.context.span_id) == (publish.context.trace_id, publish.context.span_id)
    # the handler's own spans are children of its process span
    for child in named("send the email"):
        assert child.parent is not None and child.parent.span_id in {p.context.span_id for p in processes.values()}
    bad = processes["bad"]
    assert bad.status.status_code is StatusCode.ERROR and [e.name for e in bad.events] == ["exception"]
    assert processes["welcome-1"].status.status_code is not StatusCode.ERROR

    # the context stays with the message through the dead letters and back
    assert q.requeue_dead("bad") is True
    assert "traceparent" in q.headers("bad") and len(q.get("bad").attempt_history) == 1  # type: ignore[union-attr]


def test_an_async_handlers_span_links_to_the_offer_and_reads_its_context_without_blocking(
    backend: Backend, queue_name: str, clock: ManualClock, traced: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """The async worker reads the trace context through the async driver (no MissingGreenlet, no warning)."""
    provider, exporter = traced
    app = provider.get_tracer("app")

    class Welcome(AsyncHandler):
        queue = queue_name

        async def handle(self, delivery: AsyncDelivery, conn: Any = None) -> None:
            with app.start_as_current_span("send the email"):
                await asyncio.sleep(0)

    async def main() -> None:
        engine = make_async_engine(backend.url)
        worker = AsyncWorker(engine, [Welcome], clock=clock)
        with app.start_as_current_span("POST /signup"):
            await worker.async_queues[queue_name].offer("welcome-1", {"user": 1})
        assert await worker.run_once() == 1
        await engine.dispose()

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an un-awaited coroutine would be one
        asyncio.run(main())
    spans = exporter.get_finished_spans()
    [publish] = [s for s in spans if s.name == f"publish {queue_name}"]
    [process] = [s for s in spans if s.name == f"process {queue_name}"]
    [link] = process.links
    assert (link.context.trace_id, link.context.span_id) == (publish.context.trace_id, publish.context.span_id)
    [child] = [s for s in spans if s.name == "send the email"]
    assert child.parent is not None and child.parent.span_id == process.context.span_id
