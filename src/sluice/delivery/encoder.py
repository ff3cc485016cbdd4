"""SMTP DATA encoding of spooled content, one chunk at a time (ZoneMTA's encoder).

SUMMARY
    DataEncoder().feed(chunk) -> bytes; DataEncoder().finish() -> bytes;
    encode_stream(fp, bufsize) -> Iterator[bytes].

DESCRIPTION
    What goes on the wire after ``354`` is the content with three changes
    (RFC 5321 sections 2.3.8 and 4.5.2):

    line ends      every line ends in CRLF: a bare LF and a bare CR each
                   become CRLF; CRLF stays as it is.
    dot-stuffing   a line that starts with "." gets one more "." in front.
    final dot      the data ends with CRLF "." CRLF; content that does not
                   end in a line break gets one first.

    The encoder is fed the content in pieces as they are read from the
    spool, so a message is never held whole in memory.

STRATEGIES
    Pass clean chunks through.  Content received over SMTP already has CRLF
    line ends; a chunk in which every CR and LF pair up and no line starts
    with "." is returned as it is, found by counting (no copy).

    Work in C otherwise.  A chunk that needs changes is normalised with
    bytes.replace (CRLF and CR to LF, stuff "\\n.", LF to CRLF), not a
    Python loop per byte.

    Two bits of state carry across chunk boundaries: whether the last byte
    was a CR (so an LF at the start of the next chunk completes that CRLF
    instead of adding a blank line), and whether the next byte starts a
    line (so a "." that begins a chunk is stuffed when it begins a line).

INVARIANTS
    The output for any split of the input into chunks is the same as for
    the whole input at once (property-tested against a line-by-line
    reference).

SEE ALSO
    RFC 5321 4.5.2 (transparency), sluice.delivery.client
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import IO

__all__ = ["DataEncoder", "encode_stream"]


class DataEncoder:
    """Streaming SMTP DATA encoder; one per message."""

    __slots__ = ("_at_line_start", "_pending_cr")

    def __init__(self) -> None:
        self._at_line_start = True
        self._pending_cr = False

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
        if last != 0x0D and not lead_dot and b"\n." not in data:
            # Content received over SMTP is CRLF already: when every CR and
            # every LF belongs to a CRLF, the chunk goes out as it is.
            crlf = data.count(b"\r\n")
            if data.count(b"\n") == crlf and data.count(b"\r") == crlf:
                self._pending_cr = False
                self._at_line_start = last == 0x0A
                return data
        # A trailing CR is a line break either way (bare CR or the start of
        # CRLF); remember it so a leading LF in the next chunk is swallowed.
        self._pending_cr = last == 0x0D
        data = data.replace(b"\r\n", b"\n")
        if b"\r" in data:
            data = data.replace(b"\r", b"\n")
        data = data.replace(b"\n.", b"\n..")
        if lead_dot:
            data = b"." + data
        self._at_line_start = data[-1] == 0x0A
        return data.replace(b"\n", b"\r\n")

    def finish(self) -> bytes:
        """The end of the data: a line break if one is missing, then ".\\r\\n"."""
        return b".\r\n" if self._at_line_start else b"\r\n.\r\n"


def encode_stream(fp: IO[bytes], bufsize: int = 65536) -> Iterator[bytes]:
    """The encoded DATA of the binary stream ``fp``, including the final dot,
    read ``bufsize`` bytes at a time."""
    enc = DataEncoder()
    while True:
        chunk = fp.read(bufsize)
        if not chunk:
            break
        out = enc.feed(chunk)
        if out:
            yield out
    yield enc.finish()
