"""A small pool of daemon threads for the worker's handlers.

``concurrent.futures.ThreadPoolExecutor`` joins its threads when the interpreter exits, so one
handler stuck past the shutdown timeout would keep the process alive. These threads are daemon
threads: once the worker has released what is still running, the process can exit.

A task is a few words of state under the pool's one lock (no lock or event of its own): a worker
submits one per message, so what a submission costs is paid per message.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("delayq.worker")

PENDING, RUNNING, DONE, CANCELLED = range(4)


class _States:
    """What a pool's tasks share: one condition for their state changes, and how many wait on it."""

    __slots__ = ("changed", "waiting")

    def __init__(self) -> None:
        self.changed = threading.Condition(threading.Lock())
        self.waiting = 0


class Task:
    """One call submitted to a ``DaemonPool``: it can be cancelled until a thread starts it."""

    __slots__ = ("_fn", "_shared", "_state")

    def __init__(self, fn: Callable[[], None], shared: _States) -> None:
        self._fn = fn
        self._shared = shared
        self._state = PENDING

    def cancel(self) -> bool:
        """Keep the call from starting; False when it has started already."""
        with self._shared.changed:
            if self._state == PENDING:
                self._state = CANCELLED
                self._shared.changed.notify_all()
            return self._state == CANCELLED

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the call has returned (or was cancelled); True when it has."""
        shared = self._shared
        with shared.changed:
            shared.waiting += 1
            try:
                return shared.changed.wait_for(lambda: self._state >= DONE, timeout)
            finally:
                shared.waiting -= 1

    def run(self) -> None:
        shared = self._shared
        with shared.changed:
            if self._state != PENDING:
                return
            self._state = RUNNING
        try:
            self._fn()
        except BaseException:  # the worker's calls catch their own errors; this is the last line
            log.exception("a handler thread's call raised")
        finally:
            with shared.changed:
                self._state = DONE
                if shared.waiting:
                    shared.changed.notify_all()


class DaemonPool:
    """``size`` daemon threads running submitted calls in order of submission."""

    def __init__(self, size: int, name: str) -> None:
        self._tasks: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._states = _States()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(size)]
        for t in self._threads:
            t.start()

    def task(self, fn: Callable[[], None]) -> Task:
        """A task of this pool for ``fn``, not yet submitted."""
        return Task(fn, self._states)

    def submit(self, fn: Callable[[], None]) -> Task:
        task = self.task(fn)
        self._tasks.put(task)
        return task

    def shutdown(self) -> None:
        """Let each thread exit after its current call; does not wait for them."""
        for _ in self._threads:
            self._tasks.put(None)

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            task.run()
