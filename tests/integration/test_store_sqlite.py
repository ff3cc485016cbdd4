"""SQLite flavour specifics: which commits are flushed, content that a
commit without a flush freed is not deleted before the flush, small
content kept in the database in the same commit as its rows, and queues
of an older schema version migrated when opened (a newer one refused)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import sluice.store._sqlite_segments as sqlite_segments
import sluice.store.sqlite as sqlite_module
from sluice.model import QueueState, Reply, Selector, Submission
from sluice.store import Action, StorageError, Transition
from sluice.store.sqlite import SqliteStore
from tests.integration.stores import (
    check_migrated_v1_queue,
    fail_inserts,
    open_flavour,
    run_diskfull,
)

pytestmark = pytest.mark.integration

T0 = 1_800_000_000.0


def _store(tmp_path: Path, **queue: object) -> SqliteStore:
    store = open_flavour("sqlite", tmp_path, queue=queue)
    assert isinstance(store, SqliteStore)
    return store


MSG = Submission("a@example.org", ("b@example.net", "c@example.com"))


def _content_rows(store: SqliteStore) -> list[tuple[int, bytes]]:
    with sqlite3.connect(store.db_path) as conn:
        return [(int(i), bytes(d)) for i, d in conn.execute("SELECT id, data FROM content")]


def _spool_files(store: SqliteStore) -> list[Path]:
    return [p for p in Path(store.spool.root).rglob("*") if p.is_file()]


def _spy_flushes(store: SqliteStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record each WAL flush, and whether any caller had heard of its batch."""
    seen: list[str] = []
    flush = store._flush_wal
    monkeypatch.setattr(store, "_flush_wal", lambda: (seen.append("flush"), flush())[1])
    return seen


def test_submissions_and_operator_changes_are_flushed_outcomes_are_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with _store(tmp_path) as store:
        # The writer never syncs inside a commit (that would hold the write
        # lock for the fsync); the committer flushes the WAL afterwards.
        assert store._writer.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
        seen = _spy_flushes(store, monkeypatch)
        acc = store.submit(MSG, b"x\r\n", T0)
        assert seen == ["flush"]  # before submit returned
        entries = store.claim(10, T0, 10)  # a claim: not flushed
        store.apply([Transition(entries[0].qid, None, reply=Reply(250, "2.0.0", "ok"))],
                    durable=False)
        assert seen == ["flush"]
        store.modify(Selector(qids=(acc.spid,)), Action.HOLD, T0)  # an operator's change
        assert seen == ["flush", "flush"]


def test_callers_that_need_no_flush_do_not_wait_for_their_batch_s_flush(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A "delivering" mark committed with a delivery's outcome was answered
    # only after the outcome's fsync, and every delivery waits for its mark
    # before the message goes out.
    import threading

    with _store(tmp_path) as store:
        acc = store.submit(MSG, b"x", T0)
        first, second = store.claim(10, T0, 10)
        gate = threading.Event()
        busy = store._submit_op(lambda after: gate.wait(10))  # holds the committer
        mark = store._submit_op(lambda after: store._sql.get(first.qid), durable=False)
        outcome = store._submit_op(lambda after: store._sql.get(second.qid))
        at_flush: list[tuple[bool, bool]] = []
        flush = store._flush_wal

        def spy() -> None:
            at_flush.append((mark.done(), outcome.done()))
            flush()

        monkeypatch.setattr(store, "_flush_wal", spy)
        gate.set()
        busy.result(10)
        assert mark.result(10) is not None and outcome.result(10) is not None
        assert (True, False) in at_flush
        assert acc.spid == first.spid


def test_the_next_batch_commits_while_the_last_one_is_flushed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The committer ran each batch's fsync itself, so a "delivering" mark
    # (no flush needed) queued behind a delivery's outcome waited for the
    # outcome's fsync: every delivery of the queue manager paid for it.
    # The flush now runs on its own thread while the next batch commits.
    import threading

    with _store(tmp_path) as store:
        store.submit(MSG, b"x", T0)
        first, second = store.claim(10, T0, 10)
        in_flush, release = threading.Event(), threading.Event()
        flush = store._flush_wal

        def slow_flush() -> None:
            in_flush.set()
            assert release.wait(10)
            flush()

        monkeypatch.setattr(store, "_flush_wal", slow_flush)
        outcome = store._submit_op(lambda after: store._sql.get(first.qid))
        assert in_flush.wait(10)
        mark = store._submit_op(lambda after: store._sql.get(second.qid), durable=False)
        try:
            # Committed and answered while the outcome's flush is still held.
            assert mark.result(10) is not None
            assert not outcome.done()
        finally:
            release.set()
        assert outcome.result(10) is not None
        # Both were committed, the durable one answered only after its flush.
        monkeypatch.setattr(store, "_flush_wal", flush)
        assert store.submit(MSG, b"y", T0).spid

def test_a_failed_flush_fails_the_callers_that_needed_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with _store(tmp_path) as store:
        def broken() -> None:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(store, "_flush_wal", broken)
        with pytest.raises(StorageError, match="could not be synced"):
            store.submit(MSG, b"maybe lost", T0)
        # The rows were committed (a retried submission may duplicate them),
        # and a batch that needed no flush still succeeds.
        assert store.count().messages == 1
        assert len(store.claim(10, T0, 10)) == 2


def test_content_freed_without_a_flush_goes_only_after_the_wal_is_synced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with _store(tmp_path) as store:
        acc = store.submit(Submission("a@example.org", ("b@example.net",)),
                           iter([b"hello\r\n"]), T0)
        (entry,) = store.claim(10, T0, 10)
        path = str(store.spool.path(acc.spid))
        seen: list[str] = []
        flush, unlink = store._flush_wal, os.unlink

        def spy_flush() -> None:
            seen.append("flush")
            flush()

        def spy_unlink(p: str | os.PathLike[str], *a: object, **kw: object) -> None:
            if os.fspath(p) == path:
                seen.append("unlink")
            unlink(p)

        monkeypatch.setattr(store, "_flush_wal", spy_flush)
        monkeypatch.setattr(os, "unlink", spy_unlink)
        store.apply([Transition(entry.qid, None, reply=Reply(250, "2.0.0", "ok"))],
                    durable=False)
        deadline = time.monotonic() + 5
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not os.path.exists(path)
        assert seen[:2] == ["flush", "unlink"]


def test_durable_removal_needs_no_extra_flush(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    with _store(tmp_path) as store:
        acc = store.submit(Submission("a@example.org", ("b@example.net",)),
                           iter([b"hello\r\n"]), T0)
        (entry,) = store.claim(10, T0, 10)
        flushes: list[int] = []
        monkeypatch.setattr(store, "_flush_wal", lambda: flushes.append(1))
        store.apply([Transition(entry.qid, None)])
        path = store.spool.path(acc.spid)
        deadline = time.monotonic() + 5
        while path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        # The commit's own sync, and none before the unlink.
        assert not path.exists() and flushes == [1]


def test_small_content_is_committed_in_the_database_without_a_file(tmp_path: Path) -> None:
    body = b"Subject: x\r\n\r\n.leading dot\r\n\x00\xff binary\r\n"
    with _store(tmp_path) as store:
        assert store.inline_max == 65536  # the default
        acc = store.submit(MSG, [body[:10], body[10:]], T0)
        assert _spool_files(store) == []
        assert _content_rows(store) == [(int(acc.spid, 16), body)]
        assert acc.size == len(body)
        with store.open_content(acc.spid) as stream:
            assert stream.read() == body
        # The content goes with the last row, in the same transaction.
        entries = store.claim(10, T0, 10)
        store.apply([Transition(entries[0].qid, None)])
        assert len(_content_rows(store)) == 1
        store.apply([Transition(entries[1].qid, None)])
        assert _content_rows(store) == []
        assert store.count().messages == 0
        with pytest.raises(StorageError):
            store.open_content(acc.spid)


def test_big_or_streamed_content_goes_to_a_spool_file(tmp_path: Path) -> None:
    with _store(tmp_path, spool={"inline_max": 100, "layout": "files"}) as store:
        big = store.submit(MSG, b"x" * 101, T0)
        streamed = store.submit(MSG, iter([b"y" * 10]), T0)
        small = store.submit(MSG, b"z" * 100, T0)
        assert _content_rows(store) == [(int(small.spid, 16), b"z" * 100)]
        assert sorted(p.stem for p in _spool_files(store)) == sorted([big.spid, streamed.spid])
        for acc, data in ((big, b"x" * 101), (streamed, b"y" * 10), (small, b"z" * 100)):
            with store.open_content(acc.spid) as stream:
                assert stream.read() == data
        store.modify(Selector(), Action.DELETE, T0)
        deadline = time.monotonic() + 5
        while _spool_files(store) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _spool_files(store) == [] and _content_rows(store) == []


def test_open_large_reads_the_spool_file_and_finds_an_inline_content_too(tmp_path: Path) -> None:
    with _store(tmp_path, spool={"inline_max": 100, "layout": "files"}) as store:
        big = store.submit(MSG, b"x" * 101, T0)
        kept_inline = store.submit(MSG, b"z" * 100, T0)
    # The queue manager opens a content larger than ahead_max with
    # open_large: the file, without a read of the database first.
    with _store(tmp_path, spool={"inline_max": 10, "layout": "files"}) as store:
        with store.open_large(big.spid) as stream:
            assert Path(stream.name).name == f"{big.spid}.msg"  # type: ignore[attr-defined]
            assert stream.read() == b"x" * 101
        # Kept inline under the larger inline_max of before: no file, the
        # database still has it.
        with store.open_large(kept_inline.spid) as stream:
            assert stream.read() == b"z" * 100
        with pytest.raises(StorageError):
            store.open_large("00000000000ABCDE")


def test_inline_max_zero_writes_every_message_to_a_file(tmp_path: Path) -> None:
    with _store(tmp_path, spool={"inline_max": 0, "layout": "files"}) as store:
        acc = store.submit(MSG, b"tiny", T0)
        assert _content_rows(store) == []
        assert [p.stem for p in _spool_files(store)] == [acc.spid]


def _draw_from(drawn: Iterator[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """New SPIDs come from ``drawn``: the first draw and any draw again."""
    for module in (sqlite_module, sqlite_segments):
        monkeypatch.setattr(module, "new_spid", lambda: next(drawn))


def test_a_spid_taken_by_another_process_is_drawn_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with _store(tmp_path) as store:
        first = store.submit(MSG, b"one", T0)
        drawn = iter([first.spid, "00000000000ABCDE"])
        _draw_from(drawn, monkeypatch)
        second = store.submit(MSG, b"two", T0)
        assert second.spid == "00000000000ABCDE"
        for acc, data in ((first, b"one"), (second, b"two")):
            with store.open_content(acc.spid) as stream:
                assert stream.read() == data
        assert store.count().recipients == 4 and store.count().messages == 2


def test_a_spid_whose_rows_belong_to_a_spooled_message_is_drawn_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with _store(tmp_path, spool={"inline_max": 10}) as store:
        spooled = store.submit(MSG, b"a spooled message", T0)  # a file, no content row
        drawn = iter([spooled.spid, "00000000000ABCDF"])
        _draw_from(drawn, monkeypatch)
        small = store.submit(MSG, b"small", T0)
        assert small.spid == "00000000000ABCDF"
        assert _content_rows(store) == [(int(small.spid, 16), b"small")]
        with store.open_content(spooled.spid) as stream:
            assert stream.read() == b"a spooled message"
        assert store.count().recipients == 4


def test_a_submission_that_fails_leaves_no_content(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with _store(tmp_path) as store:
        fail_inserts(store, monkeypatch, "disk I/O error")
        with pytest.raises(StorageError):
            store.submit(MSG, b"lost", T0)
        assert _content_rows(store) == []


def test_recover_removes_content_rows_nothing_points_at(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        kept = store.submit(MSG, b"kept", T0)
    with sqlite3.connect(tmp_path / "queue" / "queue.db") as conn:
        conn.execute("INSERT INTO content (id, data) VALUES (?, ?)", (12345, b"orphan"))
    with _store(tmp_path) as store:
        store.recover(T0)
        assert _content_rows(store) == [(int(kept.spid, 16), b"kept")]


def _open_and_close(root: Path, start: Any, results: Any) -> None:
    start.wait()
    try:
        _store(root).close()
        results.put("ok")
    except BaseException as exc:  # reported to the test, not lost in the child
        results.put(repr(exc))


def _open_at_once(root: Path, processes: int) -> list[str]:
    """Open (and close) the queue at ``root`` from several processes at the
    same moment; what each reported ("ok" or its error)."""
    ctx = multiprocessing.get_context("fork")
    start, results = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_open_and_close, args=(root, start, results))
             for _ in range(processes)]
    for proc in procs:
        proc.start()
    outcomes = [results.get(timeout=60) for _ in procs]
    for proc in procs:
        proc.join(60)
    return outcomes


def test_processes_opening_a_new_queue_at_once_all_succeed(tmp_path: Path) -> None:
    # The receivers of `sluice serve` open the queue at the same moment; one
    # of them once failed with "database is locked" while another created
    # the schema.  Opening now takes the commit lock.
    for round_ in range(8):
        assert _open_at_once(tmp_path / str(round_), 4) == ["ok"] * 4


# -- schema versions ----------------------------------------------------------------------

#: The schema Sluice wrote as version 1, before the SMTPUTF8 flag: a queue
#: an older Sluice left behind.
V1_SCHEMA = """
CREATE TABLE queue (
    spid            TEXT    NOT NULL,
    idx             INTEGER NOT NULL,
    sender          TEXT    NOT NULL,
    recipient       TEXT    NOT NULL,
    domain          TEXT    NOT NULL,
    state           TEXT    NOT NULL,
    arrival_at      REAL    NOT NULL,
    next_attempt_at REAL    NOT NULL,
    attempts        INTEGER NOT NULL DEFAULT 0,
    last_code       INTEGER,
    last_enhanced   TEXT,
    last_text       TEXT,
    priority        INTEGER NOT NULL DEFAULT 0,
    tenantid        TEXT    NOT NULL DEFAULT '',
    jobid           TEXT    NOT NULL DEFAULT '',
    transportid     TEXT    NOT NULL DEFAULT '',
    localip         TEXT    NOT NULL DEFAULT '',
    is_report       INTEGER NOT NULL DEFAULT 0,
    size            INTEGER NOT NULL DEFAULT 0,
    owner           TEXT,
    PRIMARY KEY (spid, idx)
) WITHOUT ROWID;
CREATE INDEX queue_pick ON queue (state, priority, next_attempt_at);
CREATE INDEX queue_domain ON queue (domain);
CREATE INDEX queue_tenant ON queue (tenantid, jobid);
CREATE TABLE qstats (key TEXT PRIMARY KEY, n INTEGER NOT NULL) WITHOUT ROWID;
INSERT INTO qstats (key, n) VALUES
    ('hold', 0), ('incoming', 0), ('deferred', 0), ('active', 0),
    ('delivering', 0), ('bounce', 0), ('messages', 0);
CREATE TRIGGER queue_ins AFTER INSERT ON queue BEGIN
    UPDATE qstats SET n = n + 1 WHERE key = new.state;
    UPDATE qstats SET n = n + 1 WHERE key = 'messages' AND new.idx = 0;
END;
CREATE TRIGGER queue_del AFTER DELETE ON queue BEGIN
    UPDATE qstats SET n = n - 1 WHERE key = old.state;
END;
CREATE TRIGGER queue_upd AFTER UPDATE OF state ON queue
WHEN old.state <> new.state BEGIN
    UPDATE qstats SET n = n - 1 WHERE key = old.state;
    UPDATE qstats SET n = n + 1 WHERE key = new.state;
END;
CREATE TABLE qchanges (
    seq    INTEGER PRIMARY KEY AUTOINCREMENT,
    at     REAL NOT NULL,
    qid    TEXT NOT NULL,
    action TEXT NOT NULL
);
CREATE TABLE qmeta (key TEXT PRIMARY KEY, value TEXT) WITHOUT ROWID;
CREATE TABLE content (id INTEGER PRIMARY KEY, data BLOB NOT NULL);
INSERT INTO qmeta (key, value) VALUES ('schema_version', '1');
"""

OLD_SPID = "1A2016772261AA74"


def _v1_queue(root: Path) -> Path:
    """A version-1 queue under ``root`` holding one small message for one recipient."""
    db = root / "queue" / "queue.db"
    db.parent.mkdir(parents=True)
    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.executescript(V1_SCHEMA)
        conn.execute("INSERT INTO queue (spid, idx, sender, recipient, domain, state, arrival_at, "
                     "next_attempt_at, size) VALUES (?, 0, 'a@example.org', 'b@example.net', "
                     "'example.net', 'incoming', ?, ?, 5)", (OLD_SPID, T0, T0))
        conn.execute("INSERT INTO content (id, data) VALUES (?, ?)",
                     (int(OLD_SPID, 16), b"hello"))
    return db


def _schema(db: Path) -> tuple[str, list[str]]:
    """The recorded schema version and the queue table's columns."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        (version,) = conn.execute(
            "SELECT value FROM qmeta WHERE key = 'schema_version'").fetchone()
        return version, [r[1] for r in conn.execute("PRAGMA table_info(queue)")]


def test_a_version_1_queue_is_migrated_when_opened(tmp_path: Path) -> None:
    db = _v1_queue(tmp_path)
    version, columns = _schema(db)
    assert version == "1" and "smtputf8" not in columns
    with _store(tmp_path) as store:
        assert store.count().messages == 1
        check_migrated_v1_queue(store, OLD_SPID, "b@example.net", b"hello", T0 + 1)
    version, columns = _schema(db)
    assert version == str(sqlite_module.SCHEMA_VERSION) == "4"
    assert [columns.count(c) for c in ("smtputf8", "last_mta", "last_attempt_at")] == [1, 1, 1]
    with _store(tmp_path) as store:  # opening again changes nothing
        assert len(list(store.entries(Selector()))) == 2
    assert _schema(db) == (version, columns)


def test_processes_opening_a_version_1_queue_at_once_migrate_it_once(tmp_path: Path) -> None:
    for round_ in range(4):
        root = tmp_path / str(round_)
        db = _v1_queue(root)
        assert _open_at_once(root, 4) == ["ok"] * 4
        version, columns = _schema(db)
        assert version == "4" and columns.count("smtputf8") == columns.count("last_mta") == 1


def test_a_queue_newer_than_the_code_is_refused_and_left_alone(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        store.submit(MSG, b"kept", T0)
    db = tmp_path / "queue" / "queue.db"
    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("UPDATE qmeta SET value = '5' WHERE key = 'schema_version'")
    before = _schema(db)
    with pytest.raises(StorageError, match=rf"{db}.*schema version 5.*newer"):
        _store(tmp_path)
    assert _schema(db) == before


@pytest.mark.parametrize("body_kb", [192, 16], ids=["spool-file", "inline"])
def test_a_full_disk_is_a_temporary_failure_and_passes(body_kb: int) -> None:
    # The database and the spool share a 4 MB tmpfs: big bodies fill it
    # through spool files, small ones through the database itself.
    found = run_diskfull("sqlite", size="4m", ballast_mb=1, body_kb=body_kb)
    assert found["other_error"] is None
    assert found["error"] and ("No space left" in found["error"]
                               or "disk is full" in found["error"]), found
    assert found["accepted"] > 0 and found["second_ok"] is False
    assert found["all_listed"] and found["all_intact"] and found["count"] == found["accepted"]
    assert found["after_ok"], found.get("after_error")
    assert found["count_after"] == found["accepted"] - 3 + 1


def test_only_the_first_recovery_reads_the_whole_queue(tmp_path: Path) -> None:
    # The orphan-content sweep and the recount of qstats read every row (seconds
    # at a million, under the write lock); nothing but an older version or a
    # hand edit can make them find anything, so a queue has them once.
    with _store(tmp_path) as store:
        kept = store.submit(MSG, b"kept", T0)
    with sqlite3.connect(tmp_path / "queue" / "queue.db") as conn:
        conn.execute("INSERT INTO content (id, data) VALUES (?, ?)", (12345, b"orphan"))
        conn.execute("UPDATE qstats SET n = 7 WHERE key = 'incoming'")
    statements: list[str] = []
    with _store(tmp_path) as store:
        store._writer.set_trace_callback(statements.append)
        store.recover(T0)
        assert _content_rows(store) == [(int(kept.spid, 16), b"kept")]
        assert store.count()[QueueState.INCOMING] == 2
        assert any("COUNT(*)" in s for s in statements)
    statements.clear()
    with _store(tmp_path) as store:
        store._writer.set_trace_callback(statements.append)
        store.claim(1, T0, 0)
        store.recover(T0 + 1)
        assert not [s for s in statements if "COUNT(*)" in s or "DELETE FROM content" in s]
        assert store.count()[QueueState.INCOMING] == 1
        assert store.count()[QueueState.DEFERRED] == 1


def _bytes_written() -> int:
    """What this process has passed to write(2) and its kin so far (/proc/self/io)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["wchar"])


def _deliver_all(store: SqliteStore, n: int) -> float:
    """The queue manager's pattern: claim, mark delivering by nine, remove; bytes per entry."""
    before = _bytes_written()
    done = 0
    while done < n:
        claimed = store.claim(500, T0, 10)
        assert claimed
        for at in range(0, len(claimed), 9):
            chunk = claimed[at:at + 9]
            store.apply([Transition(e.qid, QueueState.DELIVERING, expect=(QueueState.ACTIVE,))
                         for e in chunk], durable=False)
            store.apply([Transition(e.qid, None) for e in chunk])
        done += len(claimed)
    return (_bytes_written() - before) / done


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs /proc/self/io")
def test_a_delivery_cycle_writes_no_undo_pages_to_temporary_files(tmp_path: Path) -> None:
    # Each operation's savepoint keeps the pages it changed; past 64 KiB SQLite
    # wrote them to a temporary file: ~100 KB per delivered message in all,
    # where the WAL itself takes about 15.  A bulk operator action in between
    # still works, and the small batches after it are back in memory.
    with _store(tmp_path) as store:
        for _ in range(2):
            futures = [store.submit_future(Submission("a@example.org", ("b@example.net",)),
                                           b"x" * 1024, T0) for _ in range(1000)]
            for fut in futures:
                fut.result()
            assert _deliver_all(store, 1000) < 40_000
            held = store.modify(Selector(domain="example.net"), Action.HOLD, T0)
            assert held == []
        assert store.count().messages == 0


def test_outcomes_of_many_messages_are_a_few_statements_not_a_few_each(tmp_path: Path) -> None:
    # The queue manager's batches hold one outcome of each of many messages;
    # a statement per message (and three more to collect its content) was
    # most of the committer's time.  The result is the same: applied qids,
    # content gone, counters right.
    with _store(tmp_path) as store:
        accepted = [store.submit(Submission("a@example.org", ("b@example.net",)), b"x", T0)
                    for _ in range(9)]
        kept = store.submit(MSG, b"two recipients", T0)
        claimed = store.claim(100, T0, 10)
        assert len(claimed) == 11
        statements: list[str] = []
        store._writer.set_trace_callback(statements.append)
        mark = [Transition(e.qid, QueueState.DELIVERING, expect=(QueueState.ACTIVE,))
                for e in claimed]
        assert store.apply(mark, durable=False) == {e.qid for e in claimed}
        # (the trace repeats a statement's text for each trigger run it makes)
        assert len({s for s in statements if s.startswith("UPDATE queue")}) == 1
        statements.clear()
        done = [e for e in claimed if e.spid != kept.spid] + [
            e for e in claimed if e.spid == kept.spid][:1]
        assert store.apply([Transition(e.qid, None) for e in done]) == {e.qid for e in done}
        ours = {s for s in statements if not s.startswith(("SAVEPOINT", "RELEASE", "BEGIN",
                                                           "COMMIT", "PRAGMA"))}
        assert len(ours) <= 4, ours
        assert _content_rows(store) == [(int(kept.spid, 16), b"two recipients")]
        counts = store.count()
        assert counts.messages == 1
        assert counts[QueueState.DELIVERING] == 1
        assert {a.spid for a in accepted} == {e.spid for e in done} - {kept.spid}


def test_grouped_outcomes_look_entries_up_by_key_not_by_state(tmp_path: Path) -> None:
    # With one expected state, SQLite preferred the state index to the OR'ed
    # keys: a mark of nine read every active entry (10,000 in a busy queue
    # manager), which doubled the committer's CPU.
    with _store(tmp_path) as store:
        for _ in range(3):
            store.submit(Submission("a@example.org", ("b@example.net",)), b"x", T0)
        claimed = store.claim(100, T0, 10)
        statements: list[str] = []
        store._writer.set_trace_callback(statements.append)
        store.apply([Transition(e.qid, QueueState.DELIVERING, expect=(QueueState.ACTIVE,))
                     for e in claimed], durable=False)
        store.apply([Transition(e.qid, None, expect=(QueueState.DELIVERING,))
                     for e in claimed])
        grouped = {s for s in statements if s.startswith(("UPDATE queue", "DELETE FROM queue"))}
        assert len(grouped) == 2
        with sqlite3.connect(store.db_path) as conn:
            for statement in grouped:
                plan = " ".join(row[3] for row in conn.execute(f"EXPLAIN QUERY PLAN {statement}"))
                assert "PRIMARY KEY" in plan and "(state=?)" not in plan, (statement, plan)
