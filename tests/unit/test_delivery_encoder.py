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
