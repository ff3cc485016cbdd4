r"""Whether a piece of message content may go on the wire as it is: the pure-Python twin.

SUMMARY
    clean_run(data, at_line_start, col, limit) -> int
    dot_line(data) -> bool
    end_mark(buf, start) -> int

DESCRIPTION
    The SMTP DATA encoder (sluice.delivery.encoder) sends most chunks of
    a message unchanged: content received over SMTP already has CRLF line
    ends, and few lines start with a period or exceed the line length
    limit.  Deciding that is the check this module makes.  A chunk is
    clean when

    - every LF has a CR just before it and every CR an LF just after it,
      both inside the chunk (so its last byte is not a CR);
    - no line starts with "." (after an LF, or at the chunk's start when
      ``at_line_start``);
    - with ``limit`` > 0, no line is longer than ``limit`` characters,
      the CRLF not counted, where the first line already had ``col``
      characters before the chunk.

    The answer is the length of the chunk's unfinished last line (the
    ``col`` for the next chunk; ``col`` plus the chunk's length when it
    has no LF), or -1 when the chunk is not clean.

    The receiver (sluice.smtpd) asks two simpler questions of what it
    reads: whether a piece has a line that starts with "." (``dot_line``:
    an LF followed by "."), to unstuff, and where the first ".CRLF" at or
    after ``start`` ends (``end_mark``: the index just past it, or -1),
    to cut DATA into pieces that end where the data may end.

STRATEGIES
    Two implementations, one answer.  A C extension module of the same
    name (_wirescan.c, built with the mypyc modules; sluice._native)
    finds each LF with memchr and looks at its neighbours, then counts the
    CRs with memchr: two walks at memory speed.  The receiver's two searches are one regular
    expression each here (about 47 µs for 100 KB each), a memchr loop
    over the LFs there.  This file is what runs without the build: bytes
    methods and regular expressions, a pass each (about 230 µs for 100 KB
    on the project's machine, against about 24 µs in C).  A property test
    holds the two to the same answers (tests/unit/test_wirescan.py).

SEE ALSO
    sluice.delivery.encoder, RFC 5321 4.5.2 and 4.5.3.1.6
"""

from __future__ import annotations

import re

__all__ = ["clean_run", "dot_line", "end_mark"]

# re finds these two- and one-byte patterns two to three times faster than
# bytes.find and `in` (CPython 3.11, text with a line end every 80 bytes).
_DOT_LINE = re.compile(rb"\n\.")
_BARE_CR = re.compile(rb"\r(?!\n)")
_END_MARK = re.compile(rb"\.\r\n")


def dot_line(data: bytes) -> bool:
    """Whether an LF in ``data`` is followed by "." (DESCRIPTION)."""
    return _DOT_LINE.search(data) is not None


def end_mark(buf: bytes | bytearray, start: int) -> int:
    """The index just past the first ".CRLF" at or after ``start`` in ``buf``, or -1."""
    found = _END_MARK.search(buf, start)
    return -1 if found is None else found.end()


def clean_run(data: bytes, at_line_start: bool, col: int, limit: int) -> int:
    """The unfinished last line's length if ``data`` may go out as it is, else -1 (DESCRIPTION)."""
    if col < 0 or limit < 0:
        raise ValueError("clean_run: col and limit must be >= 0")
    if not data:
        return col
    if data[-1] == 0x0D or (at_line_start and data[0] == 0x2E):
        return -1
    # With no CR that is not followed by an LF, each CR has its own LF; as
    # many CRs as LFs then leaves no LF alone.
    if (dot_line(data) or data.count(b"\n") != data.count(b"\r")
            or _BARE_CR.search(data) is not None):
        return -1
    last = data.rfind(b"\n")
    if last < 0:
        col += len(data)
        return -1 if limit and col > limit else col
    tail = len(data) - last - 1
    if limit and _longest_line(data, col, limit, last) > limit:
        return -1
    return tail


def _longest_line(data: bytes, col: int, limit: int, last: int) -> int:
    """The longest line of clean CRLF ``data`` up to its ``last`` LF, or one found over the limit.

    A line over the limit is a run of at least limit + 1 bytes without an
    LF, and such a run holds a whole block of (limit + 1) // 2 bytes
    however the blocks are laid: one find() per block (it stops at the
    block's first LF) rules the middle lines out without a pass over them
    all.
    """
    first = data.find(b"\n")
    longest = max(col + first - 1, len(data) - last - 1)
    if longest > limit:
        return longest
    block = (limit + 1) // 2
    find = data.find
    for start in range(first + 1, last, block):
        if find(b"\n", start, start + block) < 0:
            # a block without a line end: measure the middle lines exactly
            middle = data[first + 1 : last].split(b"\n")
            return max(longest, max(map(len, middle)) - 1)
    return longest
