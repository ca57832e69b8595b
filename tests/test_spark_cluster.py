"""A real standalone Spark cluster: a master and two workers of the installed pyspark, each its own JVM on
127.0.0.1, ``spark-submit`` of examples/spark_stream.py, and one worker JVM killed (SIGKILL, by PID) while the
stream runs. Every message lands once in the sink queue and the group's watermarks reach the topic's heads.
Everything the test starts is stopped by it (its process groups, by PID), within bounded waits."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import Backend

from delayq import Topic
from delayq.schema import make_tables
from delayq.topics.views import group_lag

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "spark_stream.py"
MESSAGES = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cluster_commands(home: str, port: int, work: Path) -> dict[str, list[str]]:
    """The commands docs/spark.md shows under "On a cluster" (with pyspark's ``SPARK_HOME``)."""
    spark_class = os.path.join(home, "bin", "spark-class")
    master = [spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
              "--webui-port", str(free_port())]  # fmt: skip
    workers = {
        f"worker-{n}": [
            spark_class,
            "org.apache.spark.deploy.worker.Worker",
            f"spark://127.0.0.1:{port}",
            "--host",
            "127.0.0.1",
            "--cores",
            "1",
            "--memory",
            "1g",
            "--webui-port",
            str(free_port()),
            "--work-dir",
            str(work / f"worker-{n}"),
        ]
        for n in (1, 2)
    }
    return {"master": master, **workers}


class Cluster:
    """Processes started in their own process groups, stopped by PID (the group each one leads)."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env, self.logs = env, logs
        self.started: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, command: list[str]) -> subprocess.Popen[bytes]:
        out = (self.logs / f"{name}.log").open("wb")
        process = subprocess.Popen(command, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.started[name] = process
        return process

    def kill(self, name: str) -> None:
        """SIGKILL the process's group: the worker JVM and the executor JVM it launched."""
        process = self.started[name]
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)

    def stop(self) -> None:
        for process in reversed(list(self.started.values())):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for process in self.started.values():
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
        for process in self.started.values():  # what the workers launched, in their groups
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[Cluster, int]]:
    import pyspark

    home = os.path.dirname(pyspark.__file__)
    env = {
        **os.environ,
        "SPARK_HOME": home,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
        "PYTHONPATH": str(ROOT),  # the executors' Python workers import this checkout's delayq
    }
    port = free_port()
    running = Cluster(env, tmp_path)
    try:
        for name, command in cluster_commands(home, port, tmp_path).items():
            running.start(name, command)
        deadline = time.monotonic() + 90
        while not all(registered(tmp_path / f"worker-{n}.log") for n in (1, 2)):
            assert time.monotonic() < deadline, (tmp_path / "worker-1.log").read_text(errors="replace")[-2000:]
            assert all(p.poll() is None for p in running.started.values())
            time.sleep(0.5)
        yield running, port
    finally:
        running.stop()


def registered(log: Path) -> bool:
    return "Successfully registered with master" in log.read_text(errors="replace")


def sink_keys(backend: Backend, queue: str) -> list[str]:
    m = make_tables().messages
    with backend.engine.connect() as conn:
        return list(conn.execute(sa.select(m.c.key).where(m.c.queue == queue)).scalars())


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.parametrize("backend", ["postgresql", "mysql"], indirect=True)  # (a SQLite file is one machine's)
def test_a_stream_on_a_standalone_cluster_survives_a_worker_killed_mid_stream(
    backend: Backend, cluster: tuple[Cluster, int], tmp_path: Path
) -> None:
    running, port = cluster
    topic, queue = f"t-{uuid.uuid4().hex[:12]}", f"q-{uuid.uuid4().hex[:12]}"
    submit = [
        os.path.join(running.env["SPARK_HOME"], "bin", "spark-submit"),
        "--master", f"spark://127.0.0.1:{port}",
        "--conf", "spark.executor.cores=1",
        "--conf", "spark.executor.memory=512m",
        "--conf", "spark.cores.max=2",
        "--conf", "spark.ui.enabled=false",
        str(EXAMPLE), backend.url,
        "--checkpoint", str(tmp_path / "checkpoint"),
        "--publish", str(MESSAGES),
        "--max-rows", "30",
        "--topic", topic,
        "--queue", queue,
    ]  # fmt: skip
    job = running.start("submit", submit)
    deadline = time.monotonic() + 180
    while len(sink_keys(backend, queue)) < 60:  # two batches in: mid-stream
        assert job.poll() is None, (tmp_path / "submit.log").read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, "the stream did not start"
        time.sleep(0.2)
    running.kill("worker-1")
    at_kill = len(sink_keys(backend, queue))
    assert job.wait(300) == 0, (tmp_path / "submit.log").read_text(errors="replace")[-3000:]
    log = (tmp_path / "submit.log").read_text(errors="replace")
    assert at_kill < MESSAGES, "the stream ended before the worker was killed"

    keys = sink_keys(backend, queue)
    assert sorted(keys) == [f"follow-up/order-{i:06d}" for i in range(MESSAGES)], log[-3000:]  # each once
    heads = {h.partition: h.head for h in Topic(backend.engine, topic).heads()}
    assert sum(heads.values()) == MESSAGES  # published once
    marks = {p.partition: p.watermark for p in group_lag(backend.engine, topic, queue)}
    assert marks == heads  # the group's watermarks: everything the sink committed, no more
