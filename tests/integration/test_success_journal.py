"""The success journal's files: group syncs, two files emptied in turn, torn writes cut off."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from sluice import journal as journal_mod
from sluice.journal import SuccessJournal, journal_paths, read_journal
from sluice.model import Delivered, QueueEntry, QueueState, Reply
from sluice.queue import AttemptResult

pytestmark = pytest.mark.integration

OK = Delivered(Reply(250, "2.0.0", "ok"))


def _result(i: int) -> AttemptResult:
    entry = QueueEntry(spid=f"AB{i:06d}", idx=0, sender="a@example.org",
                       recipient=f"r{i}@example.net", state=QueueState.DELIVERING,
                       arrival_at=1_800_000_000.0 + i, next_attempt_at=0.0)
    return AttemptResult(entry, OK, remoteip="127.0.0.1")


def _run(paths: tuple[Path, Path], body: Any) -> None:
    async def main() -> None:
        journal = SuccessJournal.open(paths, asyncio.get_running_loop())
        try:
            await body(journal)
        finally:
            journal.close()
    asyncio.run(main())


async def _until(cond: Any) -> None:
    for _ in range(2000):
        if cond():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("not reached")


def test_the_files_are_used_in_turn_and_emptied_once_the_store_has_their_lines(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(journal_mod, "ROTATE_AT", 300)
    paths = journal_paths(tmp_path, "n1")

    async def body(journal: SuccessJournal) -> None:
        sizes = lambda: [p.stat().st_size for p in paths]  # noqa: E731
        await journal.append([_result(i) for i in range(3)])  # past 300 bytes
        assert sizes()[0] > 300 and sizes()[1] == 0
        await journal.append([_result(3)])  # to the second file
        assert sizes()[1] > 0
        journal.committed([_result(0).entry.qid, _result(1).entry.qid])
        await asyncio.sleep(0.05)
        assert sizes()[0] > 0  # r2 is not in the store yet: its line stays
        assert set(read_journal(paths)) == {_result(i).entry.qid for i in range(4)}
        journal.committed([_result(2).entry.qid])
        await _until(lambda: sizes()[0] == 0)
        assert set(read_journal(paths)) == {_result(3).entry.qid}
        await journal.append([_result(i) for i in range(4, 8)])  # the second grows past 300
        await journal.append([_result(8)])  # back to the first, emptied
        assert sizes()[0] > 0
        assert set(read_journal([paths[0]])) == {_result(8).entry.qid}

    _run(paths, body)


def test_a_write_that_fails_part_way_is_cut_off(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    paths = journal_paths(tmp_path, "n1")
    real = journal_mod.write_all

    def half_then_full_disk(fd: int, data: bytes) -> None:
        os.write(fd, data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    async def body(journal: SuccessJournal) -> None:
        await journal.append([_result(1)])
        monkeypatch.setattr(journal_mod, "write_all", half_then_full_disk)
        with pytest.raises(OSError):
            journal.append([_result(2)])
        monkeypatch.setattr(journal_mod, "write_all", real)
        await journal.append([_result(3)])
        kept = read_journal(paths)
        assert set(kept) == {_result(1).entry.qid, _result(3).entry.qid}
        assert kept[_result(3).entry.qid].arrival_at == _result(3).entry.arrival_at

    _run(paths, body)


def test_closing_syncs_what_was_written_and_answers_it(tmp_path: Path) -> None:
    paths = journal_paths(tmp_path, "")

    async def main() -> None:
        journal = SuccessJournal.open(paths, asyncio.get_running_loop())
        futures = [journal.append([_result(i)]) for i in range(20)]
        journal.close()
        await asyncio.wait_for(asyncio.gather(*futures), 10)

    asyncio.run(main())
    assert len(read_journal(paths)) == 20
    assert [p.name for p in paths] == ["success.0.journal", "success.1.journal"]


def _null_files(journal: SuccessJournal, *which: int) -> None:
    """Files that take writes but fail fdatasync and ftruncate (EINVAL): /dev/null."""
    for i in which:
        f = journal._files[i]
        os.close(f.fd)
        f.fd = os.open(os.devnull, os.O_WRONLY | os.O_APPEND)


def test_a_sync_that_fails_fails_the_future_and_the_next_sync_of_the_other_file_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(journal_mod, "ROTATE_AT", 300)
    paths = journal_paths(tmp_path, "n1")

    async def body(journal: SuccessJournal) -> None:
        _null_files(journal, 0)
        with pytest.raises(OSError) as caught:
            await journal.append([_result(i) for i in range(3)])
        assert caught.value.errno == 22
        await journal.append([_result(3)])  # the second file, a real one: synced
        assert set(read_journal([paths[1]])) == {_result(3).entry.qid}

    _run(paths, body)


def test_a_file_that_cannot_be_emptied_turns_the_journal_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(journal_mod, "ROTATE_AT", 300)
    paths = journal_paths(tmp_path, "n1")

    async def body(journal: SuccessJournal) -> None:
        await journal.append([_result(i) for i in range(3)])
        await journal.append([_result(3)])  # to the second file
        _null_files(journal, 0)
        journal.committed([_result(i).entry.qid for i in range(3)])
        await _until(lambda: journal._broken is not None)
        with pytest.raises(OSError, match="off until the next start"):
            journal.append([_result(4)])

    _run(paths, body)


def test_no_append_after_close(tmp_path: Path) -> None:
    paths = journal_paths(tmp_path, "n1")

    async def main() -> None:
        journal = SuccessJournal.open(paths, asyncio.get_running_loop())
        journal.close()
        with pytest.raises(OSError, match="closed"):
            journal.append([_result(1)])

    asyncio.run(main())


def test_first_of_waits_past_a_failure_for_a_success_or_the_last() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        a, b = loop.create_future(), loop.create_future()
        out = journal_mod.first_of(a, b)
        a.set_exception(OSError(22, "sync failed"))
        await asyncio.sleep(0)
        assert not out.done()  # a failure is not the end of the wait
        b.set_result(None)
        await asyncio.wait_for(out, 1)

        c, d = loop.create_future(), loop.create_future()
        out = journal_mod.first_of(c, d)
        d.set_result(None)
        await asyncio.wait_for(out, 1)  # the first success, the other still open
        assert not c.done()

        e, f = loop.create_future(), loop.create_future()
        out = journal_mod.first_of(e, f)
        e.set_exception(OSError(5, "x"))
        f.set_exception(OSError(5, "y"))
        await asyncio.wait_for(out, 1)  # both failed: the wait ends all the same

    asyncio.run(main())
