"""DATA pieces: end of data, dot-unstuffing, limits, spilling; and the Received header."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice.smtpd.content import MessageBuffer, Unstuffer
from sluice.smtpd.policy import ContentState
from sluice.smtpd.trace import protocol_name, received_header, rfc5322_date

pytestmark = pytest.mark.unit


def stuff(text: bytes) -> bytes:
    """What a client sends for ``text`` (RFC 5321 4.5.2), with the end marker."""
    lines = text.split(b"\r\n")
    body = b"\r\n".join(b"." + line if line.startswith(b".") else line for line in lines)
    return body + b".\r\n"


def feed_all(pieces: list[bytes]) -> tuple[bytes, bool, int]:
    """Text, whether the end was seen, and in which piece."""
    u = Unstuffer()
    out = []
    for i, piece in enumerate(pieces):
        text, ended = u.feed(piece)
        out.append(text)
        if ended:
            return b"".join(out), True, i
    return b"".join(out), False, -1


def test_end_marker_and_unstuffing() -> None:
    assert feed_all([b".\r\n"]) == (b"", True, 0)
    assert feed_all([b"a\r\n.\r\n"]) == (b"a\r\n", True, 0)
    assert feed_all([b"..\r\n.\r\n"]) == (b".\r\n", True, 0)
    assert feed_all([b"a\r\n..b\r\n.\r\n"]) == (b"a\r\n.b\r\n", True, 0)
    # a line ending in a dot is text, not the end
    assert feed_all([b"end.\r\n", b".\r\n"]) == (b"end.\r\n", True, 1)
    # CRLF and the marker split over pieces
    assert feed_all([b"a\r", b"\n.\r\n"]) == (b"a\r\n", True, 1)
    assert feed_all([b"a\r\n", b".\r\n"]) == (b"a\r\n", True, 1)
    assert feed_all([b"a\r\n", b".", b".b\r\n", b".\r\n"]) == (b"a\r\n.b\r\n", True, 3)
    # a bare LF does not start a line: its dot stays
    assert feed_all([b"a\n.b\r\n.\r\n"]) == (b"a\n.b\r\n", True, 0)


def wire_pieces(wire: bytes, cuts: list[int]) -> list[bytes]:
    """Split ``wire`` as the adapter reads it: readuntil(".\\r\\n") returns up to the
    first end marker, or (past its limit) a piece that stops before the marker."""
    pieces: list[bytes] = []
    pos = 0
    for cut in [*cuts, *([len(wire)] * len(wire))]:
        if pos >= len(wire):
            break
        end = min(pos + cut, len(wire))
        mark = wire.find(b".\r\n", pos)
        if 0 <= mark < end:
            end = mark + 3
        pieces.append(wire[pos:end])
        pos = end
    return pieces


@given(st.lists(st.sampled_from([b".", b"..", b"\r\n", b"\r", b"\n", b"a", b"\xc3\xa9", b" "]),
                max_size=40),
       st.lists(st.integers(min_value=1, max_value=7), max_size=40))
def test_any_split_gives_the_same_text(parts: list[bytes], cuts: list[int]) -> None:
    text = b"".join(parts)
    if text and not text.endswith(b"\r\n"):
        text += b"\r\n"
    # stuff() ends with the marker; the text's last CRLF comes before it
    wire = stuff(text[:-2])[:-3] + b"\r\n.\r\n" if text else b".\r\n"
    pieces = wire_pieces(wire, cuts)
    assert b"".join(pieces) == wire
    got, ended, at = feed_all(pieces)
    assert ended
    assert got == text
    assert at == len(pieces) - 1  # the end is the last piece, never earlier


def test_size_limit_keeps_counting_but_drops_text() -> None:
    buf = MessageBuffer(max_size=10, max_line_length=998)
    buf.write(b"12345\r\n")
    assert buf.state is ContentState.OK
    buf.write(b"6789\r\n")
    assert buf.state is ContentState.TOO_BIG
    buf.write(b"more\r\n")
    assert buf.size == 19
    assert list(buf.content()) == []


@pytest.mark.parametrize(("pieces", "ok"), [
    ([b"x" * 10 + b"\r\n"], True),
    ([b"x" * 11 + b"\r\n"], False),
    ([b"x" * 5, b"x" * 5, b"\r", b"\n"], True),
    ([b"x" * 5, b"x" * 6, b"\r\n"], False),
    ([b"x" * 10 + b"\r", b"\nshort\r\n"], True),
    ([b"ok\r\n" + b"y" * 10 + b"\r\n" + b"z" * 11 + b"\r\nok\r\n"], False),
    ([b"ok\r\n" + b"y" * 10 + b"\r\n" + b"z" * 10 + b"\r\nok\r\n"], True),
    ([b"x" * 11], False),  # already too long before its end arrives
    ([b"x" * 11 + b"\n"], False),  # bare LF: no CR to discount
])
def test_line_length(pieces: list[bytes], ok: bool) -> None:
    buf = MessageBuffer(max_size=1 << 20, max_line_length=10)
    for piece in pieces:
        buf.write(piece)
    assert (buf.state is ContentState.OK) is ok


def test_no_line_limit_measures_nothing() -> None:
    buf = MessageBuffer(max_size=1 << 20, max_line_length=0)
    buf.write(b"Subject: x\r\n\r\n" + b"x" * 5000 + b"\r\n")
    assert buf.state is ContentState.OK
    assert b"".join(buf.content()).count(b"x") == 5001


def test_policy_measures_lines_only_when_strict() -> None:
    from sluice.smtpd.policy import ReceivePolicy

    assert ReceivePolicy().line_limit == 0
    strict = ReceivePolicy(reject_long_lines=True, max_line_length=1200)
    assert strict.line_limit == 1200
    reply = strict.content(ContentState.LINE_TOO_LONG)
    assert reply is not None and (reply.code, reply.enhanced) == (554, "5.6.0")


def test_spills_to_a_file_and_gives_back_the_same_bytes(tmp_path: Path) -> None:
    buf = MessageBuffer(max_size=1 << 20, max_line_length=998, spill_size=100,
                        spill_dir=tmp_path)
    head = b"Subject: big\r\nX-A: 1\r\n\r\n"
    lines = [b"line %05d " % i + b"." * 50 + b"\r\n" for i in range(500)]
    buf.write(head)
    assert not buf.spilled
    for line in lines:
        buf.write(line)
    assert buf.spilled
    assert buf.header_block() == head
    assert b"".join(buf.content(b"Received: x\r\n")) == b"Received: x\r\n" + head + b"".join(lines)
    assert buf.size == len(head) + sum(map(len, lines))
    buf.close()
    assert not buf.spilled


def test_header_block_in_memory() -> None:
    buf = MessageBuffer(max_size=1000, max_line_length=998)
    buf.write(b"A: 1\r\nB: 2\r\n\r\nbody\r\n")
    assert buf.header_block() == b"A: 1\r\nB: 2\r\n\r\n"
    assert b"".join(buf.content()) == b"A: 1\r\nB: 2\r\n\r\nbody\r\n"
    only = MessageBuffer(max_size=1000, max_line_length=998)
    only.write(b"\r\nno headers\r\n")
    assert only.header_block() == b""


def test_a_failing_spill_is_a_failed_state(tmp_path: Path) -> None:
    buf = MessageBuffer(max_size=1 << 20, max_line_length=998, spill_size=10,
                        spill_dir=tmp_path / "missing")
    buf.write(b"0123456789abcdef\r\n")
    assert buf.state is ContentState.FAILED
    assert isinstance(buf.error, OSError)


def test_received_header() -> None:
    at = 1795341600.0  # 2026-11-22 10:00:00 UTC, a Sunday
    header = received_header(helo="client.example", client_ip="192.0.2.1",
                             hostname="mx.sluice.test", protocol="ESMTPS",
                             spid="0123456789ABCDEF", recipient="bob@example.org", at=at)
    assert header == (
        b"Received: from client.example ([192.0.2.1])\r\n"
        b"\tby mx.sluice.test (Sluice) with ESMTPS id 0123456789ABCDEF\r\n"
        b"\tfor <bob@example.org>; Sun, 22 Nov 2026 10:00:00 +0000\r\n")
    many = received_header(helo="c (evil)\r\nX-Injected: 1", client_ip="2001:db8::1",
                           hostname="mx", protocol="ESMTP", spid="019A2B3C4D5E6F70",
                           recipient=None, at=at)
    assert many.startswith(b"Received: from c??evil???X-Injected:?1 ([IPv6:2001:db8::1])\r\n")
    assert b"\r\n\tby mx (Sluice) with ESMTP id 019A2B3C4D5E6F70;\r\n\tSun, 22 Nov 2026" in many
    assert many.count(b"\r\n") == 3


def test_protocol_names_and_dates() -> None:
    assert protocol_name(False, False, False) == "SMTP"
    assert protocol_name(True, False, False) == "ESMTP"
    assert protocol_name(True, True, False) == "ESMTPS"
    assert protocol_name(True, True, True) == "ESMTPSA"
    assert protocol_name(True, False, True) == "ESMTPA"
    assert protocol_name(True, True, True, smtputf8=True) == "UTF8SMTPSA"
    assert rfc5322_date(0) == "Thu, 01 Jan 1970 00:00:00 +0000"
    now = time.time()
    assert rfc5322_date(now) == time.strftime("%a, %d %b %Y %H:%M:%S +0000", time.gmtime(now))
