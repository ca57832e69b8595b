"""Column types whose storage differs per backend, declared once for the schema and the migrations."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

# SQLite autoincrements only an INTEGER PRIMARY KEY (its rowid), which is 64-bit anyway.
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

# MySQL's BLOB holds 64 KiB; LONGBLOB is what BYTEA and SQLite's BLOB hold.
Payload = sa.LargeBinary().with_variant(mysql.LONGBLOB(), "mysql", "mariadb")


def name_type(length: int) -> sa.types.TypeEngine[str]:
    """VARCHAR compared byte for byte: MySQL's default collations fold case ('A' = 'a')."""
    return sa.String(length).with_variant(
        mysql.VARCHAR(length, charset="utf8mb4", collation="utf8mb4_bin"), "mysql", "mariadb"
    )


TABLE_OPTIONS: dict[str, Any] = {"mysql_engine": "InnoDB", "mysql_charset": "utf8mb4"}


class JsonList(sa.types.TypeDecorator[Sequence[Any]]):
    """A list (of ids, or of (id, token) pairs) bound as one JSON array text, for SQLite's ``json_each``:
    one statement text whatever the list's length."""

    impl = sa.String
    cache_ok = True

    def process_bind_param(self, value: Sequence[Any] | None, dialect: sa.Dialect) -> str | None:
        return None if value is None else json.dumps(value)
