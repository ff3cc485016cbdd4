"""The filesystem flavour's recovery: what a restart puts back in the queue.

SUMMARY
    Recovering, a part of FsStore: recover(now) moves the active and
    delivering control files back to deferred, due now, then prunes the
    change feed, cleans tmp/ and reconciles content links.

DESCRIPTION
    After a stop or a crash no delivery of this process is in flight, so
    every file left in active/ or delivering/ goes back to deferred/T with
    its recipients due at once (an entry that was delivering is logged by
    the queue manager as "in flight at crash").  The change feed keeps
    CHANGES_KEEP_S of operator changes; temporary files of batches that
    never reached their commit point, and content no control file links
    to, are removed once old enough (sluice.store._fs_commit).

STRATEGIES
    In commits of RECOVER_BATCH files.  A receiver's commit waits for one
    of them, not for the whole active queue to be rewritten, so a queue of
    a million answers 250 within seconds of a restart.

SEE ALSO
    sluice.store.fs (the store), sluice.store._fs_commit (the commit)
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import TYPE_CHECKING

from sluice.model import QueueState
from sluice.store import CHANGES_KEEP_S
from sluice.store._fs_batch import Batch, copy_control
from sluice.store._fs_check import Checking
from sluice.store._fs_files import STATE_DIRS

#: Control files recover() returns to the queue per commit.
RECOVER_BATCH = 256


class Recovering(Checking):
    """FsStore's recover() (a mixin over the commit machinery)."""

    if TYPE_CHECKING:  # Layout's
        def due_now(self, now: float) -> float: ...

    def recover(self, now: float) -> int:
        """Store.recover: active and delivering control files back to deferred, due now.

        Due at the retry grid line at or before ``now`` (due_now), in a
        directory a refill takes by name.

        Then prunes the change feed, cleans tmp/ and removes orphaned content.
        """
        # In commits of RECOVER_BATCH files: a receiver's commit waits for
        # one of them, not for the whole active queue to be rewritten.
        due = self.due_now(now)  # a directory already due: no file read for its time

        def work(view: Batch) -> tuple[int, bool]:
            moved = files = 0
            for state in (QueueState.ACTIVE, QueueState.DELIVERING):
                for name, _ in view.names(STATE_DIRS[state]):
                    if files >= RECOVER_BATCH:
                        return moved, True
                    ctrl = view.load(f"{STATE_DIRS[state]}/{name}")
                    if ctrl is None:
                        continue
                    new = replace(copy_control(ctrl), state=QueueState.DEFERRED,
                                  next_at=due, gen="", path="")
                    view.swap([ctrl], [new])
                    moved += len(ctrl.rcpts)
                    files += 1
            view.after.append(lambda: self._prune_changes(now))
            view.after.append(lambda: self._clean_tmp(now))
            return moved, False

        total, more = 0, True
        while more:
            moved, more = self._call(work)
            total += moved
        # Content links and totals: checked while the queue works.
        self.start_check()
        return total

    def _prune_changes(self, now: float) -> None:
        path = self.root / "changes.log"
        try:
            lines = path.read_text("utf-8", "replace").splitlines()
        except FileNotFoundError:
            return
        keep = []
        for line in lines:
            parts = line.split("\t")
            if len(parts) == 4 and parts[0].isdigit():
                with contextlib.suppress(ValueError):
                    if float(parts[1]) >= now - CHANGES_KEEP_S:
                        keep.append(line)
        if len(keep) == len(lines):
            return
        if not keep and lines:
            # Keep the last line so that sequence numbers never go back.
            keep = [line for line in lines if line.split("\t")[0].isdigit()][-1:]
        self._write_small(path, "".join(f"{line}\n" for line in keep))
        self._seq_cache = (-1, 0)
