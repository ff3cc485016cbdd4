"""The SQLite store with its big contents in spool segments (queue.spool.layout).

Where a content goes, that it reads back from there, and when its segment
may go: only once no message in it is queued, also across a restart.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

import pytest

from sluice.model import QueueState, Selector, Submission
from sluice.store import Action, StorageError, Transition
from sluice.store.sqlite import SqliteStore
from tests.integration.stores import fail_inserts, open_flavour

T0 = 1_800_000_000.0
MSG = Submission("a@example.org", ("b@example.net",))


def _store(tmp_path: Path, **spool: object) -> SqliteStore:
    store = open_flavour("sqlite", tmp_path, queue={"spool": {"inline_max": 100, **spool}})
    assert isinstance(store, SqliteStore)
    return store


def _segment_files(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "spool" / "segments").glob("*.seg"))


def _located(store: SqliteStore) -> dict[int, tuple[int, int, int]]:
    with sqlite3.connect(store.db_path) as conn:
        return {i: (s, o, n) for i, s, o, n in
                conn.execute("SELECT id, seg, off, len FROM content_at")}


def _eventually(check: object, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return bool(check())  # type: ignore[operator]


def test_big_content_goes_to_a_segment_and_reads_back(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        bodies = [bytes([65 + i]) * (1000 + i) for i in range(3)]
        accepted = [store.submit(MSG, [b[:10], b[10:]], T0) for b in bodies]
        small = store.submit(MSG, b"z" * 100, T0)
        streamed = store.submit(MSG, iter([b"y" * 500]), T0)  # size unknown: a file
        located = _located(store)
        assert set(located) == {int(a.spid, 16) for a in accepted}
        assert len({seg for seg, _, _ in located.values()}) == 1
        assert [n for _, _, n in located.values()] == [1000, 1001, 1002]
        assert [p.name for p in (tmp_path / "spool").rglob("*.msg")] == [f"{streamed.spid}.msg"]
        for acc, data in [*zip(accepted, bodies, strict=True), (small, b"z" * 100),
                          (streamed, b"y" * 500)]:
            with store.open_content(acc.spid) as stream:
                assert stream.read() == data
            with store.open_large(acc.spid) as stream:
                assert stream.read() == data
        with pytest.raises(StorageError):
            store.open_large("00000000000ABCDE")


def test_a_segment_goes_only_when_its_last_message_does(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        first = store.submit(MSG, b"1" * 1000, T0)
        second = store.submit(MSG, b"2" * 1000, T0)
    # Closed: the segment was retired and sealed, but it holds two messages.
    (segment,) = _segment_files(tmp_path)
    with _store(tmp_path) as store:
        store.recover(T0)
        claimed = {e.spid: e for e in store.claim(10, T0, 10)}
        store.apply([Transition(claimed[first.spid].qid, None)])
        assert _located(store).keys() == {int(second.spid, 16)}
    assert segment.exists()  # the second message still needs it
    with _store(tmp_path) as store:
        store.recover(T0)
        with store.open_content(second.spid) as stream:
            assert stream.read() == b"2" * 1000
        claimed = {e.spid: e for e in store.claim(10, T0, 10)}
        store.apply([Transition(claimed[second.spid].qid, None)])
        assert _located(store) == {}
    assert not segment.exists()


def test_a_full_segment_is_swept_while_the_store_runs(tmp_path: Path) -> None:
    with _store(tmp_path, segment_max=65536) as store:
        accepted = [store.submit(MSG, bytes([48 + i]) * 40_000, T0) for i in range(4)]
        assert len(_segment_files(tmp_path)) == 2  # two a segment, the second active
        entries = store.claim(10, T0, 10)
        store.apply([Transition(e.qid, None) for e in entries
                     if e.spid in {accepted[0].spid, accepted[1].spid}])
        # The first segment, sealed and now free, goes without a restart.
        assert _eventually(lambda: len(_segment_files(tmp_path)) == 1)
        with store.open_content(accepted[3].spid) as stream:
            assert stream.read() == b"3" * 40_000


def test_an_operator_delete_frees_the_segment(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        store.submit(MSG, b"x" * 1000, T0)
        store.modify(Selector(), Action.DELETE, T0)
        assert _located(store) == {} and store.count().messages == 0
    assert _segment_files(tmp_path) == []


def test_a_failed_submission_leaves_no_record_and_its_bytes_go_with_the_segment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with _store(tmp_path) as store:
        fail_inserts(store, monkeypatch, "injected")
        with pytest.raises(StorageError, match="injected"):
            store.submit(MSG, b"x" * 1000, T0)
        monkeypatch.undo()
        assert _located(store) == {} and store.count().messages == 0
        assert len(_segment_files(tmp_path)) == 1  # the active segment, locked
    assert _segment_files(tmp_path) == []


def test_a_spid_already_queued_is_drawn_again(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        first = store.submit(MSG, b"1" * 1000, T0)
        again = Submission(MSG.sender, MSG.recipients, spid=first.spid)
        second = store.submit(again, b"2" * 1000, T0)
        assert second.spid != first.spid
        for acc, byte in ((first, b"1"), (second, b"2")):
            with store.open_content(acc.spid) as stream:
                assert stream.read() == byte * 1000


def test_recovery_keeps_a_content_committed_before_a_crash(tmp_path: Path) -> None:
    # No close: the process "dies" with the segment active and locked.  Its
    # lock goes with it (here: the descriptors are closed by hand).
    store = _store(tmp_path)
    acc = store.submit(MSG, b"k" * 1000, T0)
    assert store.segments is not None
    for seg in list(store.segments._open.values()):
        os.close(seg.fd)
    store.segments._open.clear()
    store.segments._active = None
    with _store(tmp_path) as fresh:
        fresh.recover(T0)
        assert [e.spid for e in fresh.entries(Selector())] == [acc.spid]
        with fresh.open_content(acc.spid) as stream:
            assert stream.read() == b"k" * 1000
        assert fresh.count()[QueueState.INCOMING] == 1
    assert len(_segment_files(tmp_path)) == 1


def _four_in_one_segment(tmp_path: Path) -> tuple[list[str], Path]:
    """Four 30 KB messages in one sealed segment (the store closed since)."""
    with _store(tmp_path, segment_max=100_000) as store:
        spids = [store.submit(MSG, bytes([48 + i]) * 30_000, T0).spid for i in range(4)]
    (segment,) = _segment_files(tmp_path)
    return spids, segment


def _deliver(store: SqliteStore, spids: list[str]) -> None:
    entries = store.claim(10, T0, 10)
    store.apply([Transition(e.qid, None) for e in entries if e.spid in spids])


def _compacted(store: SqliteStore) -> bool:
    """Compact an hour from now until one segment is emptied.

    The store's own thread may hold a segment's lock for a moment (a sweep
    after the deliveries); compaction then skips it, to try again later.
    """
    return _eventually(lambda: store.compact_segments(time.time() + 3600) == 1)


def test_compaction_moves_the_survivors_of_an_old_mostly_free_segment(tmp_path: Path) -> None:
    spids, segment = _four_in_one_segment(tmp_path)
    with _store(tmp_path, segment_max=100_000) as store:
        store.recover(T0)
        _deliver(store, spids[:3])
        assert store.compact_segments(time.time()) == 0  # too young
        assert _compacted(store)
        assert not segment.exists()
        ((key, (seg, _off, size)),) = _located(store).items()
        assert key == int(spids[3], 16) and size == 30_000
        assert seg != int(segment.name[:16], 16)
        with store.open_content(spids[3]) as stream:
            assert stream.read() == b"3" * 30_000
        assert store.compact_segments(time.time() + 3600) == 0  # the copy is new


def test_a_segment_still_half_queued_is_not_compacted(tmp_path: Path) -> None:
    spids, segment = _four_in_one_segment(tmp_path)
    with _store(tmp_path, segment_max=100_000) as store:
        store.recover(T0)
        _deliver(store, spids[:2])
        assert store.compact_segments(time.time() + 3600) == 0
        assert segment.exists() and len(_located(store)) == 2


def test_a_segment_being_written_is_not_compacted(tmp_path: Path) -> None:
    with _store(tmp_path, segment_max=100_000) as store:
        spids = [store.submit(MSG, bytes([48 + i]) * 30_000, T0).spid for i in range(4)]
        _deliver(store, spids[:3])
        (segment,) = _segment_files(tmp_path)
        assert store.compact_segments(time.time() + 3600) == 0  # its writer holds it
        assert segment.exists()


def test_contents_in_segments_stay_readable_and_go_after_a_switch_to_files(
        tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        acc = store.submit(MSG, b"s" * 1000, T0)
    (segment,) = _segment_files(tmp_path)
    with _store(tmp_path, layout="files") as store:
        store.recover(T0)
        later = store.submit(MSG, b"f" * 1000, T0)
        assert [p.stem for p in (tmp_path / "spool").rglob("*.msg")] == [later.spid]
        for a, byte in ((acc, b"s"), (later, b"f")):
            with store.open_large(a.spid) as stream:
                assert stream.read() == byte * 1000
        _deliver(store, [acc.spid, later.spid])
        assert _located(store) == {}
    assert not segment.exists()


def test_a_message_deleted_while_its_segment_is_compacted_stays_deleted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spids, segment = _four_in_one_segment(tmp_path)
    with _store(tmp_path, segment_max=100_000) as store:
        store.recover(T0)
        _deliver(store, spids[:3])
        assert store.segments is not None
        write = store.segments.write

        def write_then_deliver(*a: object, **kw: object) -> object:
            copy = write(*a, **kw)  # type: ignore[arg-type]
            store.modify(Selector(), Action.DELETE, T0)  # between the copy and the update
            return copy

        monkeypatch.setattr(store.segments, "write", write_then_deliver)
        assert _compacted(store)
        assert _located(store) == {} and store.count().messages == 0
        assert not segment.exists()


def test_a_reader_looks_again_when_the_content_moved(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    with _store(tmp_path) as store:
        acc = store.submit(MSG, b"m" * 1000, T0)
        assert store.segments is not None
        real = store.segments.open
        calls: list[int] = []

        def moved_once(*a: int) -> object:
            calls.append(a[0])
            if len(calls) == 1:
                raise FileNotFoundError(2, "No such file or directory")
            return real(*a)

        monkeypatch.setattr(store.segments, "open", moved_once)
        with store.open_large(acc.spid) as stream:
            assert stream.read() == b"m" * 1000
        assert len(calls) == 2
