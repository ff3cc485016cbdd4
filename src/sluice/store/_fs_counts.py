"""The filesystem flavour's counters: qcount without listing the tree.

SUMMARY
    CountsFile(root): load()/store() for the committer under the queue's
    lock, trusted() for readers (the totals, or None when they cannot be
    trusted); Tally (the totals); changed_files(view, fx) and
    add_changes(tally, changes) (what a batch does to them).

DESCRIPTION
    ``counts`` holds the recipients per state, the messages, a sequence
    number that every counting batch of any process raises before it
    changes anything (so even one killed midway has), the boot it
    was written in and whether it is to be trusted ("ok").  A batch that
    changes control files, under the queue's lock, first stores the
    totals with ok false (before it writes or links anything), then, once
    its files are in place and its content links dropped, the totals plus
    what it changed, ok again.  A batch cut short (a crash, a failed
    rename or sync: it drops the links it made, not the marker) leaves ok
    false; so does a crash of the machine, since the file is not
    synced: one written in another boot is not trusted either.  Readers
    take the lock shared for the read, so they never see a batch's marker
    and fall back to listing only when the totals are really stale.  What
    makes them true again is the check after a restart
    (sluice.store._fs_check), which counts the tree without stopping the
    queue.

    Recipients per state come from the names (a control file's state is
    its directory, its recipients are in its name).  Messages: +1 per
    submission that has a control file at the batch's end (one removed
    again in the same batch never was a message; its content goes), -1
    per message whose content lost its last link in the batch (a content
    link per control file: the link count says when the last control file
    went).

STRATEGIES
    One small file rewritten in place (padded, one pwrite, no fsync): two
    writes of 512 bytes per batch beside the batch's own fsyncs.

SEE ALSO
    sluice.store._fs_commit (the batch that keeps them),
    sluice.store._fs_check (the recount), sluice.store._fs_reading (count)
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sluice.model import QueueState
from sluice.store._fs_files import Name, parse_name, state_of

if TYPE_CHECKING:
    from sluice.store._fs_batch import Batch, Effects

SIZE = 512


@functools.cache
def boot_id() -> str:
    """This boot of the machine ("" where the system does not say)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@dataclass(slots=True)
class Tally:
    """The totals in ``counts``: recipients per state, messages."""

    by_state: dict[QueueState, int] = field(
        default_factory=lambda: dict.fromkeys(QueueState, 0))
    messages: int = 0
    seq: int = 0
    ok: bool = False
    boot: str = ""

    @property
    def trusted(self) -> bool:
        """Kept by whole batches since it was last counted, in this boot."""
        return self.ok and self.boot == boot_id()

    def dump(self) -> bytes:
        doc = {"v": 1, "ok": self.ok, "boot": self.boot, "seq": self.seq,
               "messages": self.messages, **{str(s): n for s, n in self.by_state.items()}}
        data = json.dumps(doc, separators=(",", ":")).encode()
        return data.ljust(SIZE - 1) + b"\n"

    @classmethod
    def load(cls, data: bytes) -> Tally:
        try:
            doc = json.loads(data)
            return cls({s: int(doc[str(s)]) for s in QueueState}, int(doc["messages"]),
                       int(doc["seq"]), doc["ok"] is True, str(doc["boot"]))
        except (ValueError, KeyError, TypeError):
            return cls()  # missing or torn: not trusted, counted again


class CountsFile:
    """``counts`` under a queue's root."""

    def __init__(self, root: Path) -> None:
        self.path = root / "counts"
        self.lock_path = root / "lock"

    def load(self) -> Tally:
        """The totals as stored (the caller holds the queue's lock)."""
        try:
            return Tally.load(self.path.read_bytes())
        except FileNotFoundError:
            return Tally()

    def store(self, tally: Tally) -> None:
        """Store the totals (the caller holds the queue's lock).

        Stamped with this boot; totals loaded from another boot stay
        untrusted (a batch or a replay does not make stale totals true).
        """
        if tally.boot and tally.boot != boot_id():
            tally.ok = False
        tally.boot = boot_id()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o640)
        try:
            os.pwrite(fd, tally.dump(), 0)
        finally:
            os.close(fd)

    def trusted(self) -> Tally | None:
        """The totals if they can be trusted, read under the queue's lock shared.

        Never call this holding the store's read lock: the committer holds
        the queue's lock while it waits for that.
        """
        try:
            fd = os.open(self.lock_path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            with contextlib.suppress(FileNotFoundError):
                tally = Tally.load(self.path.read_bytes())
                return tally if tally.trusted else None
            return None
        finally:
            os.close(fd)  # and with it the lock


def changed_files(view: Batch, fx: Effects) -> list[tuple[str, int]]:
    """The control files a batch adds (+1) and takes away (-1), by relative path.

    A file rewritten under its own name (same directory, same recipients)
    changes nothing.
    """
    out = [(final, 1) for _, final in fx.creates if final not in view.disk_gen]
    for src, dst in fx.moves:
        out += [(src, -1), (dst, 1)]
    out += [(path, -1) for path, _ in fx.unlinks]
    return out


def name_of(path: str) -> Name | None:
    return parse_name(path.rsplit("/", 1)[1])


def add_changes(tally: Tally, changes: Iterable[tuple[str, int]]) -> None:
    """Recipients per state after ``changes`` (see changed_files)."""
    for path, sign in changes:
        parsed = name_of(path)
        if parsed is not None:
            tally.by_state[state_of(path)] += sign * parsed.n
