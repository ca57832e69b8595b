"""Topics at the seed's scale (full profile): 200 subscribers (real workers, threads of 5 processes) over
2,000 partitions settle when 20 leave and when 20 join, and idle subscribers' statements are counted.

Every wait is bounded (``benchmarks.topic_scale`` fails rather than hangs) and every process it starts is
stopped. Nothing about time is asserted: the figures are printed (``-s``) for docs/performance.md.
"""

from __future__ import annotations

import math

import pytest
from conftest import Backend

from benchmarks import topic_scale

pytestmark = pytest.mark.slow


def test_200_subscribers_over_2000_partitions_settle_when_20_leave_and_join(backend: Backend) -> None:
    if backend.name == "sqlite":
        pytest.skip("one writer at a time: 200 subscribers in 5 processes is not a SQLite deployment")
    figures = topic_scale.run(
        backend.url,
        prefix="scale_",
        partitions=2000,
        processes=4,
        per_process=50,
        churn=20,
        lease=15.0,
        window=5.0,
        sizes=(10,),
        limit=300.0,
    )
    print(figures)
    # run() returns only once each phase settled: every partition leased to a live subscriber, none
    # holding more than ceil(2000 / live) (it raises otherwise).
    assert figures.leave_settle_s is not None and figures.join_settle_s is not None
    assert figures.leave_rounds is not None and figures.join_rounds is not None
    assert set(figures.idle) == {10, 200} and all(math.isfinite(v) and v > 0 for v in figures.idle.values())
