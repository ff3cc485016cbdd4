"""Whether any header block of a message, MIME parts included, is UTF-8.

SUMMARY
    scan = HeaderScan()
    for chunk in chunks:            # the content, in pieces of any size
        scan.feed(chunk)
        if scan.settled:            # a UTF-8 header seen, or none can follow
            break
    scan.close()                    # the answer

    utf8_headers(chunks)            # the same, in one call

DESCRIPTION
    Postfix flags a message as using UTF-8 headers when any header line it
    writes to the queue file is non-ASCII: the top header block, the header
    block of every MIME part (RFC 2046 multipart bodies, nested too), and
    the header block of an attached message (message/rfc822 and
    message/global).  A message received with SMTPUTF8 that has one cannot
    go to a server without SMTPUTF8 (RFC 6531 3.4).  Sluice asks at
    delivery time, from the content in the spool, and only for mail that
    may need it (sluice.delivery.agent.smtputf8_refusal); ``sluice
    sendmail`` asks before queueing, to flag the message.  Messages can be
    large, so the scan streams: it keeps the boundaries in force and the
    header block being read, never a body, and skips through bodies to
    the next line that starts with ``--``.

    A header block counts as UTF-8 by the rule of sluice.model.utf8_header:
    8-bit text in a legacy charset does not.  Content-Type is read only for
    its type and its ``boundary`` parameter (quoted or not); RFC 2231
    parameter continuations are not joined.  A delimiter line is
    ``--boundary`` with optional trailing white space (RFC 2046 5.1.1); the
    close delimiter adds ``--`` and ends that multipart and any opened
    inside it.

LIMITATIONS
    A header block longer than HEADER_LIMIT is judged on its first
    HEADER_LIMIT bytes, as a header cut there.  Lines are split at LF, so
    CRLF and bare-LF content both work.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from sluice.model import utf8_header

__all__ = ["HEADER_LIMIT", "HeaderScan", "utf8_headers"]

HEADER_LIMIT = 1 << 20
"""Bytes of one header block kept for judging it (Postfix: header_size_limit
is 100 KB by default)."""

_CONTENT_TYPE_RE = re.compile(
    rb"(?im)^content-type[ \t]*:[ \t]*([!#-'*+.0-9A-Z^-~-]+)[ \t]*/[ \t]*([!#-'*+.0-9A-Z^-~-]+)"
    rb"(.*(?:\r?\n[ \t].*)*)")
_BOUNDARY_RE = re.compile(rb'(?i);\s*boundary\s*=\s*(?:"((?:[^"\\\r\n]|\\.)*)"|([^;\s"]+))')


class HeaderScan:
    """Finds whether a message has a UTF-8 header block, fed its content in order.

    ``utf8`` is True once a UTF-8 header block (top, MIME part or attached
    message) has been seen.
    """

    def __init__(self) -> None:
        self.utf8 = False
        self._partial = b""       # a line not yet ended
        self._header: bytearray | None = bytearray()  # the block being read, or None in a body
        self._boundaries: list[bytes] = []  # "--" + boundary, outermost first

    @property
    def settled(self) -> bool:
        """Whether no more content can change the answer.

        True once a UTF-8 block was seen, or a body is being read outside any
        multipart (no header block can follow).
        """
        return self.utf8 or (self._header is None and not self._boundaries)

    def feed(self, data: bytes) -> None:
        """Take the next piece of the content."""
        if self.settled or not data:
            return
        buf = self._partial + data
        pos = 0  # always the start of a line
        while not self.settled:
            if self._header is None and not buf.startswith(b"--", pos):
                # In a body only delimiter lines matter: skip to the next "--".
                nxt = buf.find(b"\n--", pos)
                if nxt < 0:
                    pos = buf.rfind(b"\n", pos) + 1 or pos
                    break
                pos = nxt + 1
            end = buf.find(b"\n", pos)
            if end < 0:
                break
            line, pos = buf[pos:end], end + 1
            if self._line(line):
                self.utf8 = True
        # A line longer than any header block kept is no delimiter either.
        self._partial = buf[pos:pos + HEADER_LIMIT + 1]

    def close(self) -> bool:
        """The content has ended (or the rest cannot matter); the answer."""
        if self.settled:
            return self.utf8
        if self._partial:
            self.utf8 = self._line(self._partial, last=True)
            self._partial = b""
        elif self._header:
            self.utf8 = utf8_header(bytes(self._header))
        return self.utf8

    def _line(self, line: bytes, last: bool = False) -> bool:
        """One line without its LF; True when it completes a UTF-8 block."""
        header = self._header
        if header is not None:
            if line.rstrip(b"\r") == b"":
                return self._header_done(bytes(header))
            if len(header) < HEADER_LIMIT:
                header += line[:HEADER_LIMIT - len(header)] + b"\n"
            return last and utf8_header(bytes(header))
        if self._boundaries and line.startswith(b"--"):
            self._delimiter(line.rstrip(b" \t\r"))
        return False

    def _header_done(self, block: bytes) -> bool:
        if utf8_header(block):
            return True
        self._header = None
        found = _CONTENT_TYPE_RE.search(block)
        if found is None:
            return False
        kind, sub = found.group(1).lower(), found.group(2).lower()
        if kind == b"multipart":
            param = _BOUNDARY_RE.search(found.group(3))
            if param is not None:
                boundary = param.group(1) if param.group(1) is not None else param.group(2)
                if boundary:
                    self._boundaries.append(b"--" + boundary.replace(b"\\", b""))
        elif kind == b"message" and sub in (b"rfc822", b"global"):
            self._header = bytearray()  # the attached message's header block follows
        return False

    def _delimiter(self, line: bytes) -> None:
        for depth in range(len(self._boundaries) - 1, -1, -1):
            mark = self._boundaries[depth]
            if line == mark:
                del self._boundaries[depth + 1:]
                self._header = bytearray()  # a part's header block follows
                return
            if line == mark + b"--":
                del self._boundaries[depth:]
                return


def utf8_headers(chunks: Iterable[bytes]) -> bool:
    """Whether any header block of the content in ``chunks`` is UTF-8."""
    scan = HeaderScan()
    for chunk in chunks:
        scan.feed(chunk)
        if scan.settled:
            break
    return scan.close()
