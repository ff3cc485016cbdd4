"""SQLite flavour specifics: which commits are flushed, and content that a
commit without a flush freed is not deleted before the flush."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from sluice.model import Reply, Submission
from sluice.store import Transition
from sluice.store.sqlite import SqliteStore
from tests.integration.stores import open_flavour

pytestmark = pytest.mark.integration

T0 = 1_800_000_000.0


def _store(tmp_path: Path) -> SqliteStore:
    store = open_flavour("sqlite", tmp_path)
    assert isinstance(store, SqliteStore)
    return store


def _synchronous(store: SqliteStore, durable: bool) -> int:
    """PRAGMA synchronous as a batch of that kind sees it (1 NORMAL, 2 FULL)."""
    value: int = store._call(lambda b: b.conn.execute("PRAGMA synchronous").fetchone()[0],
                             durable=durable)
    return value


def test_submissions_and_operator_changes_are_flushed_outcomes_are_not(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        assert _synchronous(store, durable=False) == 1
        assert _synchronous(store, durable=True) == 2
        assert _synchronous(store, durable=False) == 1
        # A batch holding a submission is flushed whatever else it holds.
        store.submit(Submission("a@example.org", ("b@example.net",)), iter([b"x\r\n"]), T0)
        assert _synchronous(store, durable=True) == 2


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
        assert not path.exists() and flushes == []
