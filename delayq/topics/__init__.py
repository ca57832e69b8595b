"""Topics: an immutable, partitioned log with consumer groups (seed 004). See docs/topics.md.

``Topic`` publishes (idempotently, offsets in commit order per partition); ``Subscription`` is one
subscriber of a consumer group: it shares the partitions with the group's other subscribers under
fenced leases, polls, and acks, nacks or extends ``TopicDelivery`` objects. ``TopicHandler`` is a
topic's consumer that a worker runs beside queue handlers (``delayq.runtime._topics``).
"""

from delayq.topics.dead_letters import TopicDeadLetter
from delayq.topics.delivery import DeadLetterInfo, LeaseLostError, TopicDelivery
from delayq.topics.handler import TopicHandler
from delayq.topics.names import DLQ_SUFFIX, dead_letter_topic, partition_for
from delayq.topics.subscription import Subscription
from delayq.topics.topic import PartitionInfo, Topic
from delayq.topics.views import GroupSummary, PartitionLag, TopicSummary, group_lag, list_groups, list_topics

__all__ = [
    "DLQ_SUFFIX",
    "DeadLetterInfo",
    "GroupSummary",
    "LeaseLostError",
    "PartitionInfo",
    "PartitionLag",
    "Subscription",
    "Topic",
    "TopicDeadLetter",
    "TopicDelivery",
    "TopicHandler",
    "TopicSummary",
    "dead_letter_topic",
    "group_lag",
    "list_groups",
    "list_topics",
    "partition_for",
]
