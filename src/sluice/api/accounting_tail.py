"""Following the accounting log: the complete lines appended since the last poll.

SUMMARY
    tail = AccountingTail(config.accounting.path); tail.prime()
    tail.poll(handle)   (every second; handle gets each new line)

STRATEGY
    Keep a byte offset per file and follow only the newest TAIL_FILES
    files (the current period, the one before for lines written across the
    boundary, one spare).  A line without its newline yet is kept until
    the rest arrives; a file that shrank was replaced and is read again
    from its start.  One poll reads at most POLL_MAX_BYTES.

LIMITATIONS
    A process whose clock is hours off writes where it is not read.

SEE ALSO
    sluice.accounting (the writer), sluice.api.metrics (the reader's user)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["POLL_MAX_BYTES", "TAIL_FILES", "AccountingTail"]

#: Accounting files followed (the newest by name): the current period, the
#: one before (lines written across the boundary) and one spare.
TAIL_FILES = 3

#: The most bytes one poll reads from the accounting log.
POLL_MAX_BYTES = 32 << 20


class AccountingTail:
    """Reads the lines appended to the accounting log since the last poll."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._offsets: dict[str, int] = {}
        self._partial: dict[str, bytes] = {}

    def _names(self) -> list[str]:
        try:
            names = [n for n in os.listdir(self.path)
                     if n.startswith("sluice-acct-") and n.endswith(".jsonl")]
        except FileNotFoundError:
            return []
        return sorted(names)[-TAIL_FILES:]

    def prime(self) -> None:
        """Start at the end: lines written before now are not counted."""
        for name in self._names():
            try:
                self._offsets[name] = (self.path / name).stat().st_size
            except FileNotFoundError:
                continue

    def poll(self, handle: Callable[[bytes], None], max_bytes: int = POLL_MAX_BYTES) -> int:
        """Call ``handle`` with every complete new line; returns bytes read."""
        names = self._names()
        for gone in set(self._offsets) - set(names):
            self._offsets.pop(gone, None)
            self._partial.pop(gone, None)
        total = 0
        for name in names:
            offset = self._offsets.get(name, 0)
            try:
                with open(self.path / name, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    if size < offset:  # replaced by a shorter file
                        offset = 0
                        self._partial.pop(name, None)
                    if size == offset:
                        self._offsets[name] = offset
                        continue
                    f.seek(offset)
                    data = f.read(min(size - offset, max(0, max_bytes - total)))
            except FileNotFoundError:
                continue
            if not data:
                continue
            total += len(data)
            self._offsets[name] = offset + len(data)
            data = self._partial.pop(name, b"") + data
            lines = data.split(b"\n")
            if lines[-1]:
                self._partial[name] = lines[-1]
            for line in lines[:-1]:
                if line:
                    handle(line)
            if total >= max_bytes:
                break
        return total
