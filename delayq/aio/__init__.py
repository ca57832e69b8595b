"""delayq for asyncio applications: the same queue, topics and worker, awaited.

``AsyncDelayedQueue``, ``AsyncTopic`` and ``AsyncSubscription`` take an ``AsyncEngine``; ``using=``
takes an ``AsyncConnection`` or an ``AsyncSession``. Every operation runs delayq's sync core inside
SQLAlchemy's greenlets (the statements, validation and outcomes are the sync API's own); see
docs/asyncio.md.
"""

from delayq.aio.bridge import AsyncUsing
from delayq.aio.queue import AsyncDelayedQueue, AsyncDelivery
from delayq.aio.topics import AsyncSubscription, AsyncTopic
from delayq.aio.worker import AsyncHandler, AsyncWorker

__all__ = [
    "AsyncDelayedQueue",
    "AsyncDelivery",
    "AsyncHandler",
    "AsyncSubscription",
    "AsyncTopic",
    "AsyncUsing",
    "AsyncWorker",
]
