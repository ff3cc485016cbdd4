"""The mark log (sluice.marks) on real files: lines, torn lines, two files in turn, failures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sluice import marks as marks_mod
from sluice.marks import MarkLog, mark_of, mark_paths, read_marks
from sluice.model import QueueEntry, QueueState


def _entry(spid: str, idx: int, attempts: int) -> QueueEntry:
    return QueueEntry(spid, idx, "a@example.org", "b@example.net", QueueState.ACTIVE,
                      1.0, 1.0, attempts=attempts)


def test_a_mark_names_the_entry_and_its_attempts_so_far() -> None:
    e = _entry("1A22DFD4478AFF26", 3, 2)
    assert mark_of(e) == f"{e.qid}/2"


def test_lines_are_read_back_and_a_torn_last_line_keeps_its_whole_marks(tmp_path: Path
                                                                        ) -> None:
    paths = mark_paths(tmp_path, "n1")
    assert [p.name for p in paths] == ["marks-n1.0.log", "marks-n1.1.log"]
    log = MarkLog.open(paths)
    try:
        assert log.write(["A-0/0", "B-0/1"]) == 0
        assert log.write(["C-0/0"]) == 0
    finally:
        log.close()
    with paths[0].open("ab") as f:
        f.write(b"D-0/0 E-")  # the crash cut this line
    assert read_marks(paths) == {"A-0/0", "B-0/1", "C-0/0", "D-0/0", "E-"}
    assert read_marks([tmp_path / "missing.log"]) == set()


def test_open_starts_both_files_empty(tmp_path: Path) -> None:
    paths = mark_paths(tmp_path, "")
    paths[1].write_text("OLD-0/0\n")
    MarkLog.open(paths).close()
    assert read_marks(paths) == set()


def test_a_full_file_is_left_for_the_other_and_emptied_once_the_store_has_its_marks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(marks_mod, "ROTATE_AT", 20)
    paths = mark_paths(tmp_path, "n1")
    log = MarkLog.open(paths)
    try:
        first = log.write(["AAAAAAAAAAAAAAAAAAAAAA-0/0"])  # past 20 bytes at once
        assert first == 0
        second = log.write(["B-0/0"])
        assert second == 1  # the other file, which was empty
        assert read_marks(paths[:1]) == {"AAAAAAAAAAAAAAAAAAAAAA-0/0"}
        log.stored(second)  # the current file is never emptied under its writer
        assert read_marks(paths[1:]) == {"B-0/0"}
        log.stored(first)  # the store has every mark of the first: it goes
        assert paths[0].stat().st_size == 0
        third = log.write(["CCCCCCCCCCCCCCCCCCCCCC-0/0"])
        assert third == 1
        # file 1 is full; file 0 is empty, so lines go there, and file 1 is
        # emptied when its last mark is stored
        assert log.write(["D-0/0"]) == 0
        assert read_marks(paths[1:]) == {"B-0/0", "CCCCCCCCCCCCCCCCCCCCCC-0/0"}
        log.stored(third)
        assert paths[1].stat().st_size == 0
        assert read_marks(paths) == {"D-0/0"}
    finally:
        log.close()


def test_a_mark_the_store_never_took_keeps_its_file(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(marks_mod, "ROTATE_AT", 10)
    paths = mark_paths(tmp_path, "n1")
    log = MarkLog.open(paths)
    try:
        assert log.write(["KEPT-0/0", "GONE-1/0"]) == 0
        assert log.write(["NEXT-0/0"]) == 1
        assert log.write(["MORE-0/0"]) == 1  # file 1 is past ROTATE_AT now
        # the first line's store mark failed (no stored(0)): file 0 keeps it,
        # and lines stay in file 1 past ROTATE_AT
        assert log.write(["LAST-0/0"]) == 1
        assert read_marks(paths[:1]) == {"KEPT-0/0", "GONE-1/0"}
    finally:
        log.close()


def test_a_write_that_fails_is_none_and_logged_once(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this machine")
    full = tmp_path / "full.log"
    full.symlink_to("/dev/full")
    log = MarkLog.open([full, tmp_path / "other.log"])
    try:
        assert log.write(["A-0/0"]) is None
        assert log.write(["B-0/0"]) is None
    finally:
        log.close()
    errors = [r for r in caplog.records if r.name == "sluice.marks" and r.levelname == "ERROR"]
    assert len(errors) == 1
    assert "full.log" in errors[0].getMessage()


def test_a_closed_log_writes_nothing(tmp_path: Path) -> None:
    log = MarkLog.open(mark_paths(tmp_path, "n1"))
    log.close()
    assert log.write(["A-0/0"]) is None
    log.stored(0)  # a late store answer after the close is ignored
