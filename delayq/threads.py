"""A small pool of daemon threads for the worker's handlers.

``concurrent.futures.ThreadPoolExecutor`` joins its threads when the interpreter exits, so one
handler stuck past the shutdown timeout would keep the process alive. These threads are daemon
threads: once the worker has released what is still running, the process can exit.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("delayq.worker")


class Task:
    """One call submitted to a ``DaemonPool``: it can be cancelled until a thread starts it."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn = fn
        self._lock = threading.Lock()
        self._state = "pending"  # -> running -> done, or -> cancelled
        self._done = threading.Event()

    def cancel(self) -> bool:
        """Keep the call from starting; False when it has started already."""
        with self._lock:
            if self._state == "pending":
                self._state = "cancelled"
                self._done.set()
            return self._state == "cancelled"

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the call has returned (or was cancelled); True when it has."""
        return self._done.wait(timeout)

    def run(self) -> None:
        with self._lock:
            if self._state != "pending":
                return
            self._state = "running"
        try:
            self._fn()
        except BaseException:  # the worker's calls catch their own errors; this is the last line
            log.exception("a handler thread's call raised")
        finally:
            with self._lock:
                self._state = "done"
            self._done.set()


class DaemonPool:
    """``size`` daemon threads running submitted calls in order of submission."""

    def __init__(self, size: int, name: str) -> None:
        self._tasks: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(size)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[[], None]) -> Task:
        task = Task(fn)
        self._tasks.put(task)
        return task

    def shutdown(self) -> None:
        """Let each thread exit after its current call; does not wait for them."""
        for _ in self._threads:
            self._tasks.put(None)

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            task.run()
