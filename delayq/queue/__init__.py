"""DelayedQueue: offer messages due at a time, poll the due ones under a lock, ack them.

The class is made of one part per job, each in its own module: ``_offer`` (the offer path), ``_claims``
(claim, ack, extend, retry, dead-letter, give back), ``_queued`` (operations on queued messages),
``_dead`` (the dead letters), ``_bulk`` (cancel, requeue, purge, reschedule and count on a filter, in
batches), on ``_base`` (the constructor, transactions, "now", decoding); ``_checks`` validates what callers
pass, ``_tokens`` makes lock tokens, ``_lost`` counts lost locks.
"""

from __future__ import annotations

from delayq.queue._bulk import BULK_BATCH as BULK_BATCH
from delayq.queue._bulk import BulkOutcome as BulkOutcome
from delayq.queue._bulk import _Bulk
from delayq.queue._checks import At as At
from delayq.queue._checks import check_key as check_key
from delayq.queue._checks import check_prefix as check_prefix
from delayq.queue._checks import check_queue_name as check_queue_name
from delayq.queue._checks import check_text as check_text
from delayq.queue._claims import _Claims
from delayq.queue._dead import _DeadLetters
from delayq.queue._flow import MAX_PRIORITY as MAX_PRIORITY
from delayq.queue._flow import MIN_PRIORITY as MIN_PRIORITY
from delayq.queue._flow import check_priority as check_priority
from delayq.queue._offer import OFFER_CHUNK as OFFER_CHUNK
from delayq.queue._offer import _Offers
from delayq.queue._queued import _Queued
from delayq.queue._tokens import claimed_at as claimed_at
from delayq.queue._tokens import new_token as new_token
from delayq.transactions import Using

__all__ = ["At", "BulkOutcome", "DelayedQueue", "Using"]


class DelayedQueue(_Offers, _Claims, _Bulk, _Queued, _DeadLetters):
    """One named queue of delayed messages in a relational database.

    Args:
        engine: the SQLAlchemy engine of the database holding delayq's tables.
        name: the queue's name (at most 100 characters); queues share the tables.
        visibility_timeout: how long a polled message stays locked before it is delivered
            again. Defaults to 5 minutes.
        serializer: encodes payloads; defaults to ``JsonSerializer()``.
        clock: where "now" comes from; defaults to the database's clock, read inside each
            statement. Pass a ``ManualClock`` to move time by hand.
        table_prefix, schema: where the tables are; default ``delayq_messages`` and
            ``delayq_dead_letters`` in the connection's default schema.
        transient_retry: how delayq retries its own transactions; see ``TransientRetry``.
        notify: on PostgreSQL, wake listening workers (NOTIFY) when an offer commits. True.
        flow_refresh: how long a claimer keeps the queue's flow settings (``pause``, priorities) before it
            reads them again: a pause counts within this long. 1 second by default; 0 reads them at every claim.
        max_deliveries: a claim that would deliver a message for the ``max_deliveries + 1``-th
            time moves it to the dead letters instead ("delivered N times without an outcome"):
            a message whose consumer dies every time does not come back forever. None (no cap)
            by default; a ``Worker`` sets its handler's ``retry.max_attempts``.
        retention: how long an acked message is kept as ``completed`` (its result, duration and attempts
            readable with ``get``) before the worker's pruner deletes it. 0 (the default): the ack deletes it.
        keep_results: with a history kept, store what the handler returned (serialized by ``serializer``).
            True.
        result_limit: the largest result kept, in bytes once serialized; a larger one is dropped with a
            warning (the message is still completed). 64 KiB.
        unique_for: the default of ``offer(unique_for=)``: the key is ignored while a message with it is
            live or completed within this long. None.
        dead_letter_retention: how long a dead letter is kept before the pruner deletes it. None: until
            requeued or purged.

    Every operation takes ``using=``: None or an ``Engine`` runs it in delayq's own
    transaction; a ``Connection`` or ``Session`` makes it part of the caller's transaction.
    """
