"""The SMTP DATA encoder: examples, and any chunking against a line-by-line reference."""

from __future__ import annotations

import io
import itertools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.delivery.encoder import DataEncoder, encode_stream

pytestmark = pytest.mark.unit


def reference(content: bytes) -> bytes:
    """Split into lines on CRLF, CR or LF; stuff dots; join with CRLF; final dot."""
    if not content:
        return b".\r\n"
    lines = re.split(rb"\r\n|\r|\n", content)
    if lines[-1] == b"":  # content ended with a line break
        lines.pop()
    out = [(b"." + line if line.startswith(b".") else line) + b"\r\n" for line in lines]
    return b"".join(out) + b".\r\n"


def encode_chunks(chunks: list[bytes]) -> bytes:
    enc = DataEncoder()
    return b"".join(enc.feed(c) for c in chunks) + enc.finish()


@pytest.mark.parametrize(
    ("content", "wire"),
    [
        (b"", b".\r\n"),
        (b"a", b"a\r\n.\r\n"),
        (b"a\r\n", b"a\r\n.\r\n"),
        (b"a\nb\n", b"a\r\nb\r\n.\r\n"),
        (b"a\rb\r", b"a\r\nb\r\n.\r\n"),
        (b"a\r\r\nb", b"a\r\n\r\nb\r\n.\r\n"),
        (b"a\n\rb", b"a\r\n\r\nb\r\n.\r\n"),
        (b".\r\n", b"..\r\n.\r\n"),
        (b".hidden\r\n..two\r\nmid.dle\r\n.", b"..hidden\r\n...two\r\nmid.dle\r\n..\r\n.\r\n"),
        (b"x\n.\n", b"x\r\n..\r\n.\r\n"),
        ("Ümlaut: ☃\r\n".encode(), "Ümlaut: ☃\r\n.\r\n".encode()),
    ],
)
def test_examples(content: bytes, wire: bytes) -> None:
    assert encode_chunks([content]) == wire
    assert reference(content) == wire


@pytest.mark.parametrize(
    ("chunks", "wire"),
    [
        ([b"a\r", b"\nb"], b"a\r\nb\r\n.\r\n"),  # CRLF split across chunks
        ([b"a\r", b"\n", b"\n"], b"a\r\n\r\n.\r\n"),
        ([b"a\r", b"\r\n"], b"a\r\n\r\n.\r\n"),  # bare CR, then CRLF
        ([b"a\r\n", b".b"], b"a\r\n..b\r\n.\r\n"),  # dot at the start of a chunk
        ([b"a\r", b".b"], b"a\r\n..b\r\n.\r\n"),
        ([b"a", b".b"], b"a.b\r\n.\r\n"),  # dot in mid-line: not stuffed
        ([b"a\r", b""], b"a\r\n.\r\n"),
    ],
)
def test_chunk_boundaries(chunks: list[bytes], wire: bytes) -> None:
    assert encode_chunks(chunks) == wire


@pytest.mark.property
@settings(max_examples=400, deadline=None)
@given(
    content=st.lists(
        st.sampled_from([b"\r", b"\n", b"\r\n", b".", b"..", b"a", b"\xc3\xa9", b" ", b"\x00"]),
        max_size=60,
    ).map(b"".join),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=8),
)
def test_any_chunking_matches_the_reference(content: bytes, cuts: list[int]) -> None:
    points = sorted({c for c in cuts if c <= len(content)})
    bounds = [0, *points, len(content)]
    chunks = [content[a:b] for a, b in itertools.pairwise(bounds)]
    assert encode_chunks(chunks) == reference(content)


@pytest.mark.property
@settings(max_examples=100, deadline=None)
@given(content=st.binary(max_size=3000), bufsize=st.integers(min_value=1, max_value=64))
def test_encode_stream_reads_in_pieces(content: bytes, bufsize: int) -> None:
    class CountingReader(io.BytesIO):
        biggest = 0

        def read(self, size: int | None = -1) -> bytes:
            assert size is not None and 0 < size <= bufsize  # never "read it all"
            data = super().read(size)
            CountingReader.biggest = max(CountingReader.biggest, len(data))
            return data

    out = b"".join(encode_stream(CountingReader(content), bufsize))
    assert out == reference(content)
    assert CountingReader.biggest <= bufsize


@pytest.mark.property
@settings(max_examples=300, deadline=None)
@given(
    lines=st.lists(st.sampled_from([b"", b"a", b".", b"..x", b"x.y", b"\xc3\xa9t\xc3\xa9"]),
                   max_size=30),
    final_break=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=120), max_size=6),
)
def test_crlf_content_passes_through_unchanged_unless_dotted(
        lines: list[bytes], final_break: bool, cuts: list[int]) -> None:
    # The shape our own SMTP server spools: CRLF everywhere.
    content = b"\r\n".join(lines) + (b"\r\n" if final_break and lines else b"")
    points = sorted({c for c in cuts if c <= len(content)})
    bounds = [0, *points, len(content)]
    chunks = [content[a:b] for a, b in itertools.pairwise(bounds)]
    enc = DataEncoder()
    pieces = [enc.feed(c) for c in chunks]
    assert b"".join(pieces) + enc.finish() == reference(content)
    for chunk, piece in zip(chunks, pieces, strict=True):
        if chunk and b"." not in chunk and not chunk.endswith(b"\r") \
                and not chunk.startswith(b"\n"):
            assert piece is chunk  # clean pieces are not copied


# -- which messages ask for SMTPUTF8 (sluice.model.utf8_header) ------------------------------


@pytest.mark.parametrize(("head", "want"), [
    (b"Subject: ascii\r\n\r\nascii body\r\n", False),
    ("Subject: Grüße\r\n\r\nbody\r\n".encode(), True),
    ("Subject: Grüße\n\nbare LF line ends\n".encode(), True),
    ("Subject: x\r\nFrom: ☃ <a@b.test>\r\n\r\n".encode(), True),
    ("Subject: ascii\r\n\r\nGrüße only in the body\r\n".encode(), False),
    ("\r\nno header at all, Grüße\r\n".encode(), False),
    (b"Subject: caf\xe9 (Latin-1, sent raw)\r\n\r\n", False),
    ("Subject: no end of the header block in sight: Grüße".encode(), True),
    # the first 64 KB may stop inside a character of a long header block
    ("Subject: cut inside a character: Grüße".encode()[:-2], True),
    (b"Subject: caf\xe9 cut", False),
])
def test_utf8_header(head: bytes, want: bool) -> None:
    from sluice.model import utf8_header

    assert utf8_header(head) is want


# -- folding long lines (Postfix's smtp_line_length_limit) -------------------------------------


def postfix_reference(content: bytes, limit: int) -> bytes:
    """Postfix's smtp_text_out, line by line: ``limit`` characters, then CRLF SP and
    ``limit - 1`` more at a time; a leading dot is stuffed on the line's first piece only."""
    if not content:
        return b".\r\n"
    lines = re.split(rb"\r\n|\r|\n", content)
    if lines[-1] == b"":
        lines.pop()
    out = []
    for line in lines:
        wire = b"." if line.startswith(b".") else b""
        space_left = limit
        while len(line) > space_left:
            wire += line[:space_left] + b"\r\n "
            line = line[space_left:]
            space_left = limit - 1
        out.append(wire + line + b"\r\n")
    return b"".join(out) + b".\r\n"


@pytest.mark.parametrize(
    ("content", "wire"),
    [
        (b"abcd\r\n", b"abcd\r\n.\r\n"),  # exactly the limit: untouched
        (b"abcde\r\n", b"abcd\r\n e\r\n.\r\n"),
        (b"abcdefghij", b"abcd\r\n efg\r\n hij\r\n.\r\n"),
        (b".bcdefg\r\n", b"..bcd\r\n efg\r\n.\r\n"),  # the stuffed dot does not count
        (b"ab\r\n....x\n", b"ab\r\n.....\r\n x\r\n.\r\n"),
    ],
)
def test_folding_examples(content: bytes, wire: bytes) -> None:
    enc = DataEncoder(line_length_limit=4)
    assert enc.feed(content) + enc.finish() == wire
    assert postfix_reference(content, 4) == wire


def test_fold_at_a_chunk_boundary() -> None:
    enc = DataEncoder(line_length_limit=4)
    assert enc.feed(b"abcd") == b"abcd"  # may still end here
    assert enc.feed(b"\r\n") == b"\r\n"
    assert enc.feed(b"wxyz") == b"wxyz"
    assert enc.feed(b"!") == b"\r\n !"  # it did not
    assert enc.finish() == b"\r\n.\r\n"


def test_a_5000_character_line_folds_to_998() -> None:
    line = bytes(range(33, 127)) * 60  # 5,640 characters, no dots at fold points matter
    content = b"Subject: long\r\n\r\n" + line[:5000] + b"\r\nend\r\n"
    out = b"".join(encode_stream(io.BytesIO(content), 1000, line_length_limit=998))
    wire_lines = out.split(b"\r\n")
    assert max(map(len, wire_lines)) == 998
    assert out.replace(b"\r\n ", b"").replace(b"\r\n..", b"\r\n.") == content + b".\r\n"
    assert b"".join(encode_stream(io.BytesIO(content), 1000)) == reference(content)


@pytest.mark.property
@settings(max_examples=400, deadline=None)
@given(
    content=st.lists(
        st.sampled_from([b"\r", b"\n", b"\r\n", b".", b"a", b"bb", b"ccccccc", b" "]),
        max_size=80,
    ).map(b"".join),
    limit=st.integers(min_value=2, max_value=9),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=8),
)
def test_any_chunking_folds_as_postfix(content: bytes, limit: int, cuts: list[int]) -> None:
    points = sorted({c for c in cuts if c <= len(content)})
    bounds = [0, *points, len(content)]
    enc = DataEncoder(line_length_limit=limit)
    out = b"".join(enc.feed(content[a:b]) for a, b in itertools.pairwise(bounds)) + enc.finish()
    assert out == postfix_reference(content, limit)
    for wire_line in out.split(b"\r\n"):
        assert len(wire_line) - wire_line.startswith(b"..") <= limit


@pytest.mark.property
@settings(max_examples=200, deadline=None)
@given(
    lines=st.lists(st.binary(min_size=0, max_size=12).map(
        lambda b: b.replace(b"\r", b"r").replace(b"\n", b"n").replace(b".", b"d")), max_size=20),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=6),
)
def test_short_crlf_lines_still_pass_through_with_folding_on(
        lines: list[bytes], cuts: list[int]) -> None:
    content = b"\r\n".join(lines) + b"\r\n"
    points = sorted({c for c in cuts if c <= len(content)})
    chunks = [content[a:b] for a, b in itertools.pairwise([0, *points, len(content)])]
    enc = DataEncoder(line_length_limit=12)
    for chunk in chunks:
        if chunk and not chunk.endswith(b"\r") and not chunk.startswith(b"\n"):
            assert enc.feed(chunk) is chunk
        else:
            enc.feed(chunk)


@pytest.mark.property
@settings(max_examples=400, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=0, max_value=40), max_size=25),
    final_break=st.booleans(),
    limit=st.integers(min_value=2, max_value=16),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=6),
)
def test_clean_crlf_content_folds_as_postfix(lengths: list[int], final_break: bool, limit: int,
                                             cuts: list[int]) -> None:
    # Our own server's spool shape, where the fast path decides whether to fold.
    content = b"\r\n".join(b"abcdefghij"[i % 10:i % 10 + 1] * n for i, n in enumerate(lengths))
    content += b"\r\n" if final_break and lengths else b""
    points = sorted({c for c in cuts if c <= len(content)})
    enc = DataEncoder(line_length_limit=limit)
    out = b"".join(enc.feed(content[a:b])
                   for a, b in itertools.pairwise([0, *points, len(content)])) + enc.finish()
    assert out == postfix_reference(content, limit)


def test_limit_must_leave_room_for_the_space() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        DataEncoder(line_length_limit=1)
