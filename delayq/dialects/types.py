"""Column types whose storage differs per backend, declared once for the schema and the migrations."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql
from sqlalchemy.ext.compiler import compiles

# SQLite autoincrements only an INTEGER PRIMARY KEY (its rowid), which is 64-bit anyway.
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

# MySQL's BLOB holds 64 KiB; LONGBLOB is what BYTEA and SQLite's BLOB hold.
Payload = sa.LargeBinary().with_variant(mysql.LONGBLOB(), "mysql", "mariadb")


def name_type(length: int) -> sa.types.TypeEngine[str]:
    """VARCHAR compared byte for byte: MySQL's default collations fold case ('A' = 'a'), and its
    ``utf8mb4_bin`` pads with spaces ('a' = 'a '); on MySQL/MariaDB the column takes the server's
    binary NO PAD collation (``nopad_collation``)."""
    return sa.String(length).with_variant(_NoPadVarchar(length), "mysql", "mariadb")


def key_type(length: int) -> sa.types.TypeEngine[str]:
    """``name_type`` for message keys, which delayq selects by prefix (a range compared byte for byte,
    ``Dialect.starts_with``): on PostgreSQL the column takes the collation "C", so its (queue, key) index
    serves those ranges (and orders keys by code point, as on the other backends); see delayq_0010."""
    return name_type(length).with_variant(sa.String(length, collation="C"), "postgresql")


def pad_space_name_type(length: int) -> sa.types.TypeEngine[str]:
    """``name_type`` as delayq_0001 to delayq_0004 made it: ``utf8mb4_bin`` (PAD SPACE) on MySQL/MariaDB.
    For those revisions only, so that they build what they always built (delayq_0005 changes it)."""
    return sa.String(length).with_variant(
        mysql.VARCHAR(length, charset="utf8mb4", collation="utf8mb4_bin"), "mysql", "mariadb"
    )


class _NoPadVarchar(mysql.VARCHAR):
    """A utf8mb4 VARCHAR whose collation is the connected server's binary NO PAD one (see below)."""


def nopad_collation(dialect: sa.Dialect) -> str:
    """The utf8mb4 collation that compares byte for byte, trailing spaces included, on this server.

    MariaDB: ``utf8mb4_nopad_bin`` (10.2 and later). MySQL 8.0.17 and later: ``utf8mb4_0900_bin``.
    Older MySQL 8.0 has no binary NO PAD utf8mb4 collation: ``utf8mb4_bin`` there (PAD SPACE).
    """
    if getattr(dialect, "is_mariadb", False):
        return "utf8mb4_nopad_bin"
    version = dialect.server_version_info
    return "utf8mb4_bin" if version is not None and tuple(version[:3]) < (8, 0, 17) else "utf8mb4_0900_bin"


@compiles(_NoPadVarchar, "mysql")
@compiles(_NoPadVarchar, "mariadb")
def _compile_nopad_varchar(type_: _NoPadVarchar, compiler: Any, **kw: Any) -> str:
    chosen = mysql.VARCHAR(type_.length, charset="utf8mb4", collation=nopad_collation(compiler.dialect))
    return str(compiler.process(chosen, **kw))


TABLE_OPTIONS: dict[str, Any] = {"mysql_engine": "InnoDB", "mysql_charset": "utf8mb4"}


class JsonList(sa.types.TypeDecorator[Sequence[Any]]):
    """A list (of ids, or of (id, token) pairs) bound as one JSON array text, for SQLite's ``json_each``:
    one statement text whatever the list's length."""

    impl = sa.String
    cache_ok = True

    def process_bind_param(self, value: Sequence[Any] | None, dialect: sa.Dialect) -> str | None:
        return None if value is None else json.dumps(value)
