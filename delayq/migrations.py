"""delayq's Alembic migrations: where they are, and how to run them or embed them in your own.

Standalone, delayq records its versions in its own table (``delayq_alembic_version``).
Embedded in an application's Alembic environment, add ``versions_location()`` to the
application's ``version_locations`` (delayq's revisions are the labelled branch ``delayq``),
run ``alembic upgrade heads``, and pass ``include_name`` (or delayq's ``metadata`` in
``target_metadata``) so autogenerate never proposes dropping delayq's tables.
"""

from __future__ import annotations

import functools
import re
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic.config import Config
from alembic.script import ScriptDirectory
from alembic.script.revision import RevisionError
from alembic.util.exc import CommandError
from sqlalchemy.engine import Connection, Engine

from alembic import command
from delayq.engines import create_engine, driver_url
from delayq.errors import SchemaRevisionError, UnknownRevisionError
from delayq.schema import DEFAULT_PREFIX, Tables, make_tables

BRANCH = "delayq"


def script_location() -> str:
    """The directory of delayq's Alembic environment: packaged in the wheel, or the source tree's."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_alembic", here.parent / "alembic"):
        if (candidate / "env.py").is_file():
            return str(candidate)
    raise FileNotFoundError("delayq's migrations are missing from this installation")


def versions_location() -> str:
    """The directory of delayq's revisions, for an application's ``version_locations``."""
    return str(Path(script_location()) / "versions")


def version_table(prefix: str = DEFAULT_PREFIX) -> str:
    """The table in which standalone delayq records its migration version."""
    return f"{prefix}alembic_version"


def config(
    url: str | None = None,
    *,
    connection: Connection | None = None,
    prefix: str = DEFAULT_PREFIX,
    schema: str | None = None,
) -> Config:
    """An Alembic ``Config`` for delayq's own environment, on a URL or an open connection. A URL whose scheme
    names no driver gets delayq's (``postgres://`` as ``postgresql+psycopg://``: ``delayq.engines.driver_url``)."""
    cfg = Config()
    cfg.set_main_option("script_location", script_location())
    url = None if url is None else driver_url(url)
    cfg.attributes.update({"url": url, "connection": connection, "delayq_prefix": prefix, "delayq_schema": schema})
    return cfg


def upgrade(url: str | None = None, revision: str = "heads", **kwargs: Any) -> None:
    """Apply delayq's migrations (Alembic's ``command.upgrade``); ``UnknownRevisionError`` for a revision
    delayq does not have. ``url`` as ``config`` takes it (``postgres://`` too)."""
    _check_target(revision)
    with _configured(url, kwargs) as cfg:
        command.upgrade(cfg, revision)


def downgrade(url: str | None = None, revision: str = "base", **kwargs: Any) -> None:
    """Revert delayq's migrations (Alembic's ``command.downgrade``); ``url`` as ``upgrade`` takes it."""
    _check_target(revision)
    with _configured(url, kwargs) as cfg:
        command.downgrade(cfg, revision)


@contextmanager
def _configured(url: str | None, kwargs: dict[str, Any]) -> Iterator[Config]:
    """``config(url, **kwargs)``; with a URL and no connection, on one transaction of an engine with delayq's
    network timeouts (a server that never answers fails the command in bounded time)."""
    url = None if url is None else driver_url(url)
    if url is None or kwargs.get("connection") is not None or sa.make_url(url).get_dialect().is_async:
        yield config(url, **kwargs)  # (an asyncio driver's URL: the environment connects, through ``run_sync``)
        return
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            yield config(url, **{**kwargs, "connection": conn})
    finally:
        engine.dispose()


_RELATIVE = re.compile(r"^(.+@)?[+-]\d+$")


@functools.cache
def _script() -> ScriptDirectory:
    return ScriptDirectory(script_location())


@functools.cache
def _revisions() -> frozenset[str]:
    return frozenset(r.revision for r in _script().walk_revisions())


def head_revisions() -> tuple[str, ...]:
    """The head revision(s) of the packaged migrations: the schema this delayq needs."""
    return tuple(sorted(_script().get_heads()))


def _check_target(revision: str) -> None:
    """Refuse, before anything runs, a target that names no revision of delayq's (``heads``, ``base``,
    ``+1`` and other Alembic spellings pass)."""
    if _RELATIVE.match(revision):
        return  # relative to the database's revision: Alembic judges it there
    try:
        _script().revision_map.get_revisions(revision)
    except (CommandError, RevisionError):
        known = ", ".join(sorted(_revisions()))
        raise UnknownRevisionError(
            f"no revision {revision!r} in delayq's migrations: give one of {known}, heads or base"
        ) from None


def database_revisions(conn: Connection, tables: Tables) -> set[str] | None:
    """delayq's revisions recorded in the database (standalone: ``{prefix}alembic_version``; embedded:
    the application's ``alembic_version``, its own revisions left out); None when neither table has any."""
    inspector = sa.inspect(conn)
    schema = tables.messages.schema
    prefix = tables.messages.name.removesuffix("messages")
    for name in (version_table(prefix), "alembic_version"):
        if not inspector.has_table(name, schema=schema):
            continue
        table = sa.table(name, sa.column("version_num", sa.String), schema=schema)
        found = {str(v) for v in conn.execute(sa.select(table.c.version_num)).scalars()}
        ours = {v for v in found if v in _revisions() or v.startswith(f"{BRANCH}_")}
        if ours:
            return ours
    return None


def revision_problem(conn: Connection, tables: Tables) -> str | None:
    """What is wrong with the database's revision for this delayq, in one line; None when it fits
    (or when no version is recorded: tables made without Alembic are judged by their use)."""
    found = database_revisions(conn, tables)
    if found is None:
        return None
    heads = set(head_revisions())
    newer = sorted(found - _revisions())
    shown = ", ".join(sorted(found))
    if newer:
        return (
            f"database at {shown}, newer than this delayq (its migrations end at {', '.join(sorted(heads))}): "
            "upgrade delayq, or run the version that migrated it"
        )
    if not heads <= found:
        return f"database at {shown}, this delayq needs {', '.join(sorted(heads))}: run `delayq migrate`"
    return None


_checked: weakref.WeakKeyDictionary[Engine, set[tuple[str | None, str]]] = weakref.WeakKeyDictionary()
_checked_lock = threading.Lock()


def check_revision(conn: Connection, tables: Tables) -> None:
    """Refuse a database at another revision than this delayq's (``SchemaRevisionError``): on the first
    use of each engine and table set, then never again (a success is remembered, a failure is not)."""
    key = (tables.messages.schema, tables.messages.name)
    engine = conn.engine
    with _checked_lock:
        if key in _checked.get(engine, ()):
            return
    problem = revision_problem(conn, tables)
    if problem is not None:
        raise SchemaRevisionError(problem)
    with _checked_lock:
        _checked.setdefault(engine, set()).add(key)


def table_names(prefix: str = DEFAULT_PREFIX) -> set[str]:
    """The names of delayq's tables, its version table included."""
    return {t.name for t in make_tables(prefix).metadata.sorted_tables} | {version_table(prefix)}


IncludeName = Callable[[str | None, str, Any], bool]


def include_name_for(prefix: str = DEFAULT_PREFIX) -> IncludeName:
    """An Alembic ``include_name`` hook that keeps delayq's tables out of an application's autogenerate."""
    ours = table_names(prefix)

    def include_name(name: str | None, type_: str, parent_names: Any) -> bool:
        return not (type_ == "table" and name in ours)

    return include_name


include_name = include_name_for()
"""``include_name_for()`` for the default table names."""


def migration_options() -> tuple[str, str | None]:
    """The prefix and schema a running migration builds, from Alembic's config or ``-x`` arguments."""
    from alembic import context

    cfg = context.config
    xargs = context.get_x_argument(as_dictionary=True)
    attrs = cfg.attributes if cfg is not None else {}
    prefix = attrs.get("delayq_prefix") or xargs.get("delayq_prefix") or DEFAULT_PREFIX
    schema = attrs.get("delayq_schema") or xargs.get("delayq_schema")
    return str(prefix), schema
