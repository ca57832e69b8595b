"""An async web app: an endpoint creates an order and enqueues its confirmation in the same
AsyncSession transaction (both commit, or neither), and an async handler sends the confirmation.

Starlette (FastAPI is Starlette underneath: the endpoint and the lifespan read the same there).
Run it with `python examples/fastapi_app.py [DATABASE_URL]` where delayq, starlette and httpx are
installed: it starts the app in-process (httpx's ASGI transport), places two orders and prints what
the worker did. SQLite (delayq-asyncio.db) unless given another URL; an async driver is picked for
it (aiosqlite, psycopg, asyncmy). In production run the app with uvicorn, or the worker in a
process of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from delayq import migrations
from delayq.aio import AsyncDelayedQueue, AsyncDelivery, AsyncHandler, AsyncWorker

QUEUE = "order-confirmations"
STOCK = 10
ASYNC_DRIVERS = {"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+psycopg", "mysql": "mysql+asyncmy"}


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "example_async_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    item: Mapped[str] = mapped_column(sa.String(100))
    quantity: Mapped[int]


class OutOfStock(Exception):
    pass


class SendConfirmation(AsyncHandler):
    """Sends an order's confirmation (here: records it); an exception would retry it later."""

    queue = QUEUE
    sent: asyncio.Queue[int] | None = None

    async def handle(self, delivery: AsyncDelivery, conn: AsyncConnection | None = None) -> None:
        order_id = delivery.payload["order"]
        print(f"confirmation sent for order {order_id}")
        if self.sent is not None:
            await self.sent.put(order_id)


def create_app(url: str) -> Starlette:
    """The app on the database at ``url`` (a sync or async SQLAlchemy URL)."""
    parsed = sa.make_url(url)
    engine = create_async_engine(parsed.set(drivername=ASYNC_DRIVERS[parsed.get_backend_name()]))
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    confirmations = AsyncDelayedQueue(engine, QUEUE)
    handler = SendConfirmation()

    async def place_order(request: Request) -> JSONResponse:
        body = await request.json()
        try:
            async with sessions() as session, session.begin():
                order = Order(item=body["item"], quantity=body["quantity"])
                session.add(order)
                await session.flush()  # the order's id, in this transaction
                await confirmations.offer(f"order-{order.id}", {"order": order.id}, using=session)
                if order.quantity > STOCK:  # found out after enqueuing: the rollback takes both back
                    raise OutOfStock
        except OutOfStock:
            return JSONResponse({"error": "out of stock"}, status_code=409)
        return JSONResponse({"id": order.id}, status_code=201)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
        handler.sent = asyncio.Queue()
        worker = AsyncWorker(engine, [handler])
        worker.start()
        app.state.sent = handler.sent
        yield
        await worker.stop()
        await engine.dispose()

    return Starlette(routes=[Route("/orders", place_order, methods=["POST"])], lifespan=lifespan)


async def demo(url: str) -> None:
    """Start the app (its lifespan starts the worker), place two orders over HTTP, see the confirmation."""
    import httpx

    app = create_app(url)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://app") as client,
    ):
        placed = await client.post("/orders", json={"item": "a book", "quantity": 1})
        print("placed:", placed.status_code)
        refused = await client.post("/orders", json={"item": "a piano", "quantity": 99})
        print("refused:", refused.status_code, refused.json()["error"])
        order_id = await asyncio.wait_for(app.state.sent.get(), timeout=60)
        assert order_id == placed.json()["id"]


def main(url: str) -> None:
    migrations.upgrade(url)  # what `delayq migrate --url URL` does (with the sync driver)
    asyncio.run(demo(url))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "sqlite:///delayq-asyncio.db")
