"""OpenTelemetry spans (the ``delayq[otel]`` extra), after the messaging semantic conventions.

``enable()`` makes every offer a PRODUCER span ``publish <queue>`` and every handler call a
CONSUMER span ``process <queue>``. The offer's trace context (W3C ``traceparent``/``tracestate``,
through the globally configured propagator) is stored with the message, so the handler's span
links to the span of the request that enqueued it, however long after and in whatever process.

Where the context lives: in the message's ``headers`` column (a JSON object), which travels with
it to the dead letters and back. The cost, with tracing on only: one more UPDATE in the offer's
transaction, one more SELECT per delivery.

Topics alike: a publish is a PRODUCER span ``publish <topic>`` whose context is stored in the log
row's ``headers`` (written by the publish's own INSERT: no extra statement), and a worker's topic
handler call a CONSUMER span ``process <topic>`` (with the consumer group, partition and offset) linked
to it: one more SELECT per delivery. The topic span is not made current in the handler's thread or
task (it starts at the poll, on the fetch loop); it ends when the outcome is recorded.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import Token
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, cast

from delayq import observe
from delayq.errors import MissingExtraError, install_hint

try:
    from opentelemetry import context, propagate, trace
    from opentelemetry.context import Context
    from opentelemetry.trace import Link, SpanKind, Status, StatusCode, TracerProvider
except ImportError as exc:  # the module stays importable: enable() says what to install
    _missing: ImportError | None = exc
else:
    _missing = None

if TYPE_CHECKING:
    from delayq.messages import Delivery
    from delayq.topics.delivery import TopicDelivery

__all__ = ["Tracing", "disable", "enable"]

SYSTEM = "delayq"
log = logging.getLogger("delayq.tracing")


class Tracing(observe.Observer):
    """The observer that makes the spans; ``enable()`` installs one."""

    def __init__(self, tracer_provider: TracerProvider | None = None) -> None:
        try:
            ver: str | None = version("delayq")
        except PackageNotFoundError:  # a source tree on sys.path
            ver = None
        self.tracer = trace.get_tracer("delayq", ver, tracer_provider=tracer_provider)

    def publishing(self, queue: str, n: int, headers: dict[str, str]) -> AbstractContextManager[None]:
        return self._publish(queue, n, headers)

    @contextmanager
    def _publish(self, queue: str, n: int, headers: dict[str, str]) -> Iterator[None]:
        attributes: dict[str, str | int] = {
            "messaging.system": SYSTEM,
            "messaging.operation.type": "send",
            "messaging.operation.name": "publish",
            "messaging.destination.name": queue,
        }
        if n != 1:
            attributes["messaging.batch.message_count"] = n
        with self.tracer.start_as_current_span(f"publish {queue}", kind=SpanKind.PRODUCER, attributes=attributes):
            propagate.inject(headers)
            yield

    def topic_publishing(self, topic: str, n: int, headers: dict[str, str]) -> AbstractContextManager[None]:
        return self._publish(topic, n, headers)

    def topic_started(self, delivery: TopicDelivery, group: str, headers: dict[str, str]) -> object:
        links = []
        if headers:
            origin = trace.get_current_span(propagate.extract(headers)).get_span_context()
            if origin.is_valid:
                links.append(Link(origin))
        return self.tracer.start_span(
            f"process {delivery.topic}",
            kind=SpanKind.CONSUMER,
            links=links,
            attributes={
                "messaging.system": SYSTEM,
                "messaging.operation.type": "process",
                "messaging.operation.name": "process",
                "messaging.destination.name": delivery.topic,
                "messaging.consumer.group.name": group,
                "messaging.destination.partition.id": str(delivery.partition),
                "messaging.delayq.message.offset": delivery.offset,
                "messaging.message.id": delivery.message_id,
                "messaging.message.conversation_id": delivery.partition_key,
                "messaging.message.delivery_count": delivery.attempts,
            },
        )

    def topic_running(self, state: object) -> AbstractContextManager[None]:
        # The span current while the handler runs: its own spans and logs nest under it.
        span = cast("trace.Span", state)
        # (the outcome, and an error with it, are recorded by topic_finished)
        found = trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False)
        return cast("AbstractContextManager[None]", found)

    def topic_finished(
        self, delivery: TopicDelivery, group: str, state: object, error: BaseException | None, duration: float
    ) -> None:
        span = cast("trace.Span", state)
        if error is not None:
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
            span.set_attribute("error.type", type(error).__qualname__)
        span.end()

    def started(self, delivery: Delivery) -> object:
        links = []
        try:
            headers = delivery.headers
        except Exception as exc:  # the span goes without its link; the delivery is not failed for it
            log.warning("%s: could not read its trace context (%s)", delivery.label, type(exc).__name__)
            headers = {}
        if headers:
            origin = trace.get_current_span(propagate.extract(headers)).get_span_context()
            if origin.is_valid:
                links.append(Link(origin))
        span = self.tracer.start_span(
            f"process {delivery.queue}",
            kind=SpanKind.CONSUMER,
            links=links,
            attributes={
                "messaging.system": SYSTEM,
                "messaging.operation.type": "process",
                "messaging.operation.name": "process",
                "messaging.destination.name": delivery.queue,
                "messaging.message.id": str(delivery.id),
                "messaging.message.conversation_id": delivery.key,
                "messaging.message.delivery_count": delivery.attempts,
            },
        )
        return span, context.attach(trace.set_span_in_context(span))

    def finished(self, delivery: Delivery, state: object, error: BaseException | None, duration: float) -> None:
        span, token = cast("tuple[trace.Span, Token[Context]]", state)
        context.detach(token)
        if error is not None:
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
            span.set_attribute("error.type", type(error).__qualname__)
        span.end()


_enabled: Tracing | None = None


def enable(tracer_provider: TracerProvider | None = None) -> Tracing:
    """Trace offers and deliveries from now on (with the global tracer provider unless one is given)."""
    global _enabled
    if _missing is not None:
        raise MissingExtraError(
            f"delayq.tracing needs opentelemetry-api ({_missing.name} is not installed): {install_hint('otel')}"
        )
    disable()
    _enabled = Tracing(tracer_provider)
    observe.add(_enabled)
    return _enabled


def disable() -> None:
    """Stop tracing."""
    global _enabled
    if _enabled is not None:
        observe.remove(_enabled)
        _enabled = None
