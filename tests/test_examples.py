"""The examples run as written, on every backend, so they never rot."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO_ROOT, Backend


def test_quickstart_runs(backend: Backend) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / "quickstart.py"), backend.url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "deliver welcome-42" in done.stdout or "again: ignored" in done.stdout
    assert "(attempt 2)" in done.stdout
