"""The asyncio API cannot drift from the sync one: every public method of a sync class has an async twin
with the same parameters (names, kinds, defaults), or is listed here as sync-only with the reason.

The async classes of ``delayq.aio`` are proxies that await the sync core (docs/asyncio.md); a method or a
parameter added to the sync class fails this test until its twin exists. No database: signatures only.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

from delayq import DelayedQueue, Delivery, Handler, Subscription, Topic, Worker, browse
from delayq.aio import AsyncDelayedQueue, AsyncDelivery, AsyncHandler, AsyncSubscription, AsyncTopic, AsyncWorker
from delayq.aio import browse as aio_browse

TWINS: list[tuple[type, type]] = [
    (DelayedQueue, AsyncDelayedQueue),
    (Delivery, AsyncDelivery),
    (Topic, AsyncTopic),
    (Subscription, AsyncSubscription),
    (Worker, AsyncWorker),
    (Handler, AsyncHandler),
]

SYNC_ONLY: dict[tuple[type, str], str] = {
    (DelayedQueue, "run"): "takes a sync callable; the async API has transaction() and the caller's own session",
}
"""Public methods of a sync class with no async twin, each with why."""

NOT_AWAITED: dict[tuple[type, str], str] = {
    (AsyncDelayedQueue, "transaction"): "an async context manager (async with), as the sync one is a context manager",
    (AsyncWorker, "start"): "schedules the worker as a task of the running loop and returns; await stop() ends it",
    (AsyncWorker, "health"): "a snapshot of counters in memory: no I/O to await",
    (AsyncWorker, "handled"): "a count in memory: no I/O to await",
}
"""Twins that are plain methods although the class's other operations are coroutines, each with why."""

RENAMED: dict[tuple[type, str], str] = {
    (AsyncSubscription, "handle_exactly_once"): "the callable is handler= in the sync API and fn= in the async one; "
    "both shipped, so renaming either breaks a caller who passes it by keyword",
}
"""Twins whose parameters differ from the sync method's, each with why; the test checks they still do."""

SAME_CONSTRUCTOR: set[type] = {DelayedQueue, Topic, Subscription}
"""Sync classes whose twin takes the same constructor parameters (the engine an ``AsyncEngine``), by name
or through ``**options`` handed on to the sync class."""

_MISSING = object()


def _public(cls: type) -> dict[str, Any]:
    """The public attributes of ``cls`` (its own and inherited), as defined (a property is not called)."""
    found = {}
    for name in dir(cls):
        if not name.startswith("_"):
            found[name] = inspect.getattr_static(cls, name)
    return found


def _params(function: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
    """(name, kind, default) of each parameter: what a caller passes. Annotations differ by design (an
    ``AsyncUsing`` for a ``Using``, an ``AsyncDelivery`` for a ``Delivery``)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def _is_method(member: Any) -> bool:
    return inspect.isfunction(member) or isinstance(member, staticmethod | classmethod)


def _function(member: Any) -> Callable[..., Any]:
    return member.__func__ if isinstance(member, staticmethod | classmethod) else member


def _awaited(function: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(function) or inspect.isasyncgenfunction(function)


@pytest.mark.parametrize(("sync", "aio"), TWINS, ids=[a.__name__ for _, a in TWINS])
def test_every_public_method_has_an_async_twin_with_the_same_parameters(sync: type, aio: type) -> None:
    sync_members, aio_members = _public(sync), _public(aio)
    problems = []
    for name, member in sorted(sync_members.items()):
        if (sync, name) in SYNC_ONLY:
            continue
        twin = aio_members.get(name, _MISSING)
        if twin is _MISSING:
            problems.append(f"{aio.__name__}.{name} is missing (or list it in SYNC_ONLY with the reason)")
            continue
        if not _is_method(member):  # a property or a class attribute: its twin need only exist
            continue
        if not _is_method(twin):
            problems.append(f"{aio.__name__}.{name} is not a method")
            continue
        if _params(_function(member)) != _params(_function(twin)) and (aio, name) not in RENAMED:
            problems.append(
                f"{aio.__name__}.{name}{inspect.signature(_function(twin))} differs from "
                f"{sync.__name__}.{name}{inspect.signature(_function(member))}"
            )
        if not _awaited(_function(twin)) and (aio, name) not in NOT_AWAITED:
            problems.append(f"{aio.__name__}.{name} is not a coroutine function (or list it in NOT_AWAITED)")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("sync", sorted(SAME_CONSTRUCTOR, key=str))
def test_the_twins_take_the_same_constructor_parameters(sync: type) -> None:
    aio = dict(TWINS)[sync]
    theirs = {p[0]: p for p in _params(sync)}
    ours = {p[0]: p for p in _params(aio) if p[1] is not inspect.Parameter.VAR_KEYWORD}
    assert [p for p in ours.values() if theirs.get(p[0]) != p] == []
    forwards = any(p[1] is inspect.Parameter.VAR_KEYWORD for p in _params(aio))
    assert forwards or set(theirs) <= set(ours), set(theirs) - set(ours)


def test_the_async_browse_functions_take_the_sync_ones_parameters() -> None:
    for name in ("queue_names", "list_messages"):
        assert _params(getattr(aio_browse, name)) == _params(getattr(browse, name)), name
        assert _awaited(getattr(aio_browse, name)), name


def test_the_exceptions_are_still_true() -> None:
    """Each listed method exists on its side, so the lists cannot hold stale entries."""
    for (cls, name), why in SYNC_ONLY.items():
        assert why and _is_method(_public(cls).get(name)), f"{cls.__name__}.{name}"
        aio = dict(TWINS)[cls]
        twin = _public(aio).get(name, _MISSING)
        assert twin is _MISSING or twin is _public(cls)[name], f"{aio.__name__}.{name} exists: drop it from SYNC_ONLY"
    for (aio, name), why in NOT_AWAITED.items():
        assert why and not _awaited(_function(_public(aio)[name])), f"{aio.__name__}.{name}"
    sync_of = {a: s for s, a in TWINS}
    for (aio, name), why in RENAMED.items():
        ours, theirs = _function(_public(aio)[name]), _function(_public(sync_of[aio])[name])
        assert why and _params(ours) != _params(theirs), f"{aio.__name__}.{name} matches now: drop it from RENAMED"
