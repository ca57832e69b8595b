"""The one worker runtime: sources (queues, topic subscriptions), jobs and the core both drivers compose.

``delayq.worker.Worker`` (threads) and ``delayq.aio.AsyncWorker`` (asyncio tasks) drive a
``Core`` (``delayq.runtime._core``); see docs/internals.md for the map.
"""
