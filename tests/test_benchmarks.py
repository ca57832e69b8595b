"""The benchmarks run (small sizes, every backend) so they never rot; timings are not asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO_ROOT


def test_quick_benchmarks_run_and_lose_nothing(backend_urls: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    env = {
        **os.environ,
        "DELAYQ_TEST_POSTGRES_URL": backend_urls["postgresql"],
        "DELAYQ_TEST_MYSQL_URL": backend_urls["mysql"],
    }
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--json", str(out)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(out.read_text())
    assert {f["backend"] for f in figures} == {"sqlite", "postgresql", "mysql"}
    assert all(f["delayq"] > 0 for f in figures)
    topics = {(f["backend"], f["scenario"]) for f in figures if f["scenario"].startswith("topics: ")}
    # benchmarks/topics.py and topic_pickup.py: every topic scenario on every backend, and the open-transaction
    # publish row on the two with row locks
    assert len(topics) == 8 * 3 + 2, sorted(topics)


def _run(args: list[str], backend_urls: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "DELAYQ_TEST_POSTGRES_URL": backend_urls.get("postgresql", ""),
        "DELAYQ_TEST_MYSQL_URL": backend_urls.get("mysql", ""),
    }
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600
    )


def test_stack_ceiling_rows_run_on_every_backend(backend_urls: dict[str, str], tmp_path: Path) -> None:
    """Issue 33: delayq beside the same statements on SQLAlchemy Core and the bare driver, each path."""
    out = tmp_path / "stack.json"
    backends = [b for b in ("sqlite", "postgresql", "mysql") if b in backend_urls]
    done = _run(["--quick", "--stack", "--backends", ",".join(backends), "--json", str(out)], backend_urls)
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(out.read_text())
    stack_rows = [f for f in figures if f["scenario"].startswith("stack: ") and "worker" not in f["scenario"]]
    assert len(stack_rows) == 6 * len(backends), sorted(f["scenario"] for f in figures)
    assert all(f["delayq"] > 0 and f["ceiling"] > 0 and f["bare"] > 0 for f in stack_rows)
    assert "stack/bare" in done.stdout


def test_peers_run_with_what_is_installed(backend_urls: dict[str, str], tmp_path: Path) -> None:
    """``--peers`` on tiny counts: delayq's rows always, each peer measured or reported as skipped."""
    backend_urls["postgresql"]  # skips without PostgreSQL
    out = tmp_path / "peers.json"
    backends = [b for b in ("postgresql", "mysql") if b in backend_urls]
    done = _run(
        ["--quick", "--peers", "--peers-n", "40", "--backends", ",".join(backends), "--json", str(out)], backend_urls
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    if "mysql" in backends:  # AsyncWorker beside Worker on MySQL/MariaDB, batch 1 and 100
        assert set(result["mysql AsyncWorker / Worker"]) == {"drain worker, batch 1", "drain worker, batch 100"}
    assert result["rates"]["delayq threads"]["drain worker, batch 100"] > 0
    assert result["rates"]["delayq.aio psycopg"]["offer, 500 per call"] > 0
    assert isinstance(result["pickup"]["raw LISTEN/NOTIFY (ceiling)"], list)
    for peer in ("pgqueuer asyncpg", "pgqueuer psycopg", "procrastinate"):
        assert result["rates"][peer] or "skipped" in done.stdout or "failed" in done.stdout, peer


def test_flow_rows_run_on_every_backend(backend_urls: dict[str, str], tmp_path: Path) -> None:
    """Issue 34: priorities, limits and groups beside hand-written claims (benchmarks/flow.py), each checked
    exactly once, and the priority index's cost on offers."""
    out = tmp_path / "flow.json"
    backends = [b for b in ("sqlite", "postgresql", "mysql") if b in backend_urls]
    done = _run(["--quick", "--flow", "--backends", ",".join(backends), "--json", str(out)], backend_urls)
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(out.read_text())
    assert all(f["scenario"].startswith("flow: ") for f in figures), sorted(f["scenario"] for f in figures)
    assert len(figures) == 6 * len(backends), sorted(f["scenario"] for f in figures)
    assert all(f["delayq"] > 0 and f["ceiling"] > 0 for f in figures)


def test_soak_smoke_reports_a_verdict(backend_urls: dict[str, str]) -> None:
    done = _run(["--soak", "12000", "--backends", "sqlite"], backend_urls)
    assert done.returncode in (0, 1), done.stdout + done.stderr  # 1: "NOT FLAT", a figure, not a failure here
    assert "FLAT" in done.stdout and "12,000 handled" in done.stdout, done.stdout


def test_web_page_loads_run(backend_urls: dict[str, str], tmp_path: Path) -> None:
    """Issue 37: the dashboard's page-load benchmark (benchmarks/web.py) on a small queue."""
    out = tmp_path / "web.json"
    done = _run(["--web", "3000", "--backends", "sqlite", "--json", str(out)], backend_urls)
    assert done.returncode == 0, done.stdout + done.stderr
    loads = json.loads(out.read_text())
    assert len(loads) == 19 and all(load["p95_ms"] > 0 for load in loads)
    assert "overview (HTML" in done.stdout
