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
    assert len(topics) == 7 * 3, sorted(topics)  # benchmarks/topics.py: every topic scenario on every backend
