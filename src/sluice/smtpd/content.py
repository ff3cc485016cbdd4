"""The message text of one DATA command: unstuffed, measured, kept in memory or spilled.

SUMMARY
    Unstuffer().feed(raw) -> (text, ended)
    MessageBuffer(max_size, max_line_length, spill_size, spill_dir)
        .write(text)  .state  .size  .header_block()  .content(prefix)  .close()

DESCRIPTION
    The SMTP adapter reads DATA in pieces as the network delivers them and
    passes each raw piece through an Unstuffer, which finds the end of the
    data (CRLF . CRLF) and undoes RFC 5321 4.5.2 transparency: a period at
    the start of a line is removed.  The text goes into a MessageBuffer,
    which counts bytes and measures lines as they pass, so that limits are
    known the moment DATA ends, without a second pass over the text.

    Small messages stay in memory as the list of pieces they arrived in.
    Once a message grows past ``spill_size`` its text moves to an
    anonymous temporary file (in the queue's directory, so on the same
    file system as the spool), and memory stays bounded whatever the size.

STRATEGIES
    Pieces, not lines.  Reading line by line costs a Python round trip per
    line; the adapter reads up to the next ".CRLF" (or 64 KiB) at a time,
    and the searching and unstuffing here work in C over the whole piece
    (sluice._wirescan's memchr walk finds a line to unstuff; bytes.replace
    unstuffs it).  An Unstuffer keeps the last two raw bytes
    of the previous piece, so a CRLF or a ".CRLF" split across pieces is
    still seen.

    Measure only when asked.  ``max_line_length`` 0 (the default policy:
    long lines are accepted) skips the line measuring altogether.

    Keep reading past a limit.  A message that is too big or has a line
    too long is not stored further, but DATA is read to its end so the
    session stays in step (RFC 5321 4.2.5 sends the refusal after the
    final dot).

INVARIANTS
    Feeding the raw DATA stream in any split gives the same text and the
    same end as feeding it whole (tests/unit/test_smtpd_content.py checks
    this with hypothesis).

LIMITATIONS
    A spilled message is written twice, once to the temporary file and
    once to the spool, because the store names the spool file (SPID) only
    when the submission comes in.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from typing import IO

from sluice._wirescan import dot_line
from sluice.smtpd.policy import ContentState

__all__ = ["HEADER_BLOCK_MAX", "MessageBuffer", "Unstuffer"]

#: The end-of-DATA hook sees at most this much of the header block.
HEADER_BLOCK_MAX = 65536
_CRLF = b"\r\n"


class Unstuffer:
    """Finds the end of DATA and removes transparency dots, piece by piece."""

    __slots__ = ("_tail",)

    def __init__(self) -> None:
        # The last two raw bytes seen; DATA starts at the start of a line.
        self._tail = _CRLF

    def feed(self, raw: bytes) -> tuple[bytes, bool]:
        """The text in ``raw`` and whether it ended the data.

        ``raw`` must not extend past the end of the data: the adapter reads
        up to and including ".CRLF", so when a piece ends the data, the end
        marker is its last three bytes.
        """
        ended = False
        if raw.endswith(b".\r\n"):
            n = len(raw)
            if n >= 5:
                ended = raw[n - 5 : n - 3] == _CRLF
            elif n == 4:
                ended = self._tail[1:] == b"\r" and raw[0:1] == b"\n"
            else:
                ended = self._tail == _CRLF
            if ended:
                raw = raw[:-3]
        if not raw:
            return b"", ended
        prefix = self._tail
        if len(raw) >= 2:
            self._tail = raw[-2:]
        else:
            self._tail = self._tail[1:] + raw
        if not dot_line(raw) and not (raw[0:1] == b"." and prefix[1:] == b"\n"):
            return raw, ended  # nothing to unstuff: no copy (the common case)
        # A period right after CRLF goes.  Prefixing the last raw bytes lets
        # replace() see a CRLF that the previous piece ended with.
        text = (prefix + raw).replace(b"\r\n.", _CRLF)[2:]
        return text, ended


class MessageBuffer:
    """Unstuffed text of one message, with its size and line limits."""

    __slots__ = ("_cr", "_file", "_line", "_pieces", "_spill_dir", "_stored", "error",
                 "max_line_length", "max_size", "size", "spill_size", "state")

    def __init__(self, max_size: int, max_line_length: int, spill_size: int = 1 << 20,
                 spill_dir: str | os.PathLike[str] | None = None) -> None:
        self.max_size = max_size
        self.max_line_length = max_line_length
        self.spill_size = spill_size
        self._spill_dir = spill_dir
        self.size = 0  # bytes of text seen, also past a limit
        self.state = ContentState.OK
        self.error: OSError | None = None  # why state is FAILED
        self._pieces: list[bytes] = []
        self._stored = 0  # bytes in _pieces
        self._file: IO[bytes] | None = None
        self._line = 0  # length of the unterminated last line so far (with any CR)
        self._cr = False

    @property
    def spilled(self) -> bool:
        """Whether the message outgrew memory and is being written to a file."""
        return self._file is not None

    def write(self, text: bytes) -> None:
        """Add text.  A failure to spill to disk sets state FAILED (451 4.3.0)."""
        n = len(text)
        if not n:
            return
        self.size += n
        if self.state is not ContentState.OK:
            return
        if self.size > self.max_size:
            self._drop(ContentState.TOO_BIG)
            return
        if self.max_line_length and not self._measure(text):
            self._drop(ContentState.LINE_TOO_LONG)
            return
        try:
            if self._file is not None:
                self._file.write(text)
                return
            self._pieces.append(text)
            self._stored += n
            if self._stored > self.spill_size:
                self._spill()
        except OSError as exc:
            self.error = exc
            self._drop(ContentState.FAILED)

    def _measure(self, text: bytes) -> bool:
        """Track line lengths; False once a line is over the limit.

        A line's length does not count its CR LF (RFC 5322 2.1.1).  ``_line``
        is the length of the unterminated last line so far, ``_cr`` whether
        its last byte is a CR (which belongs to the line end, not the line).
        """
        limit = self.max_line_length
        n = len(text)
        last_lf = text.rfind(b"\n")
        if self._line + n <= limit:  # fast path: no line here can be too long
            self._line = n - last_lf - 1 if last_lf >= 0 else self._line + n
            self._cr = text.endswith(b"\r")
            return True
        if last_lf < 0:
            self._line += n
            self._cr = text.endswith(b"\r")
            return self._line - self._cr <= limit
        lines = text.split(b"\n")
        first = lines[0]
        ends_cr = first.endswith(b"\r") if first else self._cr
        if self._line + len(first) - ends_cr > limit:
            return False
        middle = lines[1:-1]
        if middle and max(map(len, middle)) > limit:
            for line in middle:  # only a line one longer than the limit may be saved by its CR
                if len(line) - line.endswith(b"\r") > limit:
                    return False
        last = lines[-1]
        self._line = len(last)
        self._cr = last.endswith(b"\r")
        return self._line - self._cr <= limit

    def _drop(self, state: ContentState) -> None:
        self.state = state
        self._pieces = []
        self._stored = 0
        if self._file is not None:
            self._file.close()
            self._file = None

    def _spill(self) -> None:
        f = tempfile.TemporaryFile(prefix="smtpd-", dir=self._spill_dir)  # noqa: SIM115
        try:
            for piece in self._pieces:
                f.write(piece)
        except BaseException:
            f.close()
            raise
        self._file = f
        self._pieces = []
        self._stored = 0

    def header_block(self) -> bytes:
        """The header block up to and including the empty line (at most 64 KiB)."""
        if self._file is not None:
            self._file.flush()
            head = os.pread(self._file.fileno(), HEADER_BLOCK_MAX, 0)
        else:
            head = b"".join(self._pieces)[:HEADER_BLOCK_MAX]
        if head.startswith(_CRLF):
            return b""
        end = head.find(b"\r\n\r\n")
        return head[: end + 4] if end >= 0 else head

    def content(self, prefix: bytes = b"") -> list[bytes] | Iterator[bytes]:
        """What to submit to the queue: ``prefix`` (our Received header), then the text."""
        if self._file is None:
            return [prefix, *self._pieces] if prefix else list(self._pieces)
        return self._iter_file(prefix)

    def _iter_file(self, prefix: bytes) -> Iterator[bytes]:
        f = self._file
        assert f is not None
        f.flush()
        if prefix:
            yield prefix
        offset = 0
        while True:
            piece = os.pread(f.fileno(), 1 << 16, offset)
            if not piece:
                return
            offset += len(piece)
            yield piece

    def close(self) -> None:
        """Drop the text held, closing the spill file if there is one."""
        self._pieces = []
        if self._file is not None:
            self._file.close()
            self._file = None
