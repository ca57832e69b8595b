"""A small pool of daemon threads for the worker's handlers.

``concurrent.futures.ThreadPoolExecutor`` joins its threads when the interpreter exits, so one
handler stuck past the shutdown timeout would keep the process alive. These threads are daemon
threads: once the worker has released what is still running, the process can exit.

A task is a few words of state under the pool's one lock (no lock or event of its own): a worker
submits one per message, so what a submission costs is paid per message.
"""

from __future__ import annotations

import collections
import logging
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
    """``size`` daemon threads running submitted calls in order of submission.

    A submission wakes a sleeping thread only when no wake-up is under way; a thread that takes a call
    while more wait wakes the next sleeping one before it runs its own. So each waiting call still gets
    a thread of its own at once (one that sleeps is woken for it: a call that blocks delays no other),
    while a thread that returns finds the next call itself: a batch of quick calls costs a few wake-ups,
    not one per call.
    """

    def __init__(self, size: int, name: str) -> None:
        self._tasks: collections.deque[Task | None] = collections.deque()
        self._lock = threading.Lock()  # guards the fields below
        self._sleeping = 0  # threads waiting for a call
        self._waking = False  # a wake-up was sent and no sleeping thread has taken it yet
        self._bell = threading.Lock()  # held while no wake-up is pending: released once per wake-up
        self._bell.acquire()
        self._states = _States()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(size)]
        for t in self._threads:
            t.start()

    def task(self, fn: Callable[[], None]) -> Task:
        """A task of this pool for ``fn``, not yet submitted."""
        return Task(fn, self._states)

    def submit(self, fn: Callable[[], None]) -> Task:
        task = Task(fn, self._states)
        self._put(task)
        return task

    def shutdown(self) -> None:
        """Let each thread exit after its current call; does not wait for them."""
        for _ in self._threads:
            self._put(None)

    def _put(self, item: Task | None) -> None:
        with self._lock:
            self._tasks.append(item)
            if self._sleeping and not self._waking:
                self._waking = True
                self._bell.release()

    def _work(self) -> None:
        lock, tasks, bell = self._lock, self._tasks, self._bell
        while True:
            with lock:
                while not tasks:
                    self._sleeping += 1
                    lock.release()
                    try:
                        bell.acquire()  # the one pending wake-up: this thread takes it
                    finally:
                        lock.acquire()
                        self._sleeping -= 1
                        self._waking = False
                task = tasks.popleft()
                if tasks and self._sleeping and not self._waking:  # more wait: the next sleeper starts one
                    self._waking = True
                    bell.release()
            if task is None:
                return
            task.run()
