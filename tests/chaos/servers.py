"""Throwaway database servers for the chaos harness: PostgreSQL and MariaDB in temp dirs on free ports.

Never the shared servers on 5432/3306. Each server runs as its own OS user (``postgres`` / ``mysql``;
we are root), can be restarted mid-run (``fast``: a clean shutdown; ``immediate``: PostgreSQL's
immediate mode, MariaDB's SIGKILL, both followed by crash recovery), and is always stopped and removed by
:meth:`Server.close`. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Literal, Protocol

import sqlalchemy as sa

Mode = Literal["fast", "immediate"]
READY_TIMEOUT = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(cmd: list[str], timeout: float = 60.0) -> None:
    done = subprocess.run(cmd, capture_output=True, timeout=timeout, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stdout}{done.stderr}")


def _chown(path: Path, user: str) -> None:
    shutil.chown(path, user, user)


def _wait_connect(url: str, timeout: float = READY_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        while True:
            try:
                with engine.connect() as conn:
                    conn.exec_driver_sql("SELECT 1")
                return
            except sa.exc.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    finally:
        engine.dispose()


class Server(Protocol):
    name: str
    url: str
    """Direct URL (not through any proxy)."""
    host: str
    port: int

    def restart(self, mode: Mode, down: float = 0.0) -> tuple[float, float]: ...

    def close(self) -> None: ...


class Restartable(Protocol):
    def stop(self, mode: Mode) -> None: ...

    def start(self) -> None: ...


def restart(server: Restartable, mode: Mode, down: float) -> tuple[float, float]:
    """Stop (fast or immediate), stay down ``down`` seconds, start again; the monotonic times the stop
    began and the server was ready."""
    began = time.monotonic()
    server.stop(mode)
    time.sleep(down)
    server.start()
    return began, time.monotonic()


class SqliteFile:
    """No server: a database file in a temp dir, in WAL mode (persistent for the file)."""

    name = "sqlite"
    host = ""
    port = 0

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="delayq-chaos-sqlite-"))
        self.url = f"sqlite:///{self.dir / 'chaos.db'}"
        engine = sa.create_engine(self.url, poolclass=sa.pool.NullPool)
        with engine.connect() as conn:
            conn.exec_driver_sql("PRAGMA journal_mode=WAL")
        engine.dispose()

    def restart(self, mode: Mode, down: float = 0.0) -> tuple[float, float]:
        raise NotImplementedError("SQLite has no server to restart")

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class PostgresServer:
    """``initdb`` + ``pg_ctl`` as the ``postgres`` user, trust auth on 127.0.0.1 only."""

    name = "postgresql"
    host = "127.0.0.1"

    def __init__(self, max_connections: int = 300) -> None:
        bins = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]))
        if not bins:
            raise RuntimeError("no PostgreSQL binaries under /usr/lib/postgresql/*/bin")
        self.bin = Path(bins[-1])
        self.dir = Path(tempfile.mkdtemp(prefix="delayq-chaos-pg-"))
        _chown(self.dir, "postgres")
        self.data = self.dir / "data"
        self.port = free_port()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        self._started = False
        _run(self._as_user(str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "-N"))
        settings = {
            "port": str(self.port),
            "listen_addresses": "'127.0.0.1'",
            "unix_socket_directories": f"'{self.dir}'",
            "max_connections": str(max_connections),
            "fsync": "off",  # an immediate stop still recovers from WAL; only an OS crash would lose data
            "shared_buffers": "64MB",
            "log_min_messages": "warning",
        }
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.writelines(f"{k} = {v}\n" for k, v in settings.items())
        self.start()

    @staticmethod
    def _as_user(*cmd: str) -> list[str]:
        return ["runuser", "-u", "postgres", "--", *cmd]

    def _ctl(self, *args: str) -> None:
        _run(self._as_user(str(self.bin / "pg_ctl"), "-D", str(self.data), "-w", "-t", "60", *args), timeout=90)

    def start(self) -> None:
        self._ctl("-l", str(self.dir / "server.log"), "start")
        self._started = True
        _wait_connect(self.url)

    def stop(self, mode: Mode = "fast") -> None:
        self._ctl("-m", mode, "stop")
        self._started = False

    def restart(self, mode: Mode, down: float = 0.0) -> tuple[float, float]:
        return restart(self, mode, down)

    def close(self) -> None:
        try:
            if self._started:
                with contextlib.suppress(Exception):
                    self.stop("immediate")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


class MariadbServer:
    """``mariadb-install-db`` + ``mariadbd`` as the ``mysql`` user, without grant tables, on 127.0.0.1."""

    name = "mysql"
    host = "127.0.0.1"

    def __init__(self, max_connections: int = 500) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="delayq-chaos-mariadb-"))
        _chown(self.dir, "mysql")
        self.data = self.dir / "data"
        self.socket = self.dir / "mysqld.sock"
        self.port = free_port()
        self.max_connections = max_connections
        self.url = f"mysql+mysqldb://root@127.0.0.1:{self.port}/chaos"
        self._proc: subprocess.Popen[bytes] | None = None
        _run(
            [
                "mariadb-install-db",
                "--no-defaults",
                f"--datadir={self.data}",
                "--user=mysql",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
            ],
            timeout=120,
        )
        self.start()
        _wait_connect(self.url.rsplit("/", 1)[0] + "/mysql")
        engine = sa.create_engine(self.url.rsplit("/", 1)[0] + "/mysql", poolclass=sa.pool.NullPool)
        with engine.connect() as conn:
            conn.exec_driver_sql("CREATE DATABASE IF NOT EXISTS chaos")
        engine.dispose()

    def start(self) -> None:
        log = (self.dir / "server.log").open("ab")
        self._proc = subprocess.Popen(
            [
                "mariadbd",
                "--no-defaults",
                f"--datadir={self.data}",
                f"--port={self.port}",
                "--bind-address=127.0.0.1",
                f"--socket={self.socket}",
                f"--pid-file={self.dir / 'mysqld.pid'}",
                "--user=mysql",
                "--skip-grant-tables",
                "--skip-name-resolve",
                f"--max-connections={self.max_connections}",
                "--innodb-buffer-pool-size=128M",
                "--innodb-flush-log-at-trx-commit=2",
                "--skip-log-bin",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        _wait_connect(self.url.rsplit("/", 1)[0] + "/mysql")

    def stop(self, mode: Mode = "fast") -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        if mode == "immediate":
            proc.kill()
        else:
            proc.terminate()  # SIGTERM: a normal shutdown
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def restart(self, mode: Mode, down: float = 0.0) -> tuple[float, float]:
        return restart(self, mode, down)

    def close(self) -> None:
        try:
            self.stop("immediate")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def start_server(backend: str) -> PostgresServer | MariadbServer | SqliteFile:
    if backend == "postgresql":
        return PostgresServer()
    if backend in ("mysql", "mariadb"):
        return MariadbServer()
    if backend == "sqlite":
        return SqliteFile()
    raise ValueError(f"unknown backend {backend!r}")


if __name__ == "__main__":  # a smoke test: start, restart both ways, close
    for b in ("postgresql", "mysql"):
        t = time.monotonic()
        srv = start_server(b)
        try:
            print(b, srv.url, f"up in {time.monotonic() - t:.1f}s", os.getpid())
            modes: tuple[Mode, ...] = ("fast", "immediate")
            for m in modes:
                a, z = srv.restart(m)
                print(" restart", m, f"{z - a:.1f}s")
        finally:
            srv.close()
