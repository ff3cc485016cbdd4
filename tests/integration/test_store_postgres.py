"""The postgres flavour's own promises, on a real server: nodes sharing a
queue never take the same recipient, each recovers only its own claims,
content lives in the database and goes with the last row, tables appear by
themselves, the connection string comes from config or SLUICE_PG_DSN, and a
full disk is a temporary failure.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from sluice.config import ConfigError
from sluice.model import QueueState, Reply, Selector, Submission
from sluice.store import Action, StorageError, Transition, open_store
from sluice.store.postgres import CHUNK_SIZE, ENV_DSN, PgStore
from tests.integration.pg import dsn_for, schema_for
from tests.integration.stores import check_migrated_v1_queue, flavour_config, run_diskfull

pytestmark = [pytest.mark.integration, pytest.mark.postgres]

T0 = 1_800_000_000.0
S = QueueState


@pytest.fixture
def dsn(tmp_path: Path) -> str:
    return dsn_for(tmp_path)


@pytest.fixture
def nodes(dsn: str) -> Iterator[tuple[PgStore, PgStore]]:
    a = PgStore(dsn, node_id="node-a")
    b = PgStore(dsn, node_id="node-b")
    yield a, b
    a.close()
    b.close()


def rows(dsn: str, sql: str, *params: object) -> list[tuple[object, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(sql, params).fetchall()


def test_two_nodes_claiming_at_once_never_take_the_same_recipient(
        nodes: tuple[PgStore, PgStore], dsn: str) -> None:
    a, b = nodes
    futures = [a.submit_future(Submission("s@example.org", (f"x{i}@d{i % 4}.example",
                                                            f"y{i}@e.example")), b"body", T0)
               for i in range(300)]
    qids = [q for f in futures for q in f.result().qids]
    got: dict[str, list[str]] = {"node-a": [], "node-b": []}
    start = threading.Barrier(2)

    def run(store: PgStore) -> None:
        start.wait()
        idle = 0
        while idle < 3:
            batch = store.claim(13, T0 + 1, 10)
            got[store.node_id] += [e.qid for e in batch]
            idle = 0 if batch else idle + 1

    threads = [threading.Thread(target=run, args=(s,)) for s in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got["node-a"] and got["node-b"], "both nodes should have claimed"
    assert not set(got["node-a"]) & set(got["node-b"])
    assert sorted(got["node-a"] + got["node-b"]) == sorted(qids)
    owners = dict(rows(dsn, "SELECT spid || '-' || idx, owner FROM sluice_queue"))
    assert all(owners[q] == "node-a" for q in got["node-a"])
    assert all(owners[q] == "node-b" for q in got["node-b"])

    # node-a restarts: only its own claims return to the queue.
    assert a.recover(T0 + 5) == len(got["node-a"])
    states = dict(rows(dsn, "SELECT spid || '-' || idx, state FROM sluice_queue"))
    assert {states[q] for q in got["node-a"]} == {"deferred"}
    assert {states[q] for q in got["node-b"]} == {"active"}


def test_a_tenant_fair_refill_keeps_the_per_destination_cap_and_skips_locked_rows(
        nodes: tuple[PgStore, PgStore]) -> None:
    a, b = nodes
    for i in range(40):
        a.submit(Submission("s@example.org", (f"x{i}@one.example",), tenantid="big"), b"x", T0)
    for i in range(10):
        a.submit(Submission("s@example.org", (f"y{i}@two.example",), tenantid="small"), b"y",
                 T0 + 1)
    a.per_domain_cap = 3
    first = a.claim(20, T0 + 5, 10)
    assert sorted(e.domain for e in first) == ["one.example"] * 3 + ["two.example"] * 3
    assert a.last_claim_capped
    # another node claiming at once never takes what the first holds, and
    # still gets both tenants' mail
    got: dict[str, list[str]] = {"node-a": [], "node-b": []}
    start = threading.Barrier(2)
    a.per_domain_cap = 0

    def run(store: PgStore) -> None:
        start.wait()
        while batch := store.claim(4, T0 + 5, 10):
            got[store.node_id] += [e.qid for e in batch]

    threads = [threading.Thread(target=run, args=(s,)) for s in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    taken = [e.qid for e in first] + got["node-a"] + got["node-b"]
    assert len(taken) == len(set(taken)) == 50


def test_content_of_a_message_delivered_by_two_nodes_at_once_is_removed(
        nodes: tuple[PgStore, PgStore], dsn: str) -> None:
    a, b = nodes
    spids = [a.submit(Submission("s@example.org", ("x@one.example", "y@two.example")),
                      b"z" * 100_000, T0).spid for _ in range(20)]
    for _ in spids:
        (ea,) = a.claim(1, T0, 0)
        (eb,) = b.claim(1, T0, 0)
        assert ea.spid == eb.spid and ea.qid != eb.qid
        go = threading.Barrier(2)

        def deliver(store: PgStore, qid: str, go: threading.Barrier) -> None:
            go.wait()
            store.apply([Transition(qid, None, reply=Reply(250, "2.0.0", "ok"))])

        threads = [threading.Thread(target=deliver, args=(a, ea.qid, go)),
                   threading.Thread(target=deliver, args=(b, eb.qid, go))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert rows(dsn, "SELECT count(*) FROM sluice_queue") == [(0,)]
    assert rows(dsn, "SELECT count(*) FROM sluice_content WHERE spid = ANY(%s)", spids) == [(0,)]


def test_tables_are_created_and_content_is_kept_in_chunk_rows(dsn: str, tmp_path: Path
                                                              ) -> None:
    store = PgStore(dsn, node_id="n1")
    try:
        body = bytes(range(256)) * 1000  # 256,000 bytes
        acc = store.submit(Submission("s@example.org", ("x@d.example",)), body, T0)
        tables = {r[0] for r in rows(
            dsn, "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
            schema_for(tmp_path))}
        assert {"sluice_queue", "sluice_content", "sluice_changes", "sluice_meta"} <= tables
        sizes = rows(dsn, "SELECT chunk, length(data) FROM sluice_content WHERE spid = %s "
                          "ORDER BY chunk", acc.spid)
        assert sizes == [(0, 0), (1, CHUNK_SIZE), (2, CHUNK_SIZE), (3, CHUNK_SIZE),
                         (4, len(body) - 3 * CHUNK_SIZE)]
        with store.open_content(acc.spid) as stream:
            assert stream.read(10) == body[:10]
            assert stream.read() == body[10:]
    finally:
        store.close()
    # Opening again on existing tables is fine.
    PgStore(dsn, node_id="n1").close()


def test_a_failed_commit_leaves_no_content(dsn: str) -> None:
    store = PgStore(dsn, node_id="n1")
    try:
        def broken():  # type: ignore[no-untyped-def]
            yield b"x" * 200_000
            raise ConnectionResetError("client went away")

        with pytest.raises(ConnectionResetError):
            store.submit(Submission("s@example.org", ("x@d.example",)), broken(), T0)
        assert rows(dsn, "SELECT count(*) FROM sluice_content") == [(0,)]
    finally:
        store.close()


def test_the_environment_overrides_the_configured_dsn(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = flavour_config("postgres", tmp_path, queue={"postgres": {"dsn": "host=192.0.2.1"}})
    monkeypatch.setenv(ENV_DSN, dsn_for(tmp_path))
    store = open_store(cfg)
    try:
        assert store.count().recipients == 0
    finally:
        store.close()
    monkeypatch.delenv(ENV_DSN)
    cfg = flavour_config("postgres", tmp_path, queue={"postgres": {"dsn": None}})
    with pytest.raises(ConfigError, match=r"queue\.postgres\.dsn"):
        open_store(cfg)


def test_an_operator_change_made_on_one_node_is_seen_by_the_other(
        nodes: tuple[PgStore, PgStore]) -> None:
    a, b = nodes
    acc = a.submit(Submission("s@example.org", ("x@d.example",)), b"body", T0)
    seq, _ = b.changes_since(0)
    a.modify(Selector(qids=acc.qids), Action.HOLD, T0)
    _, changes = b.changes_since(seq)
    assert [(c.qid, c.action) for c in changes] == [(acc.qids[0], Action.HOLD)]
    assert b.get(acc.qids[0]).state is S.HOLD  # type: ignore[union-attr]


def test_a_full_disk_is_a_temporary_failure_and_passes() -> None:
    # The tables live in a tablespace on a 4 MB tmpfs; the WAL stays on disk.
    found = run_diskfull("postgres", size="4m", ballast_mb=1)
    assert found["other_error"] is None
    assert found["error"] and "No space left" in found["error"]
    assert found["accepted"] > 0 and found["second_ok"] is False
    assert found["all_listed"] and found["all_intact"] and found["count"] == found["accepted"]
    assert found["after_ok"], found.get("after_error")
    assert found["count_after"] == found["accepted"] - 3 + 1


# -- schema versions ----------------------------------------------------------------------

#: The queue table as Sluice created it in schema version 1 (before the
#: SMTPUTF8 flag), with the tables the migration test needs; opening
#: creates the others.
V1_SCHEMA = """
CREATE TABLE sluice_queue (
    spid            text COLLATE "C" NOT NULL,
    idx             integer NOT NULL,
    sender          text NOT NULL,
    recipient       text NOT NULL,
    domain          text NOT NULL,
    state           text NOT NULL,
    arrival_at      double precision NOT NULL,
    next_attempt_at double precision NOT NULL,
    attempts        integer NOT NULL DEFAULT 0,
    last_code       integer,
    last_enhanced   text,
    last_text       text,
    priority        smallint NOT NULL DEFAULT 0,
    tenantid        text NOT NULL DEFAULT '',
    jobid           text NOT NULL DEFAULT '',
    transportid     text NOT NULL DEFAULT '',
    localip         text NOT NULL DEFAULT '',
    is_report       boolean NOT NULL DEFAULT false,
    size            bigint NOT NULL DEFAULT 0,
    owner           text,
    PRIMARY KEY (spid, idx)
);
CREATE TABLE sluice_content (
    spid       text COLLATE "C" NOT NULL,
    chunk      integer NOT NULL,
    data       bytea NOT NULL,
    created_at double precision NOT NULL,
    PRIMARY KEY (spid, chunk)
);
CREATE TABLE sluice_meta (key text PRIMARY KEY, value text);
INSERT INTO sluice_meta (key, value) VALUES ('schema_version', '1');
"""

OLD_SPID = "1A2016772261AA74"


def _v1_queue(dsn: str) -> None:
    """A version-1 queue holding one message for one recipient."""
    with psycopg.connect(dsn) as conn:
        conn.execute(V1_SCHEMA)
        conn.execute("INSERT INTO sluice_queue (spid, idx, sender, recipient, domain, state, "
                     "arrival_at, next_attempt_at, size) VALUES (%s, 0, 'a@example.org', "
                     "'b@example.net', 'example.net', 'incoming', %s, %s, 5)",
                     (OLD_SPID, T0, T0))
        conn.execute("INSERT INTO sluice_content (spid, chunk, data, created_at) "
                     "VALUES (%s, 0, '', %s), (%s, 1, 'hello', %s)",
                     (OLD_SPID, T0, OLD_SPID, T0))


def _schema(dsn: str, tmp_path: Path) -> tuple[object, list[object]]:
    """The recorded schema version and the queue table's columns."""
    (version,) = rows(dsn, "SELECT value FROM sluice_meta WHERE key = 'schema_version'")[0]
    columns = [r[0] for r in rows(
        dsn, "SELECT column_name FROM information_schema.columns WHERE table_schema = %s "
             "AND table_name = 'sluice_queue'", schema_for(tmp_path))]
    return version, columns


def test_a_version_1_queue_is_migrated_when_opened(dsn: str, tmp_path: Path) -> None:
    _v1_queue(dsn)
    version, columns = _schema(dsn, tmp_path)
    assert version == "1" and "smtputf8" not in columns
    # Two nodes start at once: one migrates, the other waits and finds it done.
    stores: list[PgStore] = []
    start = threading.Barrier(2)

    def open_one() -> None:
        start.wait()
        stores.append(PgStore(dsn, node_id=f"n{len(stores)}"))

    threads = [threading.Thread(target=open_one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(stores) == 2
    store = stores[0]
    try:
        check_migrated_v1_queue(store, OLD_SPID, "b@example.net", b"hello", T0 + 1)
    finally:
        for s in stores:
            s.close()
    version, columns = _schema(dsn, tmp_path)
    assert version == "3"
    assert [columns.count(c) for c in ("smtputf8", "last_mta", "last_attempt_at")] == [1, 1, 1]
    PgStore(dsn, node_id="n1").close()  # opening again changes nothing
    assert _schema(dsn, tmp_path) == (version, columns)


def test_a_queue_newer_than_the_code_is_refused_and_left_alone(dsn: str, tmp_path: Path
                                                               ) -> None:
    PgStore(dsn, node_id="n1").close()
    with psycopg.connect(dsn) as conn:
        conn.execute("UPDATE sluice_meta SET value = '4' WHERE key = 'schema_version'")
    before = _schema(dsn, tmp_path)
    with pytest.raises(StorageError, match=rf"schema {schema_for(tmp_path)}.*schema version 4"):
        PgStore(dsn, node_id="n1")
    assert _schema(dsn, tmp_path) == before
