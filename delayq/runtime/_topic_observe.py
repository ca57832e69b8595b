"""What observers (metrics, tracing) hear of a worker's topic deliveries: one ``started`` at the poll,
the outcome events as they are recorded, one ``finished`` when the worker forgets the delivery.

Both drivers reach it through ``TopicConsumer`` (its poll, outcome and ``forget`` steps), so the
threads and the asyncio worker report alike. The state between the calls is kept here, by job, not
on the job: the topic source's records stay as they are.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Protocol

from delayq import observe
from delayq.topics import _headers
from delayq.topics.delivery import TopicDelivery
from delayq.topics.subscription import Subscription


class _Consumer(Protocol):
    @property
    def sub(self) -> Subscription: ...


class _Job(Protocol):
    @property
    def delivery(self) -> TopicDelivery: ...


_lock = threading.Lock()
_open: dict[int, tuple[list[tuple[observe.Observer, object]], float, list[BaseException | None]]] = {}


def started(consumer: _Consumer, job: _Job) -> None:
    """The poll handed ``job`` to its handler: count it delivered, and tell the observers."""
    d, group = job.delivery, consumer.sub.group
    observe.count_topic("delivered", d.topic, group)
    observers = observe.topic_handlers()
    if not observers:
        return
    headers: dict[str, str] = {}
    if observe.traces_topics():
        try:
            headers = _headers.read(consumer.sub.ctx, d.topic, d.partition, d.offset)
        except Exception:  # the span goes without its link; the delivery is not failed for it
            headers = {}
    states = [(o, o.topic_started(d, group, headers)) for o in observers]
    with _lock:
        _open[id(job)] = (states, time.perf_counter(), [None])


@contextlib.contextmanager
def running(job: _Job) -> Iterator[None]:
    """Around the handler's call, in its thread or task: what the observers run there (tracing: the
    delivery's span made current)."""
    with _lock:
        found = _open.get(id(job))
    if found is None:
        yield
        return
    with contextlib.ExitStack() as stack:
        for o, state in found[0]:
            around = o.topic_running(state)
            if around is not None:
                stack.enter_context(around)
        yield


def outcome(consumer: _Consumer, job: _Job, event: observe.TopicEvent, error: BaseException | None) -> None:
    """An outcome of ``job`` was recorded (or found lost): count it, and keep the error for ``finished``."""
    observe.count_topic(event, job.delivery.topic, consumer.sub.group)
    with _lock:
        found = _open.get(id(job))
        if found is not None and error is not None:
            found[2][0] = error


def finished(consumer: _Consumer, job: _Job) -> None:
    """The worker forgot ``job``: the observers hear of its end (once)."""
    with _lock:
        found = _open.pop(id(job), None)
    if found is None:
        return
    states, began, error = found
    duration = time.perf_counter() - began
    for o, state in reversed(states):
        o.topic_finished(job.delivery, consumer.sub.group, state, error[0], duration)


def rebalanced(consumer: _Consumer) -> None:
    """A rebalance changed the partitions ``consumer`` holds."""
    observe.count_topic("rebalanced", consumer.sub.topic, consumer.sub.group)
