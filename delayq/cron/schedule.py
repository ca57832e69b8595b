"""Schedule: what a recurring message is and when it runs; the keys its runs are stored under.

Every process computes the same runs from a schedule and names each ``\\x1fcron/{name}/{config_hash}/{due_ms}``
(``NAMESPACE``, ``RUN_KEY``), so the same run has the same key wherever it is installed. Runs installed by
delayq before the namespace have the shape ``LEGACY_KEY``; ``parse_run_key`` reads both.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
import zoneinfo
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import cronsim

from delayq.clock import EPOCH, to_ms
from delayq.dialects.base import prefix_bounds
from delayq.errors import InvalidInputError
from delayq.schema import MAX_SCHEDULE_NAME_LENGTH

AHEAD = 4
"""How many upcoming runs of each schedule are kept installed, unless the schedule says otherwise."""
MAX_AHEAD_RUNS = 1000
"""The most runs a look-ahead window installs at once."""
HASH_LENGTH = 12
MAX_PREFIX_LENGTH = MAX_SCHEDULE_NAME_LENGTH
NAMESPACE = "\x1fcron/"
"""The start of every run's key. U+001F (the ASCII unit separator) is a control character that no text a
person types or a program prints by accident contains, so no ordinary key falls under it; JSON and
``repr`` show it as ``\\u001f`` / ``\\x1f``, so a run's key is recognisable wherever it is listed."""
LEGACY_KEY = re.compile(rf"(?P<name>[^/]+)/(?P<config>[0-9a-f]{{{HASH_LENGTH}}})/(?P<due>\d+)")
"""The key of a run installed by delayq before ``NAMESPACE``: ``{name}/{config_hash}/{due_ms}``."""
RUN_KEY = re.compile(re.escape(NAMESPACE) + r"(?P<name>[^/]+)/(?P<config>[0-9A-Za-z_-]{1,32})/(?P<due>\d+)")

Payload = Any
"""A run's payload: a value, or a callable that receives the run's due time and returns one."""


@dataclass(frozen=True)
class Schedule:
    """A recurring message: a name, a payload, and when it runs.

    Build one with ``Schedule.periodic``, ``Schedule.daily`` or ``Schedule.cron`` and declare it on a
    ``Handler`` (``schedules = [...]``), or install it with a ``CronService``.

    ``payload`` is a value, or a callable that receives the run's due time (aware, in ``tz``) and returns
    the payload of that run. ``ahead`` is the look-ahead: how many upcoming runs are kept installed (an
    int, 4 by default), or a ``timedelta``: every run due within that window (at least one).
    """

    name: str
    payload: Payload = None
    every: dt.timedelta | None = None
    expressions: tuple[str, ...] = ()
    tz: str = "UTC"
    ahead: int | dt.timedelta = AHEAD
    kind: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        check_name(self.name)
        if (self.every is None) == (not self.expressions):
            raise InvalidInputError("a schedule runs either every period or on cron expressions")
        every = self.every
        if every is not None and (not isinstance(every, dt.timedelta) or every < dt.timedelta(seconds=1)):
            raise InvalidInputError("every must be a timedelta of at least one second")
        check_zone(self.tz)
        for expression in self.expressions:
            try:
                cronsim.CronSim(expression, dt.datetime.now(dt.UTC))
            except cronsim.CronSimError as exc:
                raise InvalidInputError(f"bad cron expression {expression!r}: {exc}") from None
        ahead = self.ahead
        if isinstance(ahead, bool) or not (
            (isinstance(ahead, int) and 1 <= ahead <= MAX_AHEAD_RUNS)
            or (isinstance(ahead, dt.timedelta) and ahead > dt.timedelta(0))
        ):
            raise InvalidInputError(f"ahead is a number of runs (1 to {MAX_AHEAD_RUNS}) or a positive timedelta")
        if not self.kind:
            object.__setattr__(self, "kind", "periodic" if self.every is not None else "cron")

    # -- the ways to build one --------------------------------------------------------------------
    @classmethod
    def periodic(
        cls, name: str, every: dt.timedelta, *, payload: Payload = None, ahead: int | dt.timedelta = AHEAD
    ) -> Schedule:
        """Run every ``every``, aligned to the Unix epoch (so every process computes the same times)."""
        return cls(name, payload, every=every, ahead=ahead, kind="periodic")

    @classmethod
    def daily(
        cls,
        name: str,
        at: Iterable[dt.time],
        *,
        tz: str = "UTC",
        payload: Payload = None,
        ahead: int | dt.timedelta = AHEAD,
    ) -> Schedule:
        """Run every day at the wall-clock times ``at`` in time zone ``tz``.

        A time that does not exist on a spring-forward day runs at the first minute after the gap;
        one that occurs twice on a fall-back day runs once, at the first occurrence.
        """
        times = sorted(set(at))
        if not times or any(t.second or t.microsecond or t.tzinfo for t in times):
            raise InvalidInputError("at takes one or more naive times with whole minutes, e.g. time(2, 30)")
        expressions = tuple(f"{t.minute} {t.hour} * * *" for t in times)
        return cls(name, payload, expressions=expressions, tz=tz, ahead=ahead, kind="daily")

    @classmethod
    def cron(
        cls, name: str, expression: str, *, tz: str = "UTC", payload: Payload = None, ahead: int | dt.timedelta = AHEAD
    ) -> Schedule:
        """Run on a cron expression (five fields, parsed by cronsim) in time zone ``tz``."""
        return cls(name, payload, expressions=(expression,), tz=tz, ahead=ahead, kind="cron")

    @classmethod
    def from_definition(cls, name: str, definition: Mapping[str, Any]) -> Schedule:
        """The timing of a recorded schedule (its payload is not recorded)."""
        every = definition.get("every_ms")
        ahead = definition.get("ahead_ms")
        return cls(
            name,
            None,
            every=None if every is None else dt.timedelta(milliseconds=every),
            expressions=tuple(definition.get("cron", ())),
            tz=definition.get("tz", "UTC"),
            ahead=dt.timedelta(milliseconds=ahead) if ahead is not None else int(definition.get("ahead", AHEAD)),
            kind=definition.get("kind", ""),
        )

    # -- what it is -------------------------------------------------------------------------------
    @property
    def prefix(self) -> str:
        """The schedule's name (what delayq before 0.2 called its prefix)."""
        return self.name

    @property
    def definition(self) -> dict[str, Any]:
        """What the schedule's record shows: kind, period or expressions, time zone, look-ahead."""
        found: dict[str, Any] = {"kind": self.kind, "tz": self.tz}
        if self.every is not None:
            found["every_ms"] = self.every // dt.timedelta(milliseconds=1)
        else:
            found["cron"] = list(self.expressions)
        if isinstance(self.ahead, dt.timedelta):
            found["ahead_ms"] = self.ahead // dt.timedelta(milliseconds=1)
        else:
            found["ahead"] = self.ahead
        if callable(self.payload):
            found["payload"] = f"computed by {_qualname(self.payload)}"
        return found

    @property
    def config_hash(self) -> str:
        """Stable across processes and restarts; changes when the timing or the payload does.

        A computed payload is known by its function's qualified name: changing its body keeps the
        installed runs (each carries the payload computed when it was installed).
        """
        payload = f"computed by {_qualname(self.payload)}" if callable(self.payload) else self.payload
        canonical = json.dumps(
            {
                "every_ms": None if self.every is None else self.every // dt.timedelta(milliseconds=1),
                "cron": list(self.expressions),
                "tz": self.tz,
                "payload": payload,
            },
            sort_keys=True,
            separators=(",", ":"),
            default=str,
        )
        return hashlib.sha256(canonical.encode()).hexdigest()[:HASH_LENGTH]

    def payload_for(self, due: dt.datetime) -> Any:
        """The payload of the run due at ``due``."""
        if callable(self.payload):
            return self.payload(due.astimezone(zoneinfo.ZoneInfo(self.tz)))
        return self.payload

    # -- when it runs -----------------------------------------------------------------------------
    def runs_after(self, after: dt.datetime, count: int) -> list[dt.datetime]:
        """The next ``count`` due times strictly after ``after`` (aware, UTC)."""
        if self.every is not None:
            step = self.every
            first = EPOCH + step * ((after - EPOCH) // step + 1)
            return [first + step * i for i in range(count)]
        zone = zoneinfo.ZoneInfo(self.tz)
        found: set[dt.datetime] = set()
        for expression in self.expressions:
            it = cronsim.CronSim(expression, after.astimezone(zone))
            for _ in range(count):
                found.add(next(it).astimezone(dt.UTC))
        return sorted(t for t in found if t > after)[:count]

    def run_before(self, before: dt.datetime) -> dt.datetime | None:
        """The latest due time at or before ``before`` (aware, UTC)."""
        if self.every is not None:
            return EPOCH + self.every * ((before - EPOCH) // self.every)
        zone = zoneinfo.ZoneInfo(self.tz)
        start = (before + dt.timedelta(seconds=1)).astimezone(zone)
        found = [next(cronsim.CronSim(e, start, reverse=True)).astimezone(dt.UTC) for e in self.expressions]
        return max((t for t in found if t <= before), default=None)

    def upcoming(self, now: dt.datetime) -> list[dt.datetime]:
        """The runs the look-ahead keeps installed at ``now``: strictly after it."""
        if isinstance(self.ahead, int):
            return self.runs_after(now, self.ahead)
        runs = self.runs_after(now, MAX_AHEAD_RUNS)
        within = [t for t in runs if t <= now + self.ahead]
        return within or runs[:1]

    def period(self, now: dt.datetime) -> dt.timedelta:
        """The gap between the next two runs: the refresh interval is a quarter of it (or of the look-ahead)."""
        first, second = self.runs_after(now, 2)
        gap = second - first
        return min(gap, self.ahead) if isinstance(self.ahead, dt.timedelta) else gap


def _qualname(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


# -- keys ---------------------------------------------------------------------------------------------
def schedule_prefix(name: str) -> str:
    """The start of every run key of schedule ``name``, of any configuration."""
    return f"{NAMESPACE}{name}/"


def run_prefix(name: str, config_hash: str) -> str:
    """The start of the run keys of one configuration of schedule ``name``."""
    return f"{NAMESPACE}{name}/{config_hash}/"


def run_key(prefix: str, config_hash: str, due: dt.datetime) -> str:
    """The key of one run: ``\\x1fcron/{name}/{config_hash}/{due_ms}``."""
    return run_key_ms(prefix, config_hash, to_ms(due))


def run_key_ms(name: str, config_hash: str, due_ms: int) -> str:
    return f"{run_prefix(name, config_hash)}{due_ms}"


def parse_run_key(key: str) -> tuple[str, str, int] | None:
    """``(name, config_hash, due_ms)`` of a run's key (either shape), or None for another key."""
    match = RUN_KEY.fullmatch(key) or LEGACY_KEY.fullmatch(key)
    return None if match is None else (match["name"], match["config"], int(match["due"]))


def namespace_bounds() -> dict[str, str]:
    """``prefix_bounds`` of ``NAMESPACE``: every run key, of every schedule."""
    return prefix_bounds(NAMESPACE)


def check_name(name: object) -> str:
    if not isinstance(name, str) or not name or "/" in name or len(name) > MAX_PREFIX_LENGTH:
        raise InvalidInputError(
            f"a cron schedule's name is a non-empty string of at most {MAX_PREFIX_LENGTH} characters "
            f"without '/', got {name!r}"
        )
    return name


check_prefix = check_name


def check_zone(tz: str) -> str:
    try:
        zoneinfo.ZoneInfo(tz)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, TypeError):
        raise InvalidInputError(f"unknown time zone {tz!r}") from None
    return tz
