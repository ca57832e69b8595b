"""The examples and the README's quick start run as written, so they never rot."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT, Backend

EXAMPLES = sorted(p.name for p in (REPO_ROOT / "examples").glob("*.py"))
EXTRA_ARGS = {"spark_pipeline.py": ["--rows", "2000"]}


def run(args: list[str], cwd: Path = REPO_ROOT) -> str:
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=180, cwd=cwd)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.parametrize("example", EXAMPLES)
def test_example_runs(backend: Backend, example: str, tmp_path: Path) -> None:
    extra = EXTRA_ARGS.get(example, [])
    if example == "spark_stream.py":  # a topic of its own, a checkpoint of its own, 200 events
        extra = ["--checkpoint", str(tmp_path / "ckpt"), "--publish", "200", "--topic", f"ex-{tmp_path.name}"[:90]]
    out = run([str(REPO_ROOT / "examples" / example), backend.url, *extra])
    expected = {
        "quickstart.py": "(attempt 2)",
        "retries.py": "charged order-busy-gateway on attempt 3",
        "cron_schedule.py": "report for Fri 11 Jan 09:00",
        "spark_pipeline.py": "run 2: created 0, updated 0, ignored 2000",
        "spark_stream.py": "read 200 order events",
        "fastapi_app.py": "confirmation sent for order",
    }[example]
    assert expected in out


def test_the_readme_quick_start_runs_as_written(tmp_path: Path) -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    quick_start = readme.split("## Quick start", 1)[1]
    code = re.search(r"```python\n(.*?)```", quick_start, re.S)
    assert code is not None
    (tmp_path / "quick_start.py").write_text(code.group(1))
    assert run(["quick_start.py"], cwd=tmp_path).strip() == "confirming order 1"
