"""examples/fastapi_app.py in-process: the order and its confirmation commit together, or neither."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from types import ModuleType

import httpx
import sqlalchemy as sa
from conftest import REPO_ROOT, Backend

from delayq import DelayedQueue


def load_example() -> ModuleType:
    if "fastapi_app" in sys.modules:
        return sys.modules["fastapi_app"]
    spec = importlib.util.spec_from_file_location("fastapi_app", REPO_ROOT / "examples" / "fastapi_app.py")
    assert spec is not None and spec.loader is not None
    module = sys.modules["fastapi_app"] = importlib.util.module_from_spec(spec)  # (its annotations resolve there)
    spec.loader.exec_module(module)
    return module


def test_the_web_example_enqueues_in_the_orders_transaction_and_confirms(backend: Backend) -> None:
    example = load_example()

    async def main() -> int:
        app = example.create_app(backend.url)
        transport = httpx.ASGITransport(app=app)
        async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            placed = await c.post("/orders", json={"item": "a lamp", "quantity": 2})
            assert placed.status_code == 201
            refused = await c.post("/orders", json={"item": "a piano", "quantity": 99})
            assert refused.status_code == 409
            confirmed = await asyncio.wait_for(app.state.sent.get(), timeout=60)
            assert confirmed == placed.json()["id"]
            return int(placed.json()["id"])

    order_id = asyncio.run(main())
    orders = example.Order.__table__
    with backend.engine.connect() as conn:
        assert conn.execute(sa.select(orders.c.item).where(orders.c.id == order_id)).scalar_one() == "a lamp"
        assert conn.execute(sa.select(sa.func.count()).where(orders.c.quantity == 99)).scalar_one() == 0
    # The refused orders' confirmations were rolled back with them: none waits, none was sent.
    assert DelayedQueue(backend.engine, example.QUEUE).stats().ready == 0
