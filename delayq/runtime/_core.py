"""The one worker core: its sources, slots, fair fetch, heartbeats, acks, outcomes and shutdown steps.

Both drivers compose it: ``Worker`` runs its steps from threads, ``AsyncWorker`` from asyncio tasks
(each step in a SQLAlchemy greenlet, bounded by the stall timeout). The core decides; a driver
only says how a job's handler starts (a pool thread, a task), how it waits and how its loops run.
Every step here is synchronous and thread-safe where two loops share it.

What the core owns:

- the sources (``QueueSource`` per queue handler, ``TopicConsumer`` per topic handler) and the
  slots: ``free_slots()`` is ``concurrency`` less the jobs held; ``fetch`` claims only for free
  slots, shared fairly between the sources with due work (round robin, equal shares, leftovers
  to the others);
- the jobs (``Jobs``): heartbeats (``beat``), batched acks (``flush_acks``), give-backs;
- the outcome of a failed attempt (the sources', through ``delayq._outcome``'s one decision);
- per-job timeouts (``newly_overdue``: a thread handler is reported, an asyncio one cancelled);
- wake-up timing (``until_next_due``), schedules (``schedules``) and the stop state.
"""

from __future__ import annotations

import datetime as dt
import inspect
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import sqlalchemy as sa

from delayq import observe
from delayq.clock import Clock
from delayq.cron import ScheduleRunner, schedules_for
from delayq.dialects import bounds, dialect_for
from delayq.dialects._pg_listen import CANCELLED
from delayq.errors import DeliveryCancelledError, InvalidInputError
from delayq.handler import Handler
from delayq.messages import Delivery
from delayq.queue import DelayedQueue
from delayq.runtime._chores import PruneChore
from delayq.runtime._jobs import Job, Jobs, cancels_among, describe, overdue
from delayq.runtime._registry import Registry, topic_labels
from delayq.runtime._sources import QueueSource, StartQueueJob
from delayq.runtime._topic_gc import TopicCollector
from delayq.runtime._topics import Start as StartTopicJob
from delayq.runtime._topics import TopicConsumer, TopicConsumers, TopicJob
from delayq.schema import make_tables
from delayq.topics import _wake as topic_wake
from delayq.topics.handler import TopicHandler
from delayq.transactions import DEFAULT_RETRY, TransientRetry

log = logging.getLogger("delayq.worker")

SIGNAL_GRACE = 10.0
"""Seconds past ``shutdown_timeout`` after a SIGINT/SIGTERM at which the process exits whatever blocks."""
MIN_IDLE_SLEEP = 0.01
ACK_GATHER = 0.002  # seconds the ack loop lets a batch of handlers finish before it acks them together
FETCH_GATHER = 0.002  # seconds the fetch loop, after a claim, lets handlers free slots to claim for together
MAX_ERROR_BACKOFF = 5.0
HEARTBEAT_TICK = 0.05
FLOW_REFRESH = dt.timedelta(seconds=1)  # the longest a worker's queue keeps its flow state (pause, limits)


def backoff(errors: int) -> float:
    """Seconds to wait after ``errors`` failures in a row: 0.2 s doubling to 5 s."""
    return float(min(MAX_ERROR_BACKOFF, 0.1 * 2 ** min(errors, 10)))


@dataclass(frozen=True)
class WorkerHealth:
    """A snapshot of a worker's state, for an embedding application's health check."""

    running: bool
    """Started and not yet stopped."""
    loops: Mapping[str, bool]
    """Whether each background loop ("fetch", "heartbeat", "listen" on PostgreSQL, "topics" with topic
    handlers) is alive."""
    seconds_since_fetch: float | None
    """Monotonic seconds since a claim last reached the database (whatever it found); None before the first."""
    held: int
    """Deliveries held: handlers running, and handled messages awaiting their ack (or topic outcome)."""
    stuck: int = 0
    """Handlers running past their ``Handler.timeout``: their slots (and messages) stay taken while they run."""

    @property
    def healthy(self) -> bool:
        """Running, with every loop alive."""
        return self.running and all(self.loops.values())


class NotBegun(Exception):
    """A transactional handler's transaction could not begin (no connection): the handler did not run."""


class Core:
    """The state and the steps of one worker, whichever driver runs them (see the module's docstring).

    ``transient_retry``: how its queues retry their own transactions (the asyncio driver passes none: its
    loops back off instead; the chores' retries pause with ``asyncio.sleep`` there, ``delayq.transactions``)."""

    def __init__(
        self,
        engine: sa.Engine,
        handlers: Iterable[Handler | type[Handler]],
        *,
        concurrency: int,
        poll_interval: dt.timedelta,
        shutdown_timeout: dt.timedelta,
        clock: Clock | None,
        table_prefix: str,
        schema: str | None,
        listen: bool,
        stall_timeout: dt.timedelta | None,
        coroutines: bool,
        transient_retry: TransientRetry = DEFAULT_RETRY,
    ) -> None:
        if concurrency < 1:
            raise InvalidInputError("concurrency must be at least 1")
        self.engine = engine
        self.handlers = [h() if isinstance(h, type) else h for h in handlers]
        if not self.handlers:
            raise InvalidInputError("a Worker needs at least one handler")
        self.concurrency = concurrency
        self.poll_interval = poll_interval.total_seconds()
        self.flow_refresh = min(FLOW_REFRESH, poll_interval)
        """How long the worker's queues keep their flow state (pause, limits) before they read it again: at
        most the poll interval, so a pause counts within one poll interval whatever it is."""
        self.shutdown_timeout = shutdown_timeout.total_seconds()
        self.clock = clock
        self.name = f"{socket.gethostname()[:150]}:{os.getpid()}:{secrets.token_hex(3)}"
        for h in self.handlers:
            timeout = h.timeout
            if timeout is not None and (not isinstance(timeout, dt.timedelta) or timeout <= dt.timedelta(0)):
                raise InvalidInputError(f"{type(h).__name__}.timeout must be a positive timedelta or None")
            if inspect.iscoroutinefunction(h.handle) and not coroutines:
                raise InvalidInputError(
                    f"{type(h).__name__}.handle is a coroutine (async def): run it with delayq.aio.AsyncWorker"
                )
        self.topics = TopicConsumers(
            engine,
            [h for h in self.handlers if isinstance(h, TopicHandler)],
            self.name,
            clock=clock,
            table_prefix=table_prefix,
            schema=schema,
            backoff=backoff,
        )
        self.topic_gc = TopicCollector(
            engine,
            [h for h in self.handlers if isinstance(h, TopicHandler)],
            table_prefix=table_prefix,
            schema=schema,
            backoff=backoff,
            clock=clock,
        )
        """The garbage collector of the topics read (empty without topic handlers, or where none collects)."""
        self.jobs = Jobs(clock)
        queue_handlers = [h for h in self.handlers if not isinstance(h, TopicHandler)]
        self.queue_sources: dict[str, QueueSource] = {}
        for h in queue_handlers:
            name = getattr(h, "queue", None)
            if not isinstance(name, str):
                raise InvalidInputError(f"{type(h).__name__} must set the class attribute `queue`")
            if name in self.queue_sources:
                raise InvalidInputError(f"two handlers for queue {name!r}")
            q = DelayedQueue(
                engine,
                name,
                serializer=h.serializer,
                visibility_timeout=h.visibility_timeout,
                clock=clock,
                table_prefix=table_prefix,
                schema=schema,
                max_deliveries=h.retry.max_attempts,
                flow_refresh=self.flow_refresh,
                transient_retry=transient_retry,
                **h._lifecycle_options(),
            )
            self.queue_sources[name] = QueueSource(h, q, self.jobs)
        self.sources: list[QueueSource | TopicConsumer] = [*self.queue_sources.values(), *self.topics.consumers]
        self.schedules = ScheduleRunner(self.queues, schedules_for(queue_handlers))
        self.pruner = (
            PruneChore(engine, self.name, table_prefix=table_prefix, schema=schema, clock=clock)
            if self.queue_sources
            else None
        )
        """The pruner of kept rows (one worker at a time prunes); None without queue handlers."""
        self.channel = make_tables(table_prefix, schema).messages.name
        """The LISTEN channel: queue offers notify their queue's name, topic publishes ``topic:{name}``."""
        self._wakers = set(self.queue_sources) | {topic_wake.payload(c.sub.topic) for c in self.topics.consumers}
        self.listens = listen and dialect_for(engine).can_notify
        self.stall_timeout = None if stall_timeout is None else stall_timeout.total_seconds()
        self.stopping = threading.Event()
        """Set: no new claims (a stop was asked)."""
        self.stopped = threading.Event()
        """Set: not running (the driver's loops have ended; kept jobs may still be extended)."""
        self.stopped.set()
        self.last_fetch: float | None = None
        self._turn = 0  # the source that claims first on the next fetch (round robin)
        dialect = dialect_for(engine)
        self._probe = dialect.claim_mode_for(1) != dialect.claim_mode_for(2)
        """Whether a claim of one costs fewer round trips than a batch (PostgreSQL: one autocommitted
        statement, against BEGIN + SET LOCAL, the claim, COMMIT): then an idle worker claims one first."""
        self._idle = True  # the last fetch started nothing
        self.registry = Registry(
            engine,
            make_tables(table_prefix, schema),
            name=self.name,
            driver="asyncio" if coroutines else "threads",
            queues=list(self.queue_sources),
            topics=topic_labels([(c.sub.topic, c.sub.group) for c in self.topics.consumers]),
            slots=concurrency,
            clock=clock,
            jobs=self.jobs,
            consumers=self.topics.consumers,
        )
        """This worker's row in the worker registry (``delayq workers``): ``register`` at the start, a beat with
        the heartbeat's (what the handlers run, the outcomes counted), ``deregister`` at a clean stop. Never raises."""
        for q in self.queues:
            q._tally = self.registry.tally.count  # the queue history: each outcome counted as it is recorded
            q._worker_id = self.registry.id  # its claims' kept outcomes record this worker (finished.worker)

    def wakes(self, payload: str) -> bool:
        """Whether a notification's payload names one of this worker's queues or topics."""
        return payload in self._wakers

    @property
    def queues(self) -> Sequence[DelayedQueue]:
        return [s.queue for s in self.queue_sources.values()]

    # -- slots and the fetch --------------------------------------------------------------------
    def free_slots(self) -> int:
        return self.concurrency - self.jobs.running() - self.topics.running()

    def fetch(
        self, free: int, start_queue: StartQueueJob, start_topic: StartTopicJob, guard: bool = True
    ) -> list[Job | TopicJob]:
        """Claim up to ``free`` messages, shared fairly between the sources, and start their handlers.

        Sources take turns to claim first; each gets an equal share of the free slots, and what one
        leaves (it had fewer due) goes to the others in further passes. A failed claim backs its
        source off (logged); with ``guard=False`` it raises.

        When the last fetch started nothing (the worker was idle) and a claim of one is cheaper than a
        batch on this database, queue sources claim one each until one is found, its handler started
        at once; the rest of the free slots are claimed in batches by the passes after it. An idle
        worker's pickup then waits for one round trip, not a transaction's three.
        """
        sources = self.sources
        turn = self._turn
        if turn:
            sources = sources[turn:] + sources[:turn]
        self._turn = (turn + 1) % len(sources)
        now = time.monotonic()
        candidates = [s for s in sources if s.ready(now)]
        started: list[Job | TopicJob] = []
        stopping = self.stopping
        probe = self._probe and self._idle  # claim one first (see above) until one is found
        while free > 0 and candidates and not stopping.is_set():
            share, more = max(1, free // len(candidates)), []
            for source in candidates:
                if free == 0 or stopping.is_set():
                    break
                want = min(share, free)
                got: Sequence[Job | TopicJob] | None
                if isinstance(source, QueueSource):
                    if probe:
                        want = 1
                    got = source.claim(want, start_queue, guard, first=self.last_fetch is None, backoff=backoff)
                else:
                    got = source.claim(want, start_topic, guard)
                if got is None:
                    continue
                self.last_fetch = time.monotonic()
                if got:
                    probe = False
                    started += got
                    free -= len(got)
                if len(got) == want:
                    more.append(source)
            candidates = more
        self._idle = not started
        return started

    def until_next_due(self) -> float:
        """Seconds an idle fetch loop may sleep: the poll interval, never past a queue's next due message."""
        soonest = self.poll_interval
        for source in self.queue_sources.values():
            try:
                due = source.queue.next_due()
            except Exception:  # the claim reports database trouble; here it only shortens nothing
                return soonest
            if due is not None:
                soonest = min(soonest, due.total_seconds())
        return max(soonest, MIN_IDLE_SLEEP)

    # -- one queue job on a thread --------------------------------------------------------------
    def run_queue_job(self, job: Job) -> bool:
        """Run a queue job's handler on this thread and record a failure; True when its message awaits the ack."""
        handler, delivery = job.handler, job.delivery
        try:
            if handler.transactional:
                self._handle_in_transaction(handler, job.queue, delivery, self.stall_timeout)
                return False
            started = time.monotonic()
            with observe.handling(delivery):  # the delivery log, metrics and tracing hear of it
                result = handler.handle(delivery)
            delivery._finished_with(result, dt.timedelta(seconds=time.monotonic() - started))
            return True
        except DeliveryCancelledError:  # raise_if_cancelled: the lock is gone, nothing to record
            log.info("%s: its handler stopped: cancelled, or its lock lost", delivery.label)
        except NotBegun as exc:  # no connection for the handler: not an attempt, give it back
            log.warning("%s: its transaction could not begin (%s)", delivery.label, describe(exc.__cause__ or exc))
            self.jobs.release([job], "the handler's transaction could not begin")
        except Exception as exc:  # whatever the handler raised is a failed attempt, or Retry / DeadLetter
            if job.lost:  # cancelled, or the lock lost: a retry or dead letter would change nothing
                log.info("%s: failed after its lock was gone (%s); nothing recorded", delivery.label, describe(exc))
            else:
                QueueSource.record_failure(job, exc)
        return False

    def heard_cancel(self, payload: str) -> bool:
        """A notification on the listener's connection: True for a cancel (``CANCELLED`` + a message id), whose
        job this worker holds is then lost and its handler told; False for a wake-up (a queue name)."""
        if not payload.startswith(CANCELLED):
            return False
        try:
            msg_id = int(payload[len(CANCELLED) :])
        except ValueError:
            return True  # (not ours to act on)
        self.jobs.cancelled([msg_id])
        return True

    @staticmethod
    def _handle_in_transaction(
        handler: Handler, queue: DelayedQueue, delivery: Delivery, call_bound: float | None
    ) -> None:
        """Run the handler and the ack in one transaction; ``NotBegun`` when it could not begin.

        The server ends the transaction once idle for the visibility timeout (``queue.transaction``);
        the ack and the COMMIT, delayq's calls, are bounded by ``call_bound`` (the stall timeout)."""
        begun = lost = False
        try:
            with queue.transaction() as conn:
                begun = True
                started = time.monotonic()
                with observe.handling(delivery):  # begun: from here on it is an attempt
                    result = handler.handle(delivery, conn)
                took = dt.timedelta(seconds=time.monotonic() - started)
                bounds.arm(conn.connection.dbapi_connection, call_bound)  # until the COMMIT returns
                if not delivery.ack(result=result, duration=took, using=conn):
                    conn.rollback()
                    lost = True
        except Exception as exc:
            if begun:
                raise
            raise NotBegun from exc
        if lost and not cancels_among(queue, [delivery]):
            log.warning("%s: lock lost while handling; its writes were rolled back", delivery.label)

    # -- heartbeats, timeouts, acks -------------------------------------------------------------
    def beat(self) -> bool:
        """Extend the queue locks due (one statement per queue), then beat in the worker registry (every
        ``delayq.runtime._registry.BEAT`` seconds; never raises); False when an extension failed."""
        ok = self.jobs.beat()
        self.registry.beat(self.slots_in_use(), self.handled)
        return ok

    def slots_in_use(self) -> int:
        return self.concurrency - self.free_slots()

    def register(self) -> None:
        """Insert this worker's row in the registry (a failure is logged; the next beat tries again)."""
        self.registry.start(self.slots_in_use(), self.handled)

    def deregister(self) -> None:
        """Mark this worker stopped in the registry (a clean stop; a failure is logged)."""
        self.registry.stop(self.handled)

    def overdue_jobs(self) -> list[tuple[Job | TopicJob, str, dt.timedelta, str]]:
        """The jobs found running past their handler's ``timeout`` since the last call, each once:
        (job, its label, the timeout, the queue or topic it counts for)."""
        found: list[tuple[Job | TopicJob, str, dt.timedelta, str]] = []
        for job in self.jobs.newly_overdue():
            timeout = job.handler.timeout
            assert timeout is not None
            found.append((job, job.delivery.label, timeout, job.queue.name))
        for c in self.topics.consumers:
            for tj in c.newly_overdue():
                assert c.handler.timeout is not None
                found.append((tj, tj.label, c.handler.timeout, c.sub.topic))
        return found

    def report_overdue(self) -> None:
        """Warn of (and count) each thread handler found running past its ``timeout``, once (a thread cannot
        be stopped: its message stays held while it runs)."""
        for job in self.jobs.newly_overdue():
            timeout = job.handler.timeout
            assert timeout is not None
            overdue(job.delivery.label, time.monotonic() - job.started_at, timeout)
            observe.count("overdue", job.queue.name)

    def flush_acks(self) -> bool:
        """Ack the handled queue jobs (one statement per queue); a failure is logged, tried again next time.

        True when an ack committed for a queue under a concurrency limit or with groups (as its claims last
        read them): its claims counted those messages as running until now, so a claim that found nothing
        since may find work now, and the driver wakes its fetch loop rather than wait out the backoff."""
        try:
            acked = self.jobs.flush_acks()
        except Exception as exc:
            log.warning("could not ack: %s", describe(exc))
            return False
        return any(holds_slots(q) for q in acked)

    # -- shutdown -------------------------------------------------------------------------------
    def forget_unacked(self) -> None:
        """Forget the handled jobs whose acks could not go out (their locks run out by themselves)."""
        unacked = self.jobs.forget_handled()
        if unacked:
            log.warning("%d handled message(s) could not be acked; they return after their timeout", unacked)

    def warn_kept(self, running: int) -> None:
        log.warning(
            "%d handler(s) still running after %.0fs: their messages stay held (locks extended) until they "
            "return, or until the process ends",
            running,
            self.shutdown_timeout,
        )

    def on_stop_signal(self, signum: int, wake: Callable[[], None]) -> threading.Timer:
        """A SIGINT/SIGTERM: stop (``wake`` the fetch loop), and arm the exit that ends the process in bounded
        time whatever blocks (a driver call on a dead network); the driver cancels it once stopped."""
        log.info("signal %d: stopping (in-flight handlers may finish within %.0fs)", signum, self.shutdown_timeout)
        self.stopping.set()
        wake()
        limit = self.shutdown_timeout + SIGNAL_GRACE
        timer = threading.Timer(limit, exit_now, args=(signum, limit))
        timer.daemon = True
        timer.start()
        return timer

    # -- health ---------------------------------------------------------------------------------
    def health(self, loops: Callable[[], Mapping[str, bool]]) -> WorkerHealth:
        running = not self.stopped.is_set()
        last = self.last_fetch
        return WorkerHealth(
            running=running,
            loops=MappingProxyType({name: running and alive for name, alive in loops().items()}),
            seconds_since_fetch=None if last is None else time.monotonic() - last,
            held=len(self.jobs) + self.topics.running(),
            stuck=self.jobs.stuck() + self.topics.stuck(),
        )

    @property
    def handled(self) -> int:
        return self.jobs.handled + self.topics.handled

    def started_line(self) -> str:
        return (
            f"worker {self.name} started: queues {', '.join(self.queue_sources) or 'none'}; "
            f"topics {self.topics or 'none'}; concurrency {self.concurrency}"
        )


def holds_slots(queue: DelayedQueue) -> bool:
    """Whether the queue's claims, as last read (its cached flow state), count held messages against a
    limit: a concurrency limit, or groups."""
    state = queue._flow_state
    return state is not None and (state.concurrency is not None or state.grouped)


def exit_now(signum: int, after: float) -> None:
    """End the process now (a signal's exit timer ran out, or a second signal came)."""
    if after:
        log.error(
            "still not stopped %.0fs after signal %d: exiting now; held messages return after their timeout",
            after,
            signum,
        )
    logging.shutdown()
    os._exit(128 + signum)
