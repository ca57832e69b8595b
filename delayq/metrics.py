"""Prometheus metrics (the ``delayq[metrics]`` extra, prometheus-client).

``register(registry, queues)`` installs delayq's metrics in a registry (the application's own, or
prometheus-client's default) and starts counting; ``serve(port, queues)`` also serves them over HTTP,
as ``delayq worker --metrics-port N`` does. What is exported:

- counters per queue: ``delayq_offered_total``, ``delayq_delivered_total``, ``delayq_acked_total``,
  ``delayq_retried_total``, ``delayq_dead_lettered_total``, ``delayq_lock_lost_total`` (a delivery whose
  lock was found gone counts once, whether its heartbeat, its ack, its retry or its dead letter found it);
- histograms per queue: ``delayq_handler_duration_seconds`` (with ``outcome``: success, failure, or
  retry and dead_letter for a handler that raised ``Retry`` or ``DeadLetter``) and
  ``delayq_pickup_latency_seconds`` (from a message's due time to its handler's start; clocks of the
  database and of the worker's host both count);
- with ``tag_labels`` (off by default): ``delayq_delivered_total`` and ``delayq_handler_duration_seconds`` also
  carry a ``tags`` label, the message's tags (``offer(tags=...)``) joined by commas, "" for none. Each distinct
  combination is a series of its own per queue (and outcome): ``tag_labels=True`` labels every tag, so a tag
  that takes many values (a customer id) multiplies the series without bound; a list of tags labels only those
  (the others are left out of the label), which bounds them to the combinations of that list;
- gauges per queue, read at scrape time with one ``stats()`` statement and one read of its flow row per
  queue (none between scrapes): ``delayq_ready``, ``delayq_scheduled``, ``delayq_in_flight``,
  ``delayq_expired_locks``, ``delayq_dead``, ``delayq_oldest_due_age_seconds``, ``delayq_paused``.

Topics (``register(..., topics=[Topic, ...])`` for the gauges):

- counters: ``delayq_topic_published_total`` (label ``topic``), and per ``topic`` and ``group``
  ``delayq_topic_delivered_total``, ``delayq_topic_acked_total``, ``delayq_topic_nacked_total``,
  ``delayq_topic_dead_total`` (moved to ``{topic}_dlq``), ``delayq_topic_lease_lost_total``,
  ``delayq_topic_rebalances_total`` (rebalances that changed what a subscriber holds);
  ``delayq_topic_collected_total`` (``topic``: messages the worker's garbage collection deleted);
- a histogram per topic, group and outcome: ``delayq_topic_handler_duration_seconds`` (from the poll to
  the outcome recorded);
- gauges per watched topic and group, read at scrape time (``list_groups``: three reads per topic):
  ``delayq_topic_lag`` (messages published and not yet done), ``delayq_topic_in_flight``,
  ``delayq_topic_subscribers``.

Counting costs a dictionary look-up and a locked add per event (the Prometheus families are built when
scraped): nothing a worker's database work notices.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, get_args

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from delayq import observe
from delayq.tags import check_tag

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from delayq.messages import Delivery
    from delayq.queue import DelayedQueue
    from delayq.topics import Topic, TopicDelivery

__all__ = ["Metrics", "register", "serve"]

log = logging.getLogger("delayq.metrics")

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
GAUGES = {
    "ready": "Messages due and not held by a consumer.",
    "scheduled": "Messages not yet due.",
    "in_flight": "Messages held by a consumer whose lock has not expired.",
    "expired_locks": "Messages held by a consumer whose lock expired (due for redelivery).",
    "dead": "Dead letters.",
}


COUNTERS = {
    "offered": "Messages offered (created or replaced).",
    "delivered": "Deliveries started by a worker's handler.",
    "acked": "Messages acked (deleted after their handler returned).",
    "retried": "Failed attempts released for a later one.",
    "dead_lettered": "Messages moved to the dead letters.",
    "lock_lost": "Deliveries whose lock was found gone (by a heartbeat, ack, retry or dead letter), once each.",
    "overdue": "Handlers found running past their Handler.timeout, once each (label: the queue or topic).",
}
TOPIC_COUNTERS: dict[observe.TopicEvent, tuple[str, str]] = {  # event: (metric, help)
    "published": ("topic_published", "Messages published to a topic (created, not ignored duplicates)."),
    "delivered": ("topic_delivered", "Topic messages handed to a worker's handler, per consumer group."),
    "acked": ("topic_acked", "Topic messages acked after their handler returned, per consumer group."),
    "nacked": ("topic_nacked", "Failed topic deliveries nacked for a later attempt, per consumer group."),
    "dead": ("topic_dead", "Topic messages moved to the dead-letter topic, per consumer group."),
    "lease_lost": ("topic_lease_lost", "Topic deliveries whose lease or delivery was found gone, per group."),
    "rebalanced": ("topic_rebalances", "Rebalances that changed the partitions a subscriber holds, per group."),
    "collected": ("topic_collected", "Topic messages deleted by the worker's garbage collection."),
}
TOPIC_GAUGES = {
    "lag": "Messages of a topic published and not yet done by a consumer group.",
    "in_flight": "A consumer group's topic deliveries in flight or waiting out a nack.",
    "subscribers": "A consumer group's live subscribers.",
}
HISTOGRAMS = {  # name: (help, labels, bucket bounds)
    "handler_duration_seconds": ("Seconds a handler ran.", ("queue", "outcome"), DURATION_BUCKETS),
    "pickup_latency_seconds": (
        "Seconds from a message's due time to its handler's start.",
        ("queue",),
        LATENCY_BUCKETS,
    ),
}


class _Histogram:
    """One labelled histogram's observations: a count per bucket (not cumulative) and their sum."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # the first bound >= value: Prometheus' "le"
        self.total += value


OUTCOMES: tuple[observe.Outcome, ...] = get_args(observe.Outcome)


class _QueueTally:
    """What one queue's deliveries added up to: a worker finds it with one look-up per delivery."""

    __slots__ = ("delivered", "durations", "latency")

    def __init__(self) -> None:
        self.delivered = 0
        self.latency = _Histogram(LATENCY_BUCKETS)
        self.durations = {o: _Histogram(DURATION_BUCKETS) for o in OUTCOMES}


TagLabels = bool | Iterable[str]
"""Whether deliveries' metrics carry a ``tags`` label: False (no label), True (every tag), or the tags to label."""


class Metrics(observe.Observer, Collector):
    """delayq's metrics in one registry; an ``Observer`` once installed (``register`` does both).

    Events are added up in plain numbers under one lock, and become Prometheus metric families only
    when scraped: about 3 µs of CPU per delivery, the observer calls included, where prometheus-client's own
    counters and histograms (a lock each, for the count, the sum and the bucket) took 7 µs without them.
    """

    reads_database = False

    def __init__(
        self,
        registry: CollectorRegistry,
        queues: Iterable[DelayedQueue] = (),
        topics: Iterable[Topic] = (),
        *,
        tag_labels: TagLabels = False,
    ) -> None:
        self.queues: list[DelayedQueue] = list(queues)
        self.topics: list[Topic] = list(topics)
        self._topic_counts: dict[tuple[str, str, str], int] = {}  # (event, topic, group)
        self._topic_durations: dict[tuple[str, str, str], _Histogram] = {}  # (topic, group, outcome)
        self._lock = threading.Lock()  # the queues watched
        self._counting = threading.Lock()  # the numbers below
        self._counts: dict[tuple[str, str], int] = {}  # (event, queue), deliveries apart
        # Per queue (and its ``tags`` label, with tag labels on): deliveries, their latency and duration.
        self._tallies: dict[tuple[str, str | None], _QueueTally] = {}
        self._tagged = tag_labels is not False
        self._allowed: frozenset[str] | None = (
            None if isinstance(tag_labels, bool) else frozenset(check_tag(t) for t in tag_labels)
        )
        registry.register(self)

    def _label(self, delivery: Delivery) -> tuple[str, str | None]:
        """The tally of a delivery: its queue, and its ``tags`` label when tag labels are on."""
        if not self._tagged:
            return delivery.queue, None
        tags = delivery.tags
        if self._allowed is not None:
            tags = tuple(t for t in tags if t in self._allowed)
        return delivery.queue, ",".join(tags)

    # -- observer -------------------------------------------------------------------------------
    def started(self, delivery: Delivery) -> object:
        at = self._label(delivery)
        latency = max(0.0, time.time() - delivery.scheduled_at.timestamp())
        with self._counting:
            tally = self._tallies.get(at) or self._tallies.setdefault(at, _QueueTally())
            tally.delivered += 1
            tally.latency.observe(latency)
        return None

    def finished(self, delivery: Delivery, state: object, error: BaseException | None, duration: float) -> None:
        at = self._label(delivery)
        with self._counting:
            tally = self._tallies.get(at) or self._tallies.setdefault(at, _QueueTally())
            tally.durations[observe.outcome(error, delivery)].observe(duration)

    def counted(self, event: observe.Event, queue: str, n: int) -> None:
        key = (event, queue)
        with self._counting:
            self._counts[key] = self._counts.get(key, 0) + n

    def topic_counted(self, event: observe.TopicEvent, topic: str, group: str, n: int) -> None:
        key = (event, topic, group)
        with self._counting:
            self._topic_counts[key] = self._topic_counts.get(key, 0) + n

    def topic_finished(
        self, delivery: TopicDelivery, group: str, state: object, error: BaseException | None, duration: float
    ) -> None:
        key = (delivery.topic, group, observe.outcome(error))
        with self._counting:
            h = self._topic_durations.get(key) or self._topic_durations.setdefault(key, _Histogram(DURATION_BUCKETS))
            h.observe(duration)

    # -- collector: what a scrape reads -------------------------------------------------------------
    def watch(self, queues: Iterable[DelayedQueue], topics: Iterable[Topic] = ()) -> None:
        """Also export the gauges of ``queues`` and ``topics`` (each once, by name)."""
        with self._lock:
            names = {q.name for q in self.queues}
            self.queues += [q for q in queues if q.name not in names]
            known = {t.name for t in self.topics}
            for t in topics:
                if t.name not in known:
                    known.add(t.name)
                    self.topics.append(t)

    def describe(self) -> list[Metric]:
        return []  # the gauges are read at scrape time only: never while registering

    def collect(self) -> Iterator[Metric]:
        yield from self._collect_events()
        yield from self._collect_gauges()
        yield from self._collect_topic_events()
        yield from self._collect_topic_gauges()

    def _collect_topic_events(self) -> Iterator[Metric]:
        with self._counting:
            counts = dict(self._topic_counts)
            durations = [(key, list(h.counts), h.total) for key, h in self._topic_durations.items()]
        for event, (name, doc) in TOPIC_COUNTERS.items():
            topic_wide = event in ("published", "collected")
            counter = CounterMetricFamily(f"delayq_{name}", doc, labels=["topic"] if topic_wide else ["topic", "group"])
            for (e, topic, group), value in sorted(counts.items()):
                if e == event:
                    counter.add_metric([topic] if topic_wide else [topic, group], value)
            yield counter
        family = HistogramMetricFamily(
            "delayq_topic_handler_duration_seconds",
            "Seconds from a topic delivery's poll to its outcome recorded.",
            labels=["topic", "group", "outcome"],
        )
        les = [*(repr(float(b)) for b in DURATION_BUCKETS), "+Inf"]
        for labels, per_bucket, total in sorted(durations):
            family.add_metric(list(labels), list(zip(les, itertools.accumulate(per_bucket), strict=True)), total)
        yield family

    def _collect_topic_gauges(self) -> Iterator[Metric]:
        from delayq.topics.views import list_groups

        with self._lock:
            topics = list(self.topics)
        families = {
            name: GaugeMetricFamily(f"delayq_topic_{name}", doc, labels=["topic", "group"])
            for name, doc in TOPIC_GAUGES.items()
        }
        for t in topics:
            try:
                groups = list_groups(t.ctx.engine, t.name, table_prefix=t.ctx.prefix, schema=t.ctx.schema)
            except Exception as exc:  # a scrape never fails for one topic's trouble
                log.warning("metrics: groups of topic %s failed: %s", t.name, exc)
                continue
            for g in groups:
                families["lag"].add_metric([t.name, g.group], g.lag)
                families["in_flight"].add_metric([t.name, g.group], g.pending)
                families["subscribers"].add_metric([t.name, g.group], g.subscribers)
        yield from families.values()

    def _collect_events(self) -> Iterator[Metric]:
        tagged = ("tags",) if self._tagged else ()
        with self._counting:
            counts = dict(self._counts)
            delivered: dict[tuple[str, ...], int] = {}
            latency: dict[str, _Histogram] = {}  # per queue: the tags apart (summed below)
            observed: dict[str, list[tuple[tuple[str, ...], list[int], float]]] = {name: [] for name in HISTOGRAMS}
            for (queue, tags), tally in self._tallies.items():
                labels: tuple[str, ...] = (queue,) if tags is None else (queue, tags)
                delivered[labels] = tally.delivered
                merged = latency.setdefault(queue, _Histogram(LATENCY_BUCKETS))
                merged.counts = [a + b for a, b in zip(merged.counts, tally.latency.counts, strict=True)]
                merged.total += tally.latency.total
                for o, h in tally.durations.items():
                    if any(h.counts):  # a series appears with its first observation
                        observed["handler_duration_seconds"].append(
                            ((*labels[:1], o, *labels[1:]), list(h.counts), h.total)
                        )
            for queue, h in latency.items():
                if any(h.counts):
                    observed["pickup_latency_seconds"].append(((queue,), list(h.counts), h.total))
        for event, doc in COUNTERS.items():
            if event == "delivered":
                counter = CounterMetricFamily(f"delayq_{event}", doc, labels=["queue", *tagged])
                for series, value in delivered.items():
                    counter.add_metric(list(series), value)
                yield counter
                continue
            counter = CounterMetricFamily(f"delayq_{event}", doc, labels=["queue"])
            for (name, queue), value in counts.items():
                if name == event:
                    counter.add_metric([queue], value)
            yield counter
        for histogram, (doc, label_names, bounds) in HISTOGRAMS.items():
            names = [*label_names, *tagged] if histogram == "handler_duration_seconds" else list(label_names)
            family = HistogramMetricFamily(f"delayq_{histogram}", doc, labels=names)
            les = [*(repr(float(b)) for b in bounds), "+Inf"]  # as prometheus-client writes them
            for label_values, per_bucket, total in observed[histogram]:
                cumulative = itertools.accumulate(per_bucket)
                family.add_metric(list(label_values), list(zip(les, cumulative, strict=True)), total)
            yield family

    def _collect_gauges(self) -> Iterator[Metric]:
        with self._lock:
            queues = list(self.queues)
        families = {name: GaugeMetricFamily(f"delayq_{name}", doc, labels=["queue"]) for name, doc in GAUGES.items()}
        age = GaugeMetricFamily(
            "delayq_oldest_due_age_seconds",
            "Seconds the oldest due message has waited (0 when none).",
            labels=["queue"],
        )
        paused = GaugeMetricFamily(
            "delayq_paused", "1 while the queue is paused (delayq pause), else 0.", labels=["queue"]
        )
        for q in queues:
            try:
                s, flow = q.stats(), q.flow()
            except Exception as exc:  # a scrape never fails for one queue's trouble
                log.warning("metrics: stats of queue %s failed: %s", q.name, exc)
                continue
            for name in GAUGES:
                families[name].add_metric([q.name], getattr(s, name))
            age.add_metric([q.name], 0.0 if s.oldest_due_age is None else s.oldest_due_age.total_seconds())
            paused.add_metric([q.name], float(flow.paused))
        yield from families.values()
        yield age
        yield paused


_installed: dict[int, Metrics] = {}
_install_lock = threading.Lock()


def register(
    registry: CollectorRegistry | None = None,
    queues: Sequence[DelayedQueue] = (),
    topics: Sequence[Topic] = (),
    *,
    tag_labels: TagLabels = False,
) -> Metrics:
    """Install delayq's metrics in ``registry`` (prometheus-client's default one when None) and start counting.

    ``queues`` get the per-queue gauges, ``topics`` the per-group ones. ``tag_labels``: label deliveries' metrics
    with their tags (all with True, or only those listed; see the module's docstring on cardinality). Calling it
    again with the same registry returns the same ``Metrics`` (watching the new queues and topics too; its
    ``tag_labels`` stay as first registered).
    """
    reg = REGISTRY if registry is None else registry
    with _install_lock:
        metrics = _installed.get(id(reg))
        if metrics is None:
            metrics = _installed[id(reg)] = Metrics(reg, tag_labels=tag_labels)
            observe.add(metrics)
    metrics.watch(queues, topics)
    return metrics


def unregister(metrics: Metrics, registry: CollectorRegistry | None = None) -> None:
    """Stop counting into ``metrics`` and take it out of ``registry``."""
    reg = REGISTRY if registry is None else registry
    observe.remove(metrics)
    with _install_lock:
        _installed.pop(id(reg), None)
    reg.unregister(metrics)


def serve(
    port: int,
    queues: Sequence[DelayedQueue] = (),
    *,
    addr: str = "0.0.0.0",
    registry: CollectorRegistry | None = None,
    topics: Sequence[Topic] = (),
    tag_labels: TagLabels = False,
) -> Callable[[], None]:
    """Register the metrics (``register``) and serve ``/metrics`` on ``addr:port`` from a daemon thread; returns
    a stop function."""
    reg = REGISTRY if registry is None else registry
    register(reg, queues, topics, tag_labels=tag_labels)
    server, thread = start_http_server(port, addr, registry=reg)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)

    return stop
