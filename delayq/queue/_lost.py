"""The count of lost locks (``lock_lost``): each delivery's lost lock counted once, whoever finds it."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from delayq import observe


class _LostLocks:
    """The deliveries (id, lock token) whose lost lock was counted: each is counted once, whichever of
    the heartbeat (``extend_many``), ``ack``, ``retry``, ``extend`` or ``dead_letter`` finds it gone.

    Bounded: the oldest entries go first. A delivery is asked about again within its handler's run, long
    before ``SIZE`` other lost locks pass.
    """

    SIZE = 10_000

    def __init__(self) -> None:
        self._seen: dict[tuple[int, str], None] = {}
        self._lock = threading.Lock()

    def count(self, queue: str, lost: Iterable[tuple[int, str]]) -> None:
        """Count the lost locks of ``lost`` not counted before."""
        with self._lock:
            new = self._mark(lost)
        observe.count("lock_lost", queue, new)

    def count_unacked(self, queue: str, pairs: Sequence[tuple[int, str]], acked: int) -> None:
        """An ack deleted ``acked`` of ``pairs``, none of which is held any more: the others' locks are lost.

        Which ones is not known (the deleted rows are gone): those counted before are among them,
        and from now on all of ``pairs`` are marked (the acked ones are finished: when a heartbeat
        finds them gone, that is no lost lock).
        """
        with self._lock:
            already = sum(1 for p in pairs if p in self._seen)
            self._mark(pairs)
        observe.count("lock_lost", queue, max(0, len(pairs) - acked - already))

    def _mark(self, pairs: Iterable[tuple[int, str]]) -> int:
        new = 0
        for p in pairs:
            if p not in self._seen:
                self._seen[p] = None
                new += 1
        while len(self._seen) > self.SIZE:
            del self._seen[next(iter(self._seen))]
        return new


_lost_locks = _LostLocks()
