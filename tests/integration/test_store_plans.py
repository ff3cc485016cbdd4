"""The console's searches use an index that yields rows in queue-id order.

A page of GET /api/v1/queue/entries is "the first N rows after the cursor in
(spid, idx) order".  With an index that ends in (spid, idx) after the
searched column, the database steps to the cursor and reads N rows; with
any other it reads every selected row and sorts them.  EXPLAIN QUERY PLAN
(SQLite) and EXPLAIN (PostgreSQL, with plans that scan the whole table or
sort made to look dear, as they would be at a million rows) show which.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from sluice.model import QueueState, Selector, Submission
from sluice.store.sqlite import SqliteStore
from tests.integration.stores import open_flavour

pytestmark = pytest.mark.integration

T0 = 1_800_000_000.0
CURSOR = ("0000000000000", 0)

SEARCHES = {
    "tenant": (Selector(tenantid="t3"), "queue_tenant_key"),
    "state": (Selector(states=(QueueState.DEFERRED,)), "queue_state_key"),
    "domain": (Selector(domain="d7.example"), "queue_domain"),
}


def _fill(store: Any) -> None:
    for i in range(60):
        store.submit(Submission("s@example.org", tuple(f"u{j}@d{j}.example" for j in range(8)),
                                tenantid=f"t{i % 7}", delay_s=60 * (i % 2)),
                     b"Subject: x\r\n\r\nx\r\n", T0 + i)


def _page_sql(store: Any, selector: Selector) -> tuple[str, list[Any]]:
    """The statement a page after a cursor runs (SqlQueue.entries), and its parameters."""
    sql = store._sql
    where, params = sql.where(selector)
    return sql._select + where + sql._after + sql._page, [*params, *CURSOR, 51]


@pytest.mark.parametrize("search", sorted(SEARCHES))
def test_sqlite_pages_walk_an_index_in_key_order(tmp_path: Path, search: str) -> None:
    store = open_flavour("sqlite", tmp_path)
    assert isinstance(store, SqliteStore)
    try:
        _fill(store)
        selector, index = SEARCHES[search]
        statement, params = _page_sql(store, selector)
        with sqlite3.connect(store.db_path) as conn:
            plan = " | ".join(row[-1] for row in conn.execute(
                "EXPLAIN QUERY PLAN " + statement, params))
            oldest = " | ".join(row[-1] for row in conn.execute(
                "EXPLAIN QUERY PLAN " + store._sql._oldest, ("deferred",)))
        assert f"USING INDEX {index}" in plan, plan
        assert "TEMP B-TREE" not in plan, plan  # no sort of the whole selection
        assert "USING INDEX queue_state_key" in oldest and "TEMP B-TREE" not in oldest, oldest
        # and the page is right
        page = list(store.entries(selector, after=f"{CURSOR[0]}-{CURSOR[1]}", limit=51))
        assert page and all(selector.matches(e) for e in page)
        assert [e.qid for e in page] == sorted(e.qid for e in page)
    finally:
        store.close()


@pytest.mark.parametrize("search", ["tenant", "state"])
def test_postgres_pages_walk_an_index_in_key_order(tmp_path: Path, search: str) -> None:
    store = open_flavour("postgres", tmp_path)
    try:
        _fill(store)
        selector, _ = SEARCHES[search]
        statement, params = _page_sql(store, selector)
        index = {"tenant": "sluice_queue_tenant_key", "state": "sluice_queue_state_key"}[search]
        with store._pool.connection() as conn, conn.transaction():
            conn.execute("SET LOCAL enable_seqscan = off")
            conn.execute("SET LOCAL enable_sort = off")
            rows = conn.execute("EXPLAIN " + statement, params).fetchall()
        plan = " | ".join(r[0] for r in rows)
        assert index in plan and "Sort" not in plan, plan
    finally:
        store.close()


def _refill_sql(store: Any) -> dict[str, tuple[str, tuple[Any, ...]]]:
    """The statements of a tenant-fair refill (SqlQueue._candidates), with parameters."""
    sql = store._sql
    return {
        "tenants": (sql._tenants, ("incoming", "incoming")),
        "new": (sql._pick[True, False], ("incoming", 0, "t3", 100)),
        "due": (sql._pick[True, True], ("deferred", 0, "t3", T0 + 100, 100)),
    }


def test_sqlite_refill_steps_along_the_tenant_index(tmp_path: Path) -> None:
    # A refill shares the batch between tenants; it must not read every
    # entry of a state to find them (the 50k-entry refill took 167 ms so).
    store = open_flavour("sqlite", tmp_path)
    assert isinstance(store, SqliteStore)
    try:
        _fill(store)
        with sqlite3.connect(store.db_path) as conn:
            for name, (statement, params) in _refill_sql(store).items():
                plan = " | ".join(row[-1] for row in conn.execute(
                    "EXPLAIN QUERY PLAN " + statement, params))
                assert "USING COVERING INDEX queue_refill" in plan or \
                    "USING INDEX queue_refill" in plan, (name, plan)
                assert "TEMP B-TREE" not in plan and "SCAN queue" not in plan, (name, plan)
    finally:
        store.close()


def test_postgres_refill_steps_along_the_tenant_index(tmp_path: Path) -> None:
    store = open_flavour("postgres", tmp_path)
    try:
        _fill(store)
        with store._pool.connection() as conn, conn.transaction():
            conn.execute("SET LOCAL enable_seqscan = off")
            conn.execute("SET LOCAL enable_sort = off")
            for name, (statement, params) in _refill_sql(store).items():
                statement = statement.replace("?", "%s")
                plan = " | ".join(r[0] for r in conn.execute("EXPLAIN " + statement,
                                                             params).fetchall())
                assert "sluice_queue_refill" in plan and "Sort" not in plan, (name, plan)
    finally:
        store.close()
