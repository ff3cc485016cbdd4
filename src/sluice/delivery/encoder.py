r"""SMTP DATA encoding of spooled content, one chunk at a time (ZoneMTA's encoder).

SUMMARY
    DataEncoder(line_length_limit=0).feed(chunk) -> bytes; .finish() -> bytes;
    encode_stream(fp, bufsize, line_length_limit=0) -> Iterator[bytes].

DESCRIPTION
    What goes on the wire after ``354`` is the content with three changes
    (RFC 5321 sections 2.3.8 and 4.5.2):

    line ends      every line ends in CRLF: a bare LF and a bare CR each
                   become CRLF; CRLF stays as it is.
    dot-stuffing   a line that starts with "." gets one more "." in front.
    final dot      the data ends with CRLF "." CRLF; content that does not
                   end in a line break gets one first.

    and, when ``line_length_limit`` is set (``delivery.smtp_line_length_limit``,
    998 by default), one more, Postfix's (its smtp_line_length_limit):

    folding        a line longer than the limit is broken by inserting
                   CRLF SPACE after ``limit`` characters, and again after
                   each further ``limit - 1`` (the space counts), so no line
                   on the wire is longer than the limit.  A line of exactly
                   the limit is not touched.  The CRLF and a stuffed dot do
                   not count (RFC 5321 4.5.3.1.6, 4.5.2).  In a header the
                   break is a legal folding (the space starts a continuation
                   line); in a body it is a change a reader may see, and it
                   breaks a DKIM signature over that body.  0 turns folding
                   off: long lines go out as they are.

    The encoder is fed the content in pieces as they are read from the
    spool, so a message is never held whole in memory.

STRATEGIES
    Pass clean chunks through.  Content received over SMTP already has CRLF
    line ends; a chunk in which every CR and LF pair up and no line starts
    with "." is returned as it is, found by counting (no copy).

    Work in C otherwise.  A chunk that needs changes is normalised with
    bytes.replace (CRLF and CR to LF, stuff "\n.", LF to CRLF), not a
    Python loop per byte.

    Two bits of state carry across chunk boundaries: whether the last byte
    was a CR (so an LF at the start of the next chunk completes that CRLF
    instead of adding a blank line), and whether the next byte starts a
    line (so a "." that begins a chunk is stuffed when it begins a line).
    With folding, a third: how long the unfinished output line is.

    Fold rarely, check cheaply.  Whether a clean chunk has a line over the
    limit is decided by one find() per block of half the limit (see
    _needs_fold), plus the length carried from the previous chunk; only a
    chunk that needs folding leaves the fast path.  (A regex search for a
    long run costs a scan per starting position; splitting the chunk into
    lines costs an object per line: both were measured slower.)

INVARIANTS
    The output for any split of the input into chunks is the same as for
    the whole input at once (property-tested against a line-by-line
    reference).

SEE ALSO
    RFC 5321 4.5.2 (transparency), 4.5.3.1.6 (text line length),
    Postfix postconf(5) smtp_line_length_limit, sluice.delivery.client
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import IO

__all__ = ["DataEncoder", "encode_stream"]

# The clean-chunk checks.  re finds these two- and one-byte patterns two to
# three times faster than bytes.find and `in` (CPython 3.11, text with a
# line end every 80 bytes): the tests that decide that a chunk goes out as
# it is are most of the cost of sending a big message.
_DOT_LINE = re.compile(rb"\n\.")
_BARE_CR = re.compile(rb"\r(?!\n)")


class DataEncoder:
    """Streaming SMTP DATA encoder; one per message."""

    __slots__ = ("_at_line_start", "_col", "_limit", "_pending_cr")

    def __init__(self, line_length_limit: int = 0) -> None:
        if line_length_limit < 0 or line_length_limit == 1:
            raise ValueError("line_length_limit must be 0 (no folding) or at least 2")
        self._at_line_start = True
        self._pending_cr = False
        self._limit = line_length_limit
        self._col = 0  # characters in the unfinished output line (folding only)

    def feed(self, chunk: bytes | bytearray | memoryview) -> bytes:
        """The encoded form of ``chunk``, given everything fed before it."""
        data = bytes(chunk)
        if not data:
            return b""
        if self._pending_cr and data[0] == 0x0A:
            # The LF completes the CRLF whose CR ended the previous chunk;
            # that line break has already been written.
            data = data[1:]
            if not data:
                self._pending_cr = False
                return b""
        last = data[-1]
        lead_dot = self._at_line_start and data[0] == 0x2E
        # Content received over SMTP is CRLF already: when every CR and
        # every LF belongs to a CRLF, the chunk goes out as it is.  With no
        # CR that is not followed by an LF, each CR has its own LF; as many
        # CRs as LFs then leaves no LF alone.
        if (last != 0x0D and not lead_dot and _DOT_LINE.search(data) is None
                and data.count(b"\n") == data.count(b"\r") and _BARE_CR.search(data) is None
                and not (self._limit and self._needs_fold(data))):
            self._pending_cr = False
            self._at_line_start = last == 0x0A
            return data
        # A trailing CR is a line break either way (bare CR or the start of
        # CRLF); remember it so a leading LF in the next chunk is swallowed.
        self._pending_cr = last == 0x0D
        data = data.replace(b"\r\n", b"\n")
        if b"\r" in data:
            data = data.replace(b"\r", b"\n")
        if self._limit:
            data = self._fold(data)
        data = data.replace(b"\n.", b"\n..")
        if lead_dot:
            data = b"." + data
        self._at_line_start = data[-1] == 0x0A
        return data.replace(b"\n", b"\r\n")

    def _needs_fold(self, data: bytes) -> bool:
        """Whether clean CRLF ``data`` has a line over the limit; else track the column.

        In clean data every LF has its CR just before it.  A line over the
        limit is a run of at least limit + 1 bytes without an LF, and such
        a run holds a whole block of (limit + 1) // 2 bytes however the
        blocks are laid: one find() per block (it stops at the block's
        first LF) rules the middle lines out without a pass over them all.
        """
        limit = self._limit
        first = data.find(b"\n")
        if first < 0:
            col = self._col + len(data)
            if col > limit:
                return True
            self._col = col
            return False
        last = data.rfind(b"\n")
        tail = len(data) - last - 1
        if self._col + first - 1 > limit or tail > limit:
            return True
        block = (limit + 1) // 2
        find = data.find
        for start in range(first + 1, last, block):
            if find(b"\n", start, start + block) < 0:
                # a block without a line end: measure the middle lines exactly
                middle = data[first + 1 : last].split(b"\n")
                if max(map(len, middle)) - 1 > limit:
                    return True
                break
        self._col = tail
        return False

    def _fold(self, data: bytes) -> bytes:
        """Break the over-long lines of LF-only ``data`` as Postfix does (see DESCRIPTION)."""
        limit = self._limit
        col = self._col
        lines = data.split(b"\n")
        for i, line in enumerate(lines):
            if i:
                col = 0
            room = limit - col
            n = len(line)
            if n <= room:
                col += n
                continue
            # the first piece fills the line; each continuation is SP + limit-1
            pieces = [line[:room]]
            pos, step = room, limit - 1
            while n - pos > step:
                pieces.append(line[pos : pos + step])
                pos += step
            pieces.append(line[pos:])
            lines[i] = b"\n ".join(pieces)
            col = 1 + n - pos
        self._col = col
        return b"\n".join(lines)

    def finish(self) -> bytes:
        r"""The end of the data: a line break if one is missing, then ".\r\n"."""
        return b".\r\n" if self._at_line_start else b"\r\n.\r\n"


def encode_stream(fp: IO[bytes], bufsize: int = 65536, line_length_limit: int = 0
                  ) -> Iterator[bytes]:
    """The encoded DATA of the binary stream ``fp``, including the final dot.

    ``fp`` is read ``bufsize`` bytes at a time.
    """
    enc = DataEncoder(line_length_limit)
    while True:
        chunk = fp.read(bufsize)
        if not chunk:
            break
        out = enc.feed(chunk)
        if out:
            yield out
    yield enc.finish()
