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
from delayq import aio as aio_api
from delayq.aio import AsyncDelayedQueue, AsyncDelivery, AsyncHandler, AsyncSubscription, AsyncTopic, AsyncWorker
from delayq.aio import browse as aio_browse
from delayq.errors import InvalidInputError

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

DEPRECATED_NAMES: dict[tuple[type, str], tuple[str, str, str]] = {
    (AsyncSubscription, "handle_exactly_once"): (
        "fn",
        "handler",
        "the async API called the callable fn= before it took the sync API's handler=; fn= still works, with a "
        "DeprecationWarning, so handler= has a default of None there",
    ),
}
"""Twins that still accept an old name of a parameter: (old name, the sync name, why). The old keyword-only
parameter is left out of the comparison and the sync-named one is compared without its default."""

ASYNC_ONLY: dict[tuple[type, str], str] = {}
"""Public methods of an async class with no sync twin, each with why."""

SAME_CONSTRUCTOR: set[type] = {DelayedQueue, Topic, Subscription}
"""Sync classes whose twin takes the same constructor parameters (the engine an ``AsyncEngine``), by name
or through ``**options`` handed on to the sync class."""

_MISSING = object()
_SYNC_OF = {a: s for s, a in TWINS}


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


def _compared(aio: type, name: str, twin: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
    """The twin's parameters as the sync method's should read: without a deprecated old name (and with the
    sync name's default taken from the sync method, since the twin must default it to accept the old name)."""
    params = _params(twin)
    if (aio, name) not in DEPRECATED_NAMES:
        return params
    old, new, _ = DEPRECATED_NAMES[aio, name]
    sync_default = {p[0]: p[2] for p in _params(_function(_public(_SYNC_OF[aio])[name]))}
    return [(n, k, sync_default[n] if n == new else d) for n, k, d in params if n != old]


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
        if _params(_function(member)) != _compared(aio, name, _function(twin)):
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
    for name in ("queue_names", "list_messages", "search_messages"):
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
    for (aio, name), (old, new, why) in DEPRECATED_NAMES.items():
        names = [p[0] for p in _params(_function(_public(aio)[name]))]
        assert why and old in names and new in names, f"{aio.__name__}.{name}: drop it from DEPRECATED_NAMES"
    for (aio, name), why in ASYNC_ONLY.items():
        assert why and _is_method(_public(aio).get(name)), f"{aio.__name__}.{name}"
        assert name not in _public(_SYNC_OF[aio]), f"{aio.__name__}.{name} has a sync twin: drop it from ASYNC_ONLY"


@pytest.mark.parametrize(("sync", "aio"), TWINS, ids=[a.__name__ for _, a in TWINS])
def test_no_async_class_has_a_public_method_its_sync_class_lacks(sync: type, aio: type) -> None:
    """The other direction: the async API adds no verb of its own (unless listed in ASYNC_ONLY)."""
    extra = sorted(
        name
        for name, member in _public(aio).items()
        if _is_method(member) and name not in _public(sync) and (aio, name) not in ASYNC_ONLY
    )
    assert extra == [], f"{aio.__name__} has public methods {sync.__name__} lacks: {extra}"


def test_every_public_class_of_the_async_api_is_checked_against_its_twin() -> None:
    """A class added to ``delayq.aio`` is a twin listed here, or has no sync counterpart (``AsyncUsing``)."""
    classes = {getattr(aio_api, name) for name in aio_api.__all__ if inspect.isclass(getattr(aio_api, name))}
    assert classes - {a for _, a in TWINS} == set()


def test_the_old_name_of_a_renamed_parameter_still_works_and_warns() -> None:
    """``AsyncSubscription.handle_exactly_once(fn=...)`` (no database: the argument check runs first)."""
    import asyncio

    sub = AsyncSubscription.__new__(AsyncSubscription)
    seen: list[Any] = []

    async def run(_using: Any, call: Callable[[Any], Any]) -> Any:
        seen.append(call)
        return "ran"

    sub._run = run  # type: ignore[method-assign]
    with pytest.warns(DeprecationWarning, match="handler="):
        assert asyncio.run(sub.handle_exactly_once(None, fn=lambda conn: 1)) == "ran"  # type: ignore[arg-type]
    assert asyncio.run(sub.handle_exactly_once(None, handler=lambda conn: 1)) == "ran"  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="handler= alone"):
        asyncio.run(sub.handle_exactly_once(None, lambda c: 1, fn=lambda c: 2))  # type: ignore[arg-type]
    assert len(seen) == 2


def test_the_verbs_table_of_docs_internals_names_real_methods() -> None:
    """Each ``name(`` of the queue and topic columns of docs/internals.md's "Queue and topic verbs" table is a
    method of one of that column's classes, so the table stays true when a verb changes."""
    import re
    from pathlib import Path

    from delayq.topics import TopicDelivery

    text = (Path(__file__).resolve().parent.parent / "docs" / "internals.md").read_text()
    table = text.split("### Queue and topic verbs", 1)[1].split("\n\n| act |", 1)[1].split("\n\n", 1)[0]
    rows = [line.split(" | ") for line in table.splitlines()[2:] if not line.startswith("| the async twin")]
    columns = {1: (DelayedQueue, Delivery), 2: (Topic, Subscription, TopicDelivery)}
    missing = [
        f"{name} ({'queue' if i == 1 else 'topic'} column)"
        for row in rows
        for i, classes in columns.items()
        for name in re.findall(r"(?:\b[A-Z]\w+\.)?(\w+)\(", row[i])
        if not any(callable(getattr(cls, name, None)) for cls in classes)
    ]
    assert rows and not missing, missing
