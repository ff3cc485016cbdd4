"""sluice.faults: the SLUICE_FAULT setting and the unarmed point."""

from __future__ import annotations

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
