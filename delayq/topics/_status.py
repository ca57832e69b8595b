"""The values of ``topic_deliveries.status`` (a leaf: imports nothing of delayq)."""

PENDING, ACKED, DEAD = 0, 1, 2
"""A delivery's status: in flight or waiting out a nack; acked; dead-lettered."""
