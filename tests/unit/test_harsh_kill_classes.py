"""bench/harsh_kill.py: how a duplicate is classed from the killed process's own trace.

The bench's rules decide whether a duplicate counts as explained (the
windows at-least-once leaves) or not, so they are tested like code: on
made-up traces, kills and sink times.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import harsh_kill

SLOW = 0.15
KILLS = [100.0, 200.0]
PIDS = [11, 22, 33]  # the first start, the start after each kill


def trace(tmp_path: Path, *lines: str) -> list[harsh_kill.Life]:
    path = tmp_path / "points.log"
    path.write_text("".join(line + "\n" for line in lines))
    return harsh_kill.read_trace(path, PIDS)


def test_lines_go_to_the_process_that_wrote_them(tmp_path: Path) -> None:
    lives = trace(tmp_path, "99.9 11 after_reply a b", "100.05 11 after_commit a",
                  "150.0 22 after_reply a", "150.1 99 after_reply c", "150.2 22 after_dot")
    # A line stamped after the kill's time by the killed process is still its own.
    assert lives[0].replies == {"a": [99.9], "b": [99.9]}
    assert lives[0].commits == {"a": [100.05]}
    assert lives[1].replies == {"a": [150.0]}  # pid 99 is no start of serve
    assert lives[2].replies == {}


def test_missing_trace_gives_empty_lives(tmp_path: Path) -> None:
    lives = harsh_kill.read_trace(tmp_path / "none.log", PIDS)
    assert [life.replies for life in lives] == [{}, {}, {}]


@pytest.mark.parametrize(("lines", "first", "expected"), [
    # Accepted by the sink after the kill, within its delay: no reply.
    ((), 100.05, "no reply"),
    # Accepted before the kill, never read by the killed process.
    ((), 99.99, "reply unread"),
    # Read, not durable, nothing later durable: the commit under way.
    (("99.995 11 after_reply m", "99.99 11 after_reply o", "99.992 11 after_commit o"),
     99.99, "reply"),
    # Read, and an outcome read later was durable first.
    (("99.991 11 after_reply m", "99.993 11 after_reply o", "99.996 11 after_commit o"),
     99.99, "late"),
    # Durable before the kill and sent again: a bug.
    (("99.991 11 after_reply m", "99.995 11 after_commit m"), 99.99, "recorded"),
    # An earlier attempt's commit (a deferral) does not make this one recorded.
    (("50.0 11 after_reply m", "50.01 11 after_commit m", "99.991 11 after_reply m"),
     99.99, "reply"),
    # After the last kill there is nothing to explain it by.
    ((), 250.0, "no kill after it"),
])
def test_classes(tmp_path: Path, lines: tuple[str, ...], first: float, expected: str) -> None:
    lives = trace(tmp_path, *lines)
    cls, _ = harsh_kill.classify_traced("m", first, KILLS, lives, SLOW)
    assert cls == expected


def test_reply_to_durable_pairs_each_reply_with_the_commit_after_it(tmp_path: Path) -> None:
    lives = trace(tmp_path, "10.0 11 after_reply m", "10.004 11 after_commit m",
                  "20.0 11 after_reply m", "20.002 11 after_commit m", "30.0 11 after_reply n")
    assert [round(d, 6) for d in harsh_kill.reply_to_durable(lives)] == [0.002, 0.004]
