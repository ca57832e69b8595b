"""Fault injection for the Spark tests; imported by the executors' Python workers."""

from __future__ import annotations


def fail_first_attempt_half_way(partition: int, attempt: int, chunks_done: int) -> None:
    """Fail partition 0's first attempt after its second chunk is written."""
    if partition == 0 and attempt == 0 and chunks_done == 2:
        raise RuntimeError("injected executor failure half-way through the partition")
