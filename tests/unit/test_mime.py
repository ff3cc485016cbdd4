"""sluice.mime: is any header block of a message, MIME parts
included, UTF-8?  As Postfix's cleanup flags it (every header line it
writes, attachment headers too), from content fed in pieces."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice.mime import HEADER_LIMIT, HeaderScan, utf8_headers

pytestmark = pytest.mark.unit


def mixed(part_headers: str, *, body: str = "text\r\n", epilogue: str = "") -> bytes:
    return (
        "From: a@src.test\r\nSubject: plain\r\nMIME-Version: 1.0\r\n"
        'Content-Type: multipart/mixed; boundary="=_b1"\r\n\r\n'
        "This is a multi-part message.\r\n"
        "--=_b1\r\nContent-Type: text/plain\r\n\r\nhello\r\n"
        f"--=_b1\r\n{part_headers}\r\n{body}"
        f"--=_b1--\r\n{epilogue}"
    ).encode()


UTF8_FILENAME = 'Content-Type: application/pdf\r\nContent-Disposition: attachment; ' \
                'filename="Lebenslauf-Jörg.pdf"\r\n'
CASES = {
    "ascii, one part": (b"Subject: hi\r\n\r\nbody\r\n", False),
    "utf-8 top header": ("Subject: Grüße\r\n\r\nbody\r\n".encode(), True),
    "utf-8 body only": ("Subject: hi\r\n\r\nSubject: Grüße\r\n".encode(), False),
    "utf-8 attachment header": (mixed(UTF8_FILENAME), True),
    "latin-1 attachment header": (mixed(UTF8_FILENAME).replace("ö".encode(), b"\xf6"), False),
    "ascii parts, utf-8 part body": (mixed("Content-Type: text/plain\r\n",
                                           body="Grüße\r\n"), False),
    "utf-8 in the preamble": (mixed("Content-Type: text/plain\r\n").replace(
        b"This is", "Subject: Grüße\r\nThis is".encode()), False),
    "utf-8 after the close delimiter": (mixed("Content-Type: text/plain\r\n",
                                              epilogue="--=_b1\r\nX-Über: 1\r\n\r\n"), False),
    "a part without headers": (mixed("", body="Grüße\r\n"), False),
    "bare LF": (mixed(UTF8_FILENAME).replace(b"\r\n", b"\n"), True),
}


@pytest.mark.parametrize(("content", "want"), CASES.values(), ids=CASES.keys())
def test_whole(content: bytes, want: bool) -> None:
    assert utf8_headers([content]) is want


NESTED = (
    'Subject: plain\r\nContent-Type: multipart/mixed;\r\n boundary=outer\r\n\r\n'
    '--outer\r\nContent-Type: multipart/alternative; boundary="inner b"\r\n\r\n'
    '--inner b\r\nContent-Type: text/plain\r\n\r\nplain\r\n'
    '--inner b \r\nContent-Type: text/html\r\n{inner}\r\n<p>html</p>\r\n'
    '--inner b--\r\n'
    '--outer\r\nContent-Type: message/rfc822\r\n\r\n'
    'From: x@y.test\r\n{attached}\r\nattached body\r\n'
    '--outer--\r\n'
)


@pytest.mark.parametrize(("inner", "attached", "want"), [
    ("", "Subject: plain", False),
    ("Content-Description: Übersicht\r\n", "Subject: plain", True),   # nested multipart
    ("", "Subject: Grüße", True),                                      # attached message
], ids=["all ascii", "inner part", "attached message"])
def test_nested(inner: str, attached: str, want: bool) -> None:
    assert utf8_headers([NESTED.format(inner=inner, attached=attached).encode()]) is want


def test_a_line_that_only_looks_like_a_delimiter_starts_no_part() -> None:
    content = mixed("Content-Type: text/plain\r\n",
                    body="--=_b1x\r\nX-Über: 1\r\n\r\n--=_b2\r\nX-Über: 1\r\n\r\n")
    assert utf8_headers([content]) is False


def test_a_single_part_message_settles_after_its_header() -> None:
    scan = HeaderScan()
    scan.feed(b"Subject: hi\r\n")
    assert not scan.settled
    scan.feed(b"\r\nbody")
    assert scan.settled and not scan.utf8
    assert scan.close() is False


def test_a_multipart_message_settles_only_at_its_end_or_a_utf8_header() -> None:
    content = mixed(UTF8_FILENAME)
    cut = content.index("Jörg".encode())
    scan = HeaderScan()
    scan.feed(content[:cut])
    assert not scan.settled
    scan.feed(content[cut:])
    assert scan.settled and scan.utf8


def test_content_that_ends_inside_a_header_block() -> None:
    assert utf8_headers(["Subject: Grüße".encode()]) is True
    assert utf8_headers([mixed("").split(b"--=_b1\r\n\r\n")[0] + "--=_b1\r\nX-Ä: 1".encode()])


def test_a_huge_header_block_is_judged_on_its_start() -> None:
    start = b"Subject: hi\r\nX-Long: " + b"a" * HEADER_LIMIT
    assert utf8_headers([start + "ä\r\n\r\nbody".encode()]) is False
    assert utf8_headers(["X-Ü: 1\r\n".encode() + start + b"\r\n\r\n"]) is True


@given(st.sampled_from(sorted(CASES)), st.lists(st.integers(min_value=0), max_size=12))
def test_any_chunking_gives_the_same_answer(case: str, cuts: list[int]) -> None:
    content, want = CASES[case]
    points = sorted({c % (len(content) + 1) for c in cuts})
    pieces = [content[a:b] for a, b in zip([0, *points], [*points, len(content)], strict=True)]
    assert utf8_headers(pieces) is want
