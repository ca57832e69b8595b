"""Create the databases the test suite needs when the servers do not have them yet (scripts/test runs it).

The URLs are the suite's: DELAYQ_TEST_POSTGRES_URL and DELAYQ_TEST_MYSQL_URL, or the local servers'
``test`` databases. A server that cannot be reached is reported and left to the suite, which fails on it.
"""

from __future__ import annotations

import os

import sqlalchemy as sa

DEFAULTS = {
    "DELAYQ_TEST_POSTGRES_URL": "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    "DELAYQ_TEST_MYSQL_URL": "mysql+mysqldb://root@127.0.0.1:3306/test",
}


def ensure(url: sa.URL) -> str:
    """Create ``url``'s database unless it exists; what was done, in words."""
    name = url.database
    if not name or url.get_backend_name() not in ("postgresql", "mysql", "mariadb"):
        return "nothing to create"
    postgres = url.get_backend_name() == "postgresql"
    server = url._replace(database="postgres" if postgres else None)
    engine = sa.create_engine(server, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            quoted = conn.dialect.identifier_preparer.quote_identifier(name)
            catalog = sa.table("pg_database") if postgres else sa.table("schemata", schema="information_schema")
            column = sa.column("datname" if postgres else "schema_name")
            found = sa.select(sa.literal(1)).select_from(catalog).where(column == name)
            if conn.execute(found).first() is not None:
                return "exists"
            conn.exec_driver_sql(f"CREATE DATABASE {quoted}")
            return "created"
    except sa.exc.OperationalError as exc:
        return f"cannot reach the server ({str(exc.orig).strip().splitlines()[0]})"
    finally:
        engine.dispose()


def main() -> None:
    for var, default in DEFAULTS.items():
        url = sa.make_url(os.environ.get(var, default))
        print(f"{url.render_as_string()}: {ensure(url)}")


if __name__ == "__main__":
    main()
