"""delayq's Alembic migrations: where they are, and how to run them or embed them in your own.

Standalone, delayq records its versions in its own table (``delayq_alembic_version``).
Embedded in an application's Alembic environment, add ``versions_location()`` to the
application's ``version_locations`` (delayq's revisions are the labelled branch ``delayq``),
run ``alembic upgrade heads``, and pass ``include_name`` (or delayq's ``metadata`` in
``target_metadata``) so autogenerate never proposes dropping delayq's tables.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from alembic.config import Config
from sqlalchemy.engine import Connection

from alembic import command
from delayq.schema import DEFAULT_PREFIX, make_tables

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
    """An Alembic ``Config`` for delayq's own environment, on a URL or an open connection."""
    cfg = Config()
    cfg.set_main_option("script_location", script_location())
    cfg.attributes.update({"url": url, "connection": connection, "delayq_prefix": prefix, "delayq_schema": schema})
    return cfg


def upgrade(url: str | None = None, revision: str = "heads", **kwargs: Any) -> None:
    """Apply delayq's migrations (Alembic's ``command.upgrade``)."""
    command.upgrade(config(url, **kwargs), revision)


def downgrade(url: str | None = None, revision: str = "base", **kwargs: Any) -> None:
    """Revert delayq's migrations (Alembic's ``command.downgrade``)."""
    command.downgrade(config(url, **kwargs), revision)


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
