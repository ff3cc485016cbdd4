"""bench/wire_gaps.py: gaps between SMTP packets per connection, as docs/floor.md reads them.

Made-up packets of two connections to the sink's port, interleaved in time.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import wire_gaps

pytestmark = pytest.mark.unit

PORT = 2526


def _cycle(client: int, t0: float) -> list[wire_gaps.Packet]:
    """One pipelined transaction: MAIL.. -> 250, wait 4 ms, content -> 250 2.0.0."""
    return [(t0, client, PORT, b"MAIL FROM:<a"), (t0 + 0.0001, PORT, client, b"250 2.1.0 Ok"),
            (t0 + 0.0041, client, PORT, b"Received: fr"),
            (t0 + 0.0042, PORT, client, b"250 2.0.0 Ok")]


def test_gaps_follow_each_connection_and_name_the_steps() -> None:
    packets = sorted(_cycle(40001, 0.0) + _cycle(40002, 0.002) + _cycle(40001, 0.010))
    found = wire_gaps.gaps(packets, PORT)
    assert found[("S:250 2.1.0", "C:RECEIVED")] == pytest.approx([4.0, 4.0, 4.0])
    assert found[("C:MAIL", "S:250 2.1.0")] == pytest.approx([0.1, 0.1, 0.1])
    # only connection 40001 went on to a second message, 5.8 ms after its 250
    assert found[("S:250 2.0.0", "C:MAIL")] == pytest.approx([5.8])


def test_the_table_puts_the_largest_total_first_and_drops_rare_steps() -> None:
    packets = [p for i in range(30) for p in _cycle(40000 + i, i * 0.01)]
    lines = wire_gaps.table(wire_gaps.gaps(packets, PORT), least=20)
    assert lines[1].split()[:3] == ["S:250", "2.1.0", "->"]
    assert " 30 " in lines[1]
    assert len(lines) == 1 + 3  # the header and the three steps of every connection


def test_a_kept_capture_is_read_back(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                     ) -> None:
    kept = tmp_path / "cap.txt"
    kept.write_text("".join(f"{at:.6f} {s} {d} {first.hex()}\n"
                            for at, s, d, first in
                            [p for i in range(25) for p in _cycle(41000 + i, i * 0.01)]))
    assert wire_gaps.main(["--read", str(kept)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("100 packets, 25 connections")
    assert "S:250 2.1.0 -> C:RECEIVED" in " ".join(out.split())
