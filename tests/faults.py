"""Deterministic, bounded fault injection for tests against real databases.

* :class:`FaultProxy` — a TCP proxy in front of a database server that can cut a connection right after a
  chosen statement reaches the server (the server commits, the client never hears), hold the reply to
  such a statement for a while (the server committed, the client still waits), cut every connection at
  once (a restart as clients see it), or stop all traffic for a while (a network black hole).
* :func:`hold_row_lock` — another transaction holding row locks (SQLite: the database write lock).
* :func:`exhausted_pool` — every connection an engine's pool allows, checked out and held.
* :class:`Frozen` / :func:`freeze` and :func:`sigkill` — stop, resume and kill processes the test started.

Every thread is a daemon, every wait has a timeout, and closing a proxy joins its threads.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool, PoolProxiedConnection, QueuePool

DEFAULT_PORTS = {"postgresql": 5432, "mysql": 3306, "mariadb": 3306}
TAIL = 256
"""Bytes of a stream kept between reads, so a pattern split across two reads is still seen (patterns
may be at most this long)."""
CUT_WAIT = 2.0
"""How long a matched cut waits for the server's reply before cutting anyway."""
TICK = 0.05
"""How often blocked proxy threads look again at faults and at shutdown."""


@dataclass(frozen=True)
class ProxyStats:
    """What a :class:`FaultProxy` has done so far."""

    accepted: int
    """Client connections accepted."""
    cuts: int
    """Connections cut by :meth:`FaultProxy.cut_after`."""
    dropped: int
    """Connections closed by :meth:`FaultProxy.cut_all`."""
    open: int
    """Connections open now."""
    armed: int = 0
    """Cuts armed by :meth:`FaultProxy.cut_after` that have not fired yet."""
    holding: int = 0
    """Replies held by :meth:`FaultProxy.hold_reply_after` now."""
    held: int = 0
    """Replies held by :meth:`FaultProxy.hold_reply_after` so far."""


@dataclass
class _Cut:
    pattern: bytes
    skip: int
    count: int
    ignore_case: bool
    hold: float = 0.0
    """Seconds to hold the reply (then forward it, the connection kept); 0 cuts the connection instead."""


class _Link:
    """One proxied connection: the client's socket and ours to the server."""

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client, self.server = client, server
        self.stalled = False
        """Never forwards again (a peer gone silent for good), until closed."""
        self.cut_by: float | None = None
        """Once a cut matched: when to cut even if the server has not replied."""
        self.hold: float = 0.0
        """Once a hold matched: how long to hold the server's next reply before forwarding it."""
        self.closed = False
        self._lock = threading.Lock()

    def close(self) -> None:
        """Close both sides at once (idempotent); ``shutdown`` first wakes threads blocked on either."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        for sock in (self.client, self.server):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


class FaultProxy:
    """A threaded TCP proxy on 127.0.0.1 (a free port) forwarding to ``host:port``, with faults on demand.

    Patterns are matched on the raw bytes each read from a client brings (plus a short tail of the
    previous read), so they see statement text as the driver sends it: psycopg puts it in Parse messages
    (or a simple Query for ``BEGIN``/``COMMIT``), mysqlclient in COM_QUERY packets.
    """

    def __init__(self, host: str, port: int, *, connect_timeout: float = 5.0) -> None:
        self.target = (host, port)
        self.connect_timeout = connect_timeout
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(TICK)
        self.port: int = self._listener.getsockname()[1]
        self._cond = threading.Condition()
        self._links: set[_Link] = set()
        self._cuts: list[_Cut] = []
        self._flow_at = 0.0
        self._accepted = self._cut = self._dropped = self._holding = self._held = 0
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"faultproxy-{self.port}", daemon=True)
        self._acceptor.start()

    @classmethod
    def for_url(cls, url: str) -> FaultProxy:
        """A proxy in front of the server a SQLAlchemy URL names."""
        u = make_url(url)
        return cls(u.host or "127.0.0.1", u.port or DEFAULT_PORTS[u.get_backend_name()])

    def url_for(self, url: str) -> str:
        """``url`` with its host and port replaced by the proxy's."""
        return make_url(url).set(host="127.0.0.1", port=self.port).render_as_string(hide_password=False)

    # Faults

    def cut_after(self, pattern: bytes, *, count: int = 1, skip: int = 0, ignore_case: bool = False) -> None:
        """Arm a cut: after ``skip`` matching client reads pass untouched, each of the next ``count`` reads
        containing ``pattern`` is forwarded to the server (and so is whatever the client sends next, e.g. the
        rest of a pipeline); once the server's reply starts arriving (or after ``CUT_WAIT``), the reply is
        dropped and both sides of that connection are closed. A server replies once it has committed (or
        failed), so the client cannot tell whether the statement took effect."""
        if not 0 < len(pattern) <= TAIL:
            raise ValueError(f"pattern must be 1 to {TAIL} bytes")
        with self._cond:
            self._cuts.append(_Cut(pattern, skip, count, ignore_case))

    def hold_reply_after(self, pattern: bytes, seconds: float, *, count: int = 1) -> None:
        """Arm a delay: each of the next ``count`` client reads containing ``pattern`` is forwarded, and the
        server's reply to it (it has committed, when the pattern is a COMMIT) is held ``seconds`` before it
        is forwarded; the connection stays open. ``stats.holding`` counts the replies held now, ``stats.held``
        those held so far."""
        if not 0 < len(pattern) <= TAIL:
            raise ValueError(f"pattern must be 1 to {TAIL} bytes")
        if not 0 < seconds <= 60:
            raise ValueError("seconds must be above 0 and at most 60")
        with self._cond:
            self._cuts.append(_Cut(pattern, 0, count, False, hold=seconds))

    def cut_all(self) -> None:
        """Close every current connection, both sides, now; new connections are still accepted."""
        with self._cond:
            links = list(self._links)
            self._dropped += len(links)
        for link in links:
            link.close()

    def black_hole(self, seconds: float) -> None:
        """Forward nothing either way, on current and new connections, for ``seconds`` (or until
        :meth:`heal`); connections stay open and bytes are held, not lost."""
        with self._cond:
            self._flow_at = time.monotonic() + seconds
            self._cond.notify_all()

    def stall_existing(self) -> None:
        """The current connections go silent for good, open but never forwarding again (as when a NAT or
        firewall forgets them); new connections work. Only a client-side timeout gets a client out."""
        with self._cond:
            for link in self._links:
                link.stalled = True
            self._cond.notify_all()

    def heal(self) -> None:
        """Disarm pending cuts and end a black hole (stalled connections stay stalled)."""
        with self._cond:
            self._cuts.clear()
            self._flow_at = 0.0
            self._cond.notify_all()

    @property
    def stats(self) -> ProxyStats:
        with self._cond:
            return ProxyStats(
                self._accepted, self._cut, self._dropped, len(self._links), len(self._cuts), self._holding, self._held
            )

    # Lifecycle

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting, close every connection and join every thread (bounded by ``timeout``)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        self._acceptor.join(timeout)  # no new links or threads after this
        self._listener.close()
        with self._cond:
            links = list(self._links)
        for link in links:
            link.close()
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in [self._acceptor, *self._threads] if t.is_alive()]
        if alive:
            raise RuntimeError(f"FaultProxy threads still running: {alive}")

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # Internals

    def _spawn(self, target: Any, name: str, *args: Any) -> None:
        """A pump thread; only the accept thread spawns, and :meth:`close` joins it before the pumps."""
        thread = threading.Thread(target=target, args=args, name=f"faultproxy-{self.port}-{name}", daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()]
        self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=self.connect_timeout)
            except OSError:
                client.close()
                continue
            link = _Link(client, server)
            for sock in (client, server):
                sock.settimeout(10.0)  # bounds sendall to a peer that stopped reading
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._cond:
                self._accepted += 1
                self._links.add(link)
            self._spawn(self._pump, f"c2s-{self._accepted}", link, True)
            self._spawn(self._pump, f"s2c-{self._accepted}", link, False)

    def _wait_flowing(self, link: _Link) -> bool:
        """Hold while a black hole lasts; False once the link or the proxy is closed."""
        with self._cond:
            while not (self._closed or link.closed):
                left = self._flow_at - time.monotonic()
                if left <= 0 and not link.stalled:
                    return True
                if link.stalled:
                    left = TICK
                self._cond.wait(min(left, TICK))
            return False

    def _matches(self, tail: bytes, data: bytes) -> float | None:
        """The hold of the armed cut that fires on this read (0.0: a cut), or None (only matches ending
        in ``data`` count)."""
        with self._cond:
            for cut in self._cuts:
                buf, pattern = tail + data, cut.pattern
                if cut.ignore_case:
                    buf, pattern = buf.lower(), pattern.lower()
                if buf.find(pattern, max(0, len(tail) - len(pattern) + 1)) < 0:
                    continue
                if cut.skip > 0:
                    cut.skip -= 1
                    continue
                cut.count -= 1
                if cut.count <= 0:
                    self._cuts.remove(cut)
                if not cut.hold:
                    self._cut += 1
                return cut.hold
            return None

    def _hold(self, link: _Link) -> bool:
        """Hold the reply that just arrived for ``link.hold`` seconds; False when the link or proxy closed."""
        with self._cond:
            self._holding += 1
            self._held += 1
            until = time.monotonic() + link.hold
            try:
                while not (self._closed or link.closed) and time.monotonic() < until:
                    self._cond.wait(min(TICK, until - time.monotonic()))
                link.hold = 0.0
                return not (self._closed or link.closed)
            finally:
                self._holding -= 1

    def _pump(self, link: _Link, upstream: bool) -> None:
        src, dst = (link.client, link.server) if upstream else (link.server, link.client)
        tail = b""
        try:
            while self._wait_flowing(link):
                if link.cut_by is not None and time.monotonic() > link.cut_by:
                    break  # armed cut, and no reply came: cut anyway
                readable, _, _ = select.select([src], [], [], TICK)
                if not readable:
                    continue
                data = src.recv(65536)
                if not data or not self._wait_flowing(link):
                    break
                if upstream:
                    fired = self._matches(tail, data) if link.cut_by is None and not link.hold else None
                    if fired:
                        link.hold = fired
                    elif fired is not None:
                        link.cut_by = time.monotonic() + CUT_WAIT
                    tail = (tail + data)[-TAIL:]
                elif link.cut_by is not None:
                    break  # the server's reply after the matched bytes: drop it, and the connection
                elif link.hold and not self._hold(link):
                    break
                dst.sendall(data)
        except (OSError, ValueError):
            pass
        link.close()
        with self._cond:
            self._links.discard(link)


@contextlib.contextmanager
def hold_row_lock(
    url: str, table: str, where_sql: str, params: Mapping[str, Any] | None = None, *, timeout: float = 5.0
) -> Iterator[list[sa.Row[Any]]]:
    """Hold ``SELECT * FROM table WHERE where_sql FOR UPDATE`` in a transaction of a connection of its own,
    yielding the locked rows, and roll back on exit. On SQLite (no row locks) ``BEGIN IMMEDIATE`` holds the
    database's write lock instead. Waiting for the lock is bounded by ``timeout`` seconds.

    On MariaDB/InnoDB the lock covers every row (and gap) the scan touches: use an indexed predicate.
    """
    sqlite = url.startswith("sqlite")
    connect_args = {"timeout": timeout} if sqlite else {}
    engine = sa.create_engine(url, poolclass=NullPool, connect_args=connect_args)
    try:
        with engine.connect() as conn:
            quoted = engine.dialect.identifier_preparer.quote(table)
            query = f"SELECT * FROM {quoted} WHERE {where_sql}"
            if sqlite:
                conn.exec_driver_sql("BEGIN IMMEDIATE")
            elif engine.dialect.name == "postgresql":
                conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{int(timeout * 1000)}ms'")
                query += " FOR UPDATE"
            else:
                conn.exec_driver_sql(f"SET SESSION innodb_lock_wait_timeout = {max(1, round(timeout))}")
                query += " FOR UPDATE"
            try:
                yield list(conn.execute(sa.text(query), dict(params or {})))
            finally:
                conn.rollback()
    finally:
        engine.dispose()


@contextlib.contextmanager
def exhausted_pool(engine: sa.Engine) -> Iterator[list[PoolProxiedConnection]]:
    """Check out every connection ``engine``'s :class:`QueuePool` still allows (size plus overflow, less
    what is already checked out) and hold them, so the next checkout times out after ``pool_timeout``
    with :class:`sqlalchemy.exc.TimeoutError`. Released on exit."""
    pool = engine.pool
    if not isinstance(pool, QueuePool) or pool._max_overflow < 0:
        raise TypeError("exhausted_pool needs a QueuePool with a bounded overflow")
    held: list[PoolProxiedConnection] = []
    try:
        for _ in range(pool.size() + pool._max_overflow - pool.checkedout()):
            held.append(pool.connect())
        yield held
    finally:
        for conn in held:
            conn.close()


def _state(pid: int) -> str | None:
    """A process's state letter from /proc (``T`` stopped, ``Z`` zombie), None where that cannot be read."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


def _wait_state(pid: int, stopped: bool, timeout: float = 2.0) -> None:
    """Until the process is (not) stopped, where /proc tells; a process that is gone is neither."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = _state(pid)
        if state in (None, "Z", "X") or (state in ("T", "t")) == stopped:
            return
        time.sleep(0.01)
    raise TimeoutError(f"process {pid} did not {'stop' if stopped else 'continue'} within {timeout} s")


class Frozen:
    """A process stopped with SIGSTOP (stopped when this returns, where /proc tells) until :meth:`thaw` or
    the end of the ``with`` block sends SIGCONT."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.frozen = True
        os.kill(pid, signal.SIGSTOP)
        _wait_state(pid, stopped=True)

    def thaw(self) -> None:
        """SIGCONT (once; a process that has gone meanwhile is fine)."""
        if self.frozen:
            self.frozen = False
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
                _wait_state(self.pid, stopped=False)

    def __enter__(self) -> Frozen:
        return self

    def __exit__(self, *_: object) -> None:
        self.thaw()


def freeze(pid: int) -> Frozen:
    """Stop process ``pid`` now; use as ``with freeze(pid): ...`` to resume it afterwards."""
    return Frozen(pid)


def sigkill(process: int | subprocess.Popen[Any], timeout: float = 5.0) -> int | None:
    """SIGKILL a process the test started and wait (bounded) until it is gone; its exit status (``-9``)
    where it is our child, else None."""
    if isinstance(process, subprocess.Popen):
        process.kill()
        return process.wait(timeout)
    os.kill(process, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid, status = os.waitpid(process, os.WNOHANG)
            if pid:
                return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        except ChildProcessError:  # not our child: wait until it is gone (or a zombie)
            try:
                os.kill(process, 0)
            except ProcessLookupError:
                return None
            if _state(process) in ("Z", "X"):
                return None
        time.sleep(0.01)
    raise TimeoutError(f"process {process} still there {timeout} s after SIGKILL")
