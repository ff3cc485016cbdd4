"""The PostgreSQL server the tests use: $SLUICE_PG_DSN, or a throwaway one.

The server is started once per test process, on first use (initdb into a
temporary directory, pg_ctl start on 127.0.0.1 and a free port, as the
``postgres`` user when we are root), and stopped and removed when the
process exits.  Every queue gets its own schema (named after its
directory), passed in the connection string's search_path, so tests never
see each other's rows.

SLUICE_PG_DSN is read here and then removed from the environment, so that
the stores and the subprocesses the tests start use the per-test
connection string of their configuration rather than the shared one.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import threading
from pathlib import Path

import psycopg
from psycopg.conninfo import make_conninfo

from sluice.store._pgserver import PgServer
from sluice.store.postgres import ENV_DSN

_EXTERNAL = os.environ.pop(ENV_DSN, None) or None
_lock = threading.Lock()
_server: PgServer | None = None
_schemas: list[str] = []


def external_dsn() -> str | None:
    """$SLUICE_PG_DSN as it was when the tests started, if it was set."""
    return _EXTERNAL


def base_dsn() -> str:
    """The server's connection string; starts the throwaway server on first use."""
    global _server
    if _EXTERNAL:
        return _EXTERNAL
    with _lock:
        if _server is None:
            _server = PgServer.start()
            atexit.register(_stop)
        return _server.dsn


def _stop() -> None:
    global _server
    if _server is not None:
        _server.stop()
        _server = None


def _drop_schemas() -> None:
    if not _schemas or not _EXTERNAL:
        return
    with psycopg.connect(_EXTERNAL, autocommit=True) as conn:
        for schema in _schemas:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


if _EXTERNAL:
    atexit.register(_drop_schemas)


def schema_for(tmp: Path) -> str:
    return "sluice_t_" + hashlib.sha1(str(tmp.resolve()).encode()).hexdigest()[:20]


def dsn_for(tmp: Path, **options: str) -> str:
    """A connection string for a queue of its own (schema per directory)."""
    base = base_dsn()
    schema = schema_for(tmp)
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
    if schema not in _schemas:
        _schemas.append(schema)
    settings = [f"-c search_path={schema}"] + [f"-c {k}={v}" for k, v in options.items()]
    return make_conninfo(base, options=" ".join(settings))
