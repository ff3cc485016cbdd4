"""The filesystem flavour's check after a restart: content links reconciled, totals recounted.

SUMMARY
    Checking, a part of FsStore: start_check(now) runs check(now) on a
    thread of its own; wait_check() waits for it.  Watch: what the
    committer records while a check lists the tree.

DESCRIPTION
    A crash can leave a content link without its control file (or, from
    an older version, the other way round), content nothing links to, and
    totals in ``counts`` that a batch cut short left untrusted.  The check
    lists every control file and walks the spool once, then, in one
    operation of the committer: puts a link where a control file has
    none, removes links without a control file and content without
    either (once older than ORPHAN_AGE_S: it may be a submission in
    flight), and stores the totals it counted.

STRATEGIES
    Off the critical path.  The listing runs on the check's own thread
    while the queue takes and delivers mail; only the last step is an
    operation of the committer, and it reads no directory and looks only
    at the messages the listing found wrong (found on the check's thread,
    Listing.settle) and those the batches changed meanwhile: at a million
    messages, the walk over all of them held every commit for 2.2 s.  So that a
    listing made while batches change the tree still adds up, the
    committer records what its batches change (Watch) from the moment
    the check starts:

    - each directory is listed under the store's read lock, which the
      committer's renames wait for, and the check notes how many changes
      were recorded when it did: the directory as listed plus the changes
      recorded after that are the directory at the end;
    - a message's control files and its links are kept as a sum of
      ``1 << first index``: added and taken away in any order, the sum at
      the end is that of the files there are;
    - links are walked without a lock: a link a batch added or dropped
      meanwhile counts as the batch left it.

    A batch of another process (the sequence number in ``counts`` moved
    more than this process's batches), a journal replayed, a batch that
    failed midway or a failed batch that held one of the check's own steps
    (a batch fails as a whole) spoils the listing: the check starts again,
    three times at most, and otherwise leaves the totals untrusted until
    the next start.  A directory is listed whole under the read lock: about a
    second for a million files in one directory.

SEE ALSO
    sluice.store._fs_counts (the totals), sluice.store._fs_recovery
    (recover() starts the check), sluice.store._fs_commit (the batches)
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sluice.model import QueueState
from sluice.store import ORPHAN_AGE_S, StorageError
from sluice.store._fs_commit import Committing
from sluice.store._fs_counts import Tally
from sluice.store._fs_files import REF_RE, parse_name, scandir, state_of

if TYPE_CHECKING:
    from sluice.store._fs_batch import Batch

log = logging.getLogger(__name__)

#: Listings a check tries before it gives up until the next start.
ATTEMPTS = 3


@dataclass(slots=True)
class Watch:
    """What this process's batches changed while a check lists the tree."""

    seq0: int  # counts' sequence number when the check started
    dirs: list[str]  # the state directories then
    events: list[tuple[str, str, int]] = field(default_factory=list)  # (dir, name, +-1)
    marks: dict[str, int] = field(default_factory=dict)  # dir -> len(events) at its listing
    refs: dict[tuple[str, int], bool] = field(default_factory=dict)  # link -> there at the end
    batches: int = 0  # counting batches of this process since seq0
    spoiled: bool = False

    def record(self, changes: list[tuple[str, int]]) -> None:
        """Control files a batch added (+1) or took away (-1) (under the write lock)."""
        for path, sign in changes:
            rel_dir, name = path.rsplit("/", 1)
            self.events.append((rel_dir, name, sign))

    def record_links(self, links: set[tuple[str, int]], there: bool) -> None:
        for link in links:
            self.refs[link] = there


def bits(mask: int) -> Iterator[int]:
    """The first indexes in a sum of ``1 << first index``."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


@dataclass(slots=True)
class Listing:
    """The control files and links a check found, as sums per message."""

    by_state: dict[QueueState, int] = field(default_factory=lambda: dict.fromkeys(QueueState, 0))
    controls: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    links: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    content: set[str] = field(default_factory=set)
    #: Filled by settle(): messages whose links or content need fixing, and
    #: how many messages have a control file.
    suspects: set[str] = field(default_factory=set)
    messages: int = 0

    def settle(self) -> None:
        """Find what needs fixing, on the check's thread, before the committer's step.

        The step then looks only at these and at the messages the batches
        changed meanwhile: at a million messages, a walk over all of them
        under the queue's lock held every process's commits for seconds.
        """
        controls, links, content = self.controls, self.links, self.content
        self.suspects = {spid for spid in controls.keys() | links.keys() | content
                         if controls.get(spid, 0) != links.get(spid, 0)
                         or (not controls.get(spid, 0) and spid in content)}
        self.messages = sum(1 for mask in controls.values() if mask)


class Checking(Committing):
    """The check of FsStore (a mixin over the commit machinery)."""

    _check_thread: threading.Thread | None
    _stopping: threading.Event  # set by close(): the check gives up
    _check_lock: threading.Lock
    _check_again: bool

    def start_check(self) -> None:
        """Check the tree on a thread of its own (see the module doc).

        One check at a time: asked again while one runs, it runs once more.
        """
        with self._check_lock:
            self._check_again = True
            if self._check_thread is not None and self._check_thread.is_alive():
                return
            thread = threading.Thread(target=self._check_quietly, name="sluice-fs-check",
                                      daemon=True)
            self._check_thread = thread
            thread.start()

    def wait_check(self, timeout: float | None = None) -> bool:
        """Wait for the check recover() started; whether it has finished."""
        thread = self._check_thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def _check_quietly(self) -> None:
        while True:
            with self._check_lock:
                if not self._check_again or self._stopping.is_set():
                    return
                self._check_again = False
            self._check_once()

    def _check_once(self) -> None:
        try:
            if not self.check() and not self._stopping.is_set():
                log.warning("the queue at %s changed under every check; its totals are "
                            "counted from the tree until the next start", self.root)
        except StorageError as exc:
            if not self._stopping.is_set():
                log.warning("checking the queue at %s failed: %s", self.root, exc)
        except Exception:  # a thread of its own: say why, do not take serve down
            log.exception("checking the queue at %s failed", self.root)

    def check(self) -> bool:
        """List the tree and fix it up (see the module doc); whether it got through."""
        for _ in range(ATTEMPTS):
            try:
                watch: Watch = self._call(self._watch_start)
                found = self._list_tree(watch)
                if found is None:
                    return False  # closed
                found.settle()
                done: bool = self._call(functools.partial(self._watch_end, watch, found))
            except StorageError as exc:
                # A batch fails as a whole: one the check's step shared, or
                # one of its own.  The committer reads the watch once a batch.
                if self._stopping.is_set():
                    raise
                log.warning("checking the queue at %s: %s; listing again", self.root, exc)
                done = False
            finally:
                self._watch = None
            if done:
                return True
        return False

    def _watch_start(self, view: Batch) -> Watch:
        dirs = self._all_dirs()
        self._watch = Watch(self._counts.load().seq, dirs)
        return self._watch

    def _list_tree(self, watch: Watch) -> Listing | None:
        found = Listing()
        for rel_dir in watch.dirs:
            if self._stopping.is_set():
                return None
            state = state_of(rel_dir)
            n = 0
            with self._rw.reading():
                watch.marks[rel_dir] = len(watch.events)
                for name in scandir(self.root / rel_dir):
                    # A million names: not through parse_name's cache.
                    parsed = parse_name.__wrapped__(name)
                    if parsed is not None:
                        n += parsed.n
                        found.controls[parsed.spid] += 1 << parsed.idx0
            found.by_state[state] += n
        stack = [self.spool.root]
        while stack:
            if self._stopping.is_set():
                return None
            top = stack.pop()
            try:
                with os.scandir(top) as it:
                    for entry in it:
                        name = entry.name
                        if name.endswith(".msg"):
                            found.content.add(name[:-4])
                        elif name.endswith(".ref"):
                            m = REF_RE.match(name)
                            if m:
                                found.links[m.group(1)] |= 1 << int(m.group(2))
                        elif entry.is_dir(follow_symlinks=False):
                            stack.append(Path(entry.path))
            except FileNotFoundError:
                continue
        return found

    def _watch_end(self, watch: Watch, found: Listing, view: Batch) -> bool:
        """Under the queue's lock: the tree as it is now, links fixed, totals stored."""
        self._watch = None
        tally = self._counts.load()
        if watch.spoiled or tally.seq != watch.seq0 + watch.batches:
            return False
        controls, links = found.controls, found.links
        had: dict[str, bool] = {}  # messages the batches changed: had a control file?
        for i, (rel_dir, name, sign) in enumerate(watch.events):
            parsed = parse_name(name)
            if parsed is None or i < watch.marks.get(rel_dir, 0):
                continue  # in the listing already
            found.by_state[state_of(rel_dir)] += sign * parsed.n
            had.setdefault(parsed.spid, bool(controls.get(parsed.spid, 0)))
            controls[parsed.spid] += sign << parsed.idx0
        for (spid, idx0), there in watch.refs.items():
            bit = 1 << idx0
            links[spid] = (links[spid] & ~bit) | (bit if there else 0)
        if any(controls[spid] < 0 for spid in had):
            return False  # cannot be: count again rather than trust it
        messages = found.messages + sum(bool(controls[spid]) - was for spid, was in had.items())
        self._fix_links(found, found.suspects | had.keys() | {s for s, _ in watch.refs})
        self._counts.store(Tally(found.by_state, messages, tally.seq, ok=True))
        return True

    def _fix_links(self, found: Listing, spids: set[str]) -> None:
        """Links equal control files; content without either goes once it is old.

        Of ``spids`` only: the others were found right (Listing.settle).
        Old by the files' own clock: content of a submission not yet
        committed (of this process or another) is seconds old.
        """
        controls, links, content = found.controls, found.links, found.content
        now = time.time()
        for spid in sorted(spids):
            want, have = controls.get(spid, 0), links.get(spid, 0)
            if want:
                for idx0 in bits(have & ~want):
                    self._drop_ref(spid, idx0)
                if spid in content:
                    for idx0 in bits(want & ~have):
                        with contextlib.suppress(FileNotFoundError):
                            self._add_ref(spid, idx0)
                continue
            if spid in content:
                try:
                    if now - os.stat(self.spool.path(spid)).st_mtime < ORPHAN_AGE_S:
                        continue  # maybe a submission of another process, not yet committed
                except FileNotFoundError:
                    pass
            for idx0 in bits(have):
                self._drop_ref(spid, idx0)
            if spid in content:
                with contextlib.suppress(FileNotFoundError):
                    self.spool.delete(spid)
