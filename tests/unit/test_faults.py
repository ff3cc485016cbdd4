"""sluice.faults: the SLUICE_FAULT setting, the unarmed point, and the SLUICE_TRACE lines."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice import faults


def test_a_point_and_its_pass_are_read() -> None:
    assert faults._parse("after_reply:3") == ("after_reply", 3)
    assert faults._parse("before_data") == ("before_data", 1)
    assert faults._parse("") is None
    assert faults._parse(None) is None


def test_an_unknown_point_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown point 'after_lunch'.*before_data"):
        faults._parse("after_lunch")


def test_an_unarmed_point_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faults, "_armed", None)
    for name in faults.POINTS:
        faults.point(name)  # still alive


def test_an_armed_point_counts_passes_of_its_own_name(monkeypatch: pytest.MonkeyPatch) -> None:
    kills: list[int] = []
    monkeypatch.setattr(faults, "_armed", ("after_dot", 2))
    monkeypatch.setattr(faults, "_passes", 0)
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: kills.append(sig))
    faults.point("after_reply")
    faults.point("after_dot")
    assert kills == []
    faults.point("after_dot")
    assert kills == [faults.signal.SIGKILL]


def test_a_trace_notes_each_pass_with_its_messages(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "points.log"
    fd = faults._open_trace(str(path))
    assert fd is not None
    monkeypatch.setattr(faults, "_trace", fd)
    monkeypatch.setattr(faults, "_armed", None)
    try:
        faults.point("after_reply", (s for s in ("spid1", "spid2")))
        faults.point("after_commit", ["spid1"])
        faults.point("after_dot")
    finally:
        faults.os.close(fd)
    lines = [line.split(" ") for line in path.read_text().splitlines()]
    assert [line[2:] for line in lines] == [["after_reply", "spid1", "spid2"],
                                            ["after_commit", "spid1"], ["after_dot"]]
    assert {line[1] for line in lines} == {str(faults.os.getpid())}
    times = [float(line[0]) for line in lines]
    assert times == sorted(times) and times[0] > 1.7e9  # wall-clock seconds


def test_without_a_trace_the_messages_are_not_walked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faults, "_trace", None)
    monkeypatch.setattr(faults, "_armed", None)
    walked: list[str] = []

    def spids() -> Iterator[str]:
        walked.append("walked")
        yield "spid1"

    faults.point("after_reply", spids())
    assert walked == []
    assert faults._open_trace("") is None


def test_a_trace_that_cannot_be_opened_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^SLUICE_TRACE: cannot open .*/no/such/dir/t\.log: "
                                         r"No such file or directory$"):
        faults._open_trace(str(tmp_path / "no" / "such" / "dir" / "t.log"))


def test_a_trace_that_cannot_be_written_does_not_fail_the_pass(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faults, "_armed", None)
    read_end, write_end = faults.os.pipe()
    faults.os.close(read_end)
    monkeypatch.setattr(faults, "_trace", write_end)  # writes fail: EPIPE (Python ignores SIGPIPE)
    try:
        faults.point("after_dot")  # still alive, no exception
    finally:
        faults.os.close(write_end)
