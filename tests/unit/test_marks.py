"""The mark log (sluice.marks) on real files: lines, torn lines, two files in turn, failures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sluice import marks as marks_mod
from sluice.marks import MarkLog, mark_files, mark_of, mark_paths, read_marks
from sluice.model import QueueEntry, QueueState
from sluice.runtime.manager import QueueManager


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


def test_a_full_file_is_retired_for_the_other_and_emptied_once_covered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(marks_mod, "ROTATE_AT", 20)
    paths = mark_paths(tmp_path, "n1")
    log = MarkLog.open(paths)
    try:
        first = log.write(["AAAAAAAAAAAAAAAAAAAAAA-0/0"])  # past 20 bytes at once
        assert first == 0 and log.take_retired() is None
        second = log.write(["B-0/0"])
        assert second == 1  # the other file, which was empty
        assert log.take_retired() == 0 and log.take_retired() is None  # handed out once
        assert read_marks(paths[:1]) == {"AAAAAAAAAAAAAAAAAAAAAA-0/0"}
        log.covered(second)  # the current file is never emptied under its writer
        assert read_marks(paths[1:]) == {"B-0/0"}
        log.covered(first)  # the store has what the first said: it goes
        assert paths[0].stat().st_size == 0
        third = log.write(["CCCCCCCCCCCCCCCCCCCCCC-0/0"])
        assert third == 1
        # file 1 is full; file 0 is empty, so lines go there and file 1 is
        # retired, emptied once covered
        assert log.write(["D-0/0"]) == 0
        assert log.take_retired() == 1
        assert read_marks(paths[1:]) == {"B-0/0", "CCCCCCCCCCCCCCCCCCCCCC-0/0"}
        log.covered(third)
        assert paths[1].stat().st_size == 0
        assert read_marks(paths) == {"D-0/0"}
    finally:
        log.close()


def test_a_file_never_covered_keeps_its_lines_and_the_other_grows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(marks_mod, "ROTATE_AT", 10)
    paths = mark_paths(tmp_path, "n1")
    log = MarkLog.open(paths)
    try:
        assert log.write(["KEPT-0/0", "GONE-1/0"]) == 0
        assert log.write(["NEXT-0/0"]) == 1
        assert log.take_retired() == 0
        assert log.write(["MORE-0/0"]) == 1  # file 1 is past ROTATE_AT now
        # file 0 was never covered (its store mark failed): it keeps its
        # lines, and lines stay in file 1 past ROTATE_AT
        assert log.write(["LAST-0/0"]) == 1
        assert log.take_retired() is None
        assert read_marks(paths[:1]) == {"KEPT-0/0", "GONE-1/0"}
        assert read_marks(paths[1:]) == {"NEXT-0/0", "MORE-0/0", "LAST-0/0"}
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
    # /dev/full cannot be cut back either: a torn line would join the next
    # one, so the log is given up for the run
    assert "full.log" in errors[0].getMessage()
    assert "keeps no mark log" in errors[0].getMessage()


def test_a_closed_log_writes_nothing(tmp_path: Path) -> None:
    log = MarkLog.open(mark_paths(tmp_path, "n1"))
    log.close()
    assert log.write(["A-0/0"]) is None
    log.covered(0)  # a late store answer after the close is ignored


def test_every_node_ids_files_are_read_and_only_this_ones_kept(tmp_path: Path) -> None:
    """A renamed host: the old name's marks are read at the start, then its files go."""
    old = mark_paths(tmp_path, "old-host")
    old[0].write_text("A-0/0\n")
    old[1].write_text("B-0/1\n")
    (tmp_path / "success-old-host.0.journal").write_text("")
    left = mark_files(tmp_path)
    assert read_marks(left) == {"A-0/0", "B-0/1"}
    mine = mark_paths(tmp_path, "new-host")
    log = QueueManager._open_marks(mine, left)
    assert log is not None
    try:
        assert mark_files(tmp_path) == sorted(mine)
        assert (tmp_path / "success-old-host.0.journal").exists()
    finally:
        log.close()


def test_a_log_that_cannot_be_opened_leaves_no_file_to_read(tmp_path: Path) -> None:
    mine = mark_paths(tmp_path, "n1")
    mine[0].write_text("STALE-0/0\n")
    mine[1].mkdir()  # cannot be opened as a file
    assert QueueManager._open_marks(mine, mark_files(tmp_path)) is None
    assert not mine[0].exists()
