"""The filesystem flavour's commit: group commit, journals, content links, the change feed.

SUMMARY
    Committing, a part of FsStore: _op(work) queues an operation for the
    committer thread; _commit(batch) runs a batch under the queue's lock
    and makes it durable in the order sluice.store.fs gives.

DESCRIPTION
    One committer thread per process takes every operation that queued up
    and runs them against one Batch under an exclusive flock on ``lock``,
    so several processes may share the tree.  Then: temporary files and
    content links, fsynced in parallel with the batch's spool files and
    the change feed; the journal, the commit point of a batch that changes
    several files; renames into place; every directory touched; the
    journal removed, content that lost its last link deleted.  The next
    writer of any process replays a journal a crash left behind.

    Content lifetime by link count: every control file of a message has a
    hard link to the message's spool file; reconcile() (run by recover)
    makes the links equal the control files and removes orphaned content.

SEE ALSO
    sluice.store.fs (the layout and the order of a commit),
    sluice.store._commit (the group committer), sluice.store._fs_batch
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import itertools
import json
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice._fdio import write_all
from sluice.model import IN_FLIGHT_STATES, QueueState
from sluice.spool import SpoolFile
from sluice.spool.fs import FsSpool
from sluice.store import ORPHAN_AGE_S, StorageError
from sluice.store._commit import GroupCommitter, Op, RWLock, fsync_paths, in_parallel
from sluice.store._fs_batch import Batch, Effects
from sluice.store._fs_buckets import bucket_is_current, sorted_buckets
from sluice.store._fs_counts import CountsFile, add_changes, changed_files
from sluice.store._fs_files import (
    STATE_DIRS,
    Control,
    listdir,
    read_control,
    spid_of_name,
    unlink,
    write_file,
)

if TYPE_CHECKING:
    from sluice.store._fs_check import Watch

log = logging.getLogger(__name__)


def new_messages(view: Batch, fx: Effects) -> set[str]:
    """The batch's submissions that have a control file at its end (its content linked)."""
    return set(view.new_spids) & {spid for spid, _ in fx.ref_adds}


#: The state directories of entries in flight, whose files note_in_flight keeps.
IN_FLIGHT_DIRS = frozenset(STATE_DIRS[s] for s in IN_FLIGHT_STATES)
#: Past this many SPIDs the notes are dropped (only another process's moves leave stale ones).
IN_FLIGHT_NOTES_MAX = 100_000


def note_in_flight(notes: dict[str, set[str]], fx: Effects) -> None:
    """Keep ``notes`` (SPID -> its files in active/ and delivering/) up with a committed batch.

    The queue manager's outcomes and marks name entries in flight; their
    files are where this process's own claims and marks put them, so a
    batch reads those (Batch.locate_known) instead of listing a directory
    of up to ``maxmemoryqueue`` files.  A note is only a hint: a file
    another process moved is looked for by listing.
    """
    if len(notes) > IN_FLIGHT_NOTES_MAX:
        notes.clear()
    for path in itertools.chain((src for src, _ in fx.moves), (rel for rel, _ in fx.unlinks)):
        rel_dir, name = path.rsplit("/", 1)
        spid = spid_of_name(name) if rel_dir in IN_FLIGHT_DIRS else None
        if spid is not None and (paths := notes.get(spid)) is not None:
            paths.discard(path)
            if not paths:
                del notes[spid]
    for ctrl, path in fx.creates:
        if path.rsplit("/", 1)[0] in IN_FLIGHT_DIRS:
            notes.setdefault(ctrl.spid, set()).add(path)
    for _, path in fx.moves:
        rel_dir, name = path.rsplit("/", 1)
        if rel_dir in IN_FLIGHT_DIRS and (spid := spid_of_name(name)) is not None:
            notes.setdefault(spid, set()).add(path)


class LateFailure(OSError):
    """A commit failed after its first changes may have become visible."""


class Committing:
    """The commit machinery of FsStore (a mixin: FsStore sets the attributes)."""

    root: Path
    spool: FsSpool
    _rw: RWLock
    _closed: bool
    _lock_fd: int
    _committer: GroupCommitter
    _batch_no: itertools.count[int]
    _seq_cache: tuple[int, int]
    _counts: CountsFile
    _watch: Watch | None  # while a check lists the tree (sluice.store._fs_check)
    _in_flight: dict[str, set[str]]  # SPID -> paths in active/ and delivering/ (note_in_flight)

    if TYPE_CHECKING:  # Layout's, through FsStore
        def dir_for(self, ctrl: Control) -> str: ...

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        except OSError as exc:
            raise StorageError(f"cannot lock the queue at {self.root}: {exc}") from exc
        try:
            self._replay_journals()
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _clean_tmp(self, now: float) -> None:
        """Remove temporary files of batches that never reached their commit point.

        Only old ones: submitters of any process write theirs before they
        queue for the lock.
        """
        for name in listdir(self.root / "tmp"):
            path = self.root / "tmp" / name
            with contextlib.suppress(OSError):
                if path.stat().st_mtime < now - ORPHAN_AGE_S:
                    unlink(path)

    def _write_small(self, path: Path, text: str) -> None:
        tmp = self.root / "tmp" / f"{path.name}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_paths([str(path.parent)])

    # -- journals -------------------------------------------------------------------------

    def _replay_journals(self) -> None:
        names = listdir(self.root / "journal")
        if not names:
            return
        for name in sorted(names):
            path = self.root / "journal" / name
            try:
                lines = path.read_text().splitlines()
            except FileNotFoundError:
                continue
            if not lines or lines[-1] != "END":
                unlink(path)  # torn: the batch never reached its commit point
                continue
            dirs: set[str] = set()
            for line in lines[:-1]:
                item = json.loads(line)
                if "c" in item:
                    tmp, final = item["c"]
                    if (self.root / tmp).exists():
                        (self.root / final).parent.mkdir(parents=True, exist_ok=True)
                        os.rename(self.root / tmp, self.root / final)
                        dirs.add(str((self.root / final).parent))
                elif "u" in item:
                    rel, gen = item["u"]
                    ctrl = read_control(self.root, rel)
                    if ctrl is not None and ctrl.gen == gen:
                        unlink(self.root / rel)
                        dirs.add(str((self.root / rel).parent))
            dirs.add(str(self.root / "deferred"))
            fsync_paths(dirs)
            unlink(path)
        fsync_paths([str(self.root / "journal")])
        self._moved_outside_batches()

    def _moved_outside_batches(self) -> None:
        """Files moved other than by a batch (under the lock): a check's listing is spoiled."""
        tally = self._counts.load()
        tally.seq += 1
        self._counts.store(tally)

    # -- the committer --------------------------------------------------------------------

    def _op(self, work: Callable[[Batch], Any], files: Sequence[SpoolFile] = (),
            prepared: Sequence[str] = ()) -> concurrent.futures.Future[Any]:
        if self._closed:
            raise StorageError("the store is closed")
        return self._committer.submit(work, files, extra=list(prepared))

    def _call(self, work: Callable[[Batch], Any]) -> Any:
        return self._op(work).result()

    def _commit(self, batch: list[Op]) -> None:
        try:
            with self._locked():
                self._commit_locked(batch)
        except StorageError as exc:
            self._fail(batch, exc)
        except OSError as exc:
            self._fail(batch, StorageError(f"queue commit failed: {exc}"))

    def _dropped(self, op: Op) -> None:
        """A submission cancelled before its batch: forget what it wrote."""
        for f in op.files:
            self.spool.discard(f)
        for tmp in op.extra or ():
            unlink(self.root / tmp)

    def _fail(self, batch: Sequence[Op], err: BaseException) -> None:
        for op in batch:
            if not op.future.done():
                for f in op.files:
                    self.spool.discard(f)
                for tmp in op.extra or ():
                    unlink(self.root / tmp)
                op.future.set_exception(err)

    def _commit_locked(self, batch: list[Op]) -> None:
        view = Batch(self)
        results: list[tuple[Op, Any, BaseException | None]] = []
        for op in batch:
            mark = view.begin()
            try:
                value = op.work(view)
            except Exception as exc:
                view.rollback(mark)
                results.append((op, None, exc))
            else:
                view.end()
                results.append((op, value, None))
        failed = [op for op, _, failure in results if failure is not None]
        fx = view.effects()
        files = [f for op in batch if op not in failed for f in op.files]
        try:
            self._durable(view, fx, files)
        except LateFailure as exc:
            # Some of the batch may be in place (or will be, by its journal):
            # keep every spool file; recover() removes the ones nobody uses.
            self._in_flight.clear()
            err = StorageError(f"queue commit failed: {exc.__cause__ or exc}")
            for op in batch:
                if not op.future.done():
                    op.future.set_exception(err)
            return
        except OSError as exc:
            self._in_flight.clear()
            err = StorageError(f"queue commit failed: {exc.strerror or exc}")
            self._fail(batch, err)
            return
        note_in_flight(self._in_flight, fx)
        for op in failed:
            for f in op.files:
                self.spool.discard(f)
        # A message submitted and removed again within the batch: no control
        # file ever linked its content.
        unused = set(view.new_spids) - new_messages(view, fx)
        if unused:
            self.spool.delete_soon(sorted(unused))
        # Files submitters wrote that the batch did not use (failed, or changed
        # again within the batch).
        used = {ctrl.prepared for ctrl, _ in fx.creates if ctrl.prepared}
        in_parallel(unlink, [self.root / tmp for op in batch for tmp in op.extra or ()
                              if tmp not in used])
        for op, value, failure in results:
            if failure is None:
                op.future.set_result(value)
            else:
                op.future.set_exception(failure)

    def _durable(self, view: Batch, fx: Effects, files: list[SpoolFile]) -> None:
        """Make the batch's effects durable, in the order the module doc gives."""
        root = self.root
        batch_id = f"{os.getpid()}.{next(self._batch_no)}"
        # Read once: the check's thread may drop it meanwhile (sluice.store._fs_check).
        watch = self._watch
        temps: list[tuple[str, str]] = []
        written: list[str] = []
        # The totals are not to be trusted from here until the batch is in
        # place: even its links (step 1) may outlive a batch cut short.  The
        # sequence number moves now, so that a batch killed midway spoils a
        # check's listing in any process (sluice.store._fs_check).
        tally = self._counts.load() if fx else None
        trusted = tally is not None and tally.trusted
        if tally is not None:
            tally.ok = False
            tally.seq += 1
            self._counts.store(tally)
            if watch is not None:
                watch.batches += 1
        journal: Path | None = None
        try:
            # 1. Temporary files (submitters wrote theirs already; the rest are
            #    written together), content links, change feed; one fsync round.
            todo: list[tuple[Path, bytes]] = []
            for k, (ctrl, final) in enumerate(fx.creates):
                if ctrl.prepared:
                    temps.append((ctrl.prepared, final))
                    continue
                tmp = f"tmp/{batch_id}.{k}.tmp"
                todo.append((root / tmp, ctrl.dump()))
                written.append(tmp)
                temps.append((tmp, final))
            in_parallel(lambda job: write_file(*job), todo)
            sync: list[str] = [str(root / t) for t, _ in temps]
            if temps:
                sync.append(str(root / "tmp"))
            in_parallel(lambda ref: self._add_ref(*ref), sorted(fx.ref_adds))
            sync += sorted({str(self.spool.directory(spid)) for spid, _ in fx.ref_adds})
            if view.changes:
                sync.append(self._append_changes(view.changes))
            if files:
                fsync_paths(sync, also=lambda: self.spool.sync(files))
            elif sync:
                fsync_paths(sync)
            if watch is not None:
                watch.record_links(fx.ref_adds, True)
            if not fx and not view.after:
                return
            # 2. The journal: the commit point of a batch that changes several files.
            if view.needs_journal and (len(fx.creates) + len(fx.unlinks)) >= 2:
                journal = root / "journal" / f"{batch_id}.jnl"
                lines = [json.dumps({"c": [t, f]}) for t, f in temps]
                lines += [json.dumps({"u": [p, g]}) for p, g in fx.unlinks]
                write_file(journal, ("\n".join([*lines, "END"]) + "\n").encode())
                fsync_paths([str(journal), str(root / "journal")])
        except OSError:
            # The batch fails: its journal first, or the next writer would
            # replay its removals without the creations (their files go next).
            if journal is not None:
                unlink(journal)
            for tmp in written:
                unlink(root / tmp)
            for ctrl, _ in fx.creates:
                if ctrl.prepared:
                    unlink(root / ctrl.prepared)
            # Links of control files that never come (the totals stay untrusted).
            in_parallel(lambda ref: self._drop_ref(*ref), sorted(fx.ref_adds))
            if watch is not None:
                watch.record_links(fx.ref_adds, False)
            raise
        changes = changed_files(view, fx)
        try:
            gone = self._into_place(view, fx, temps, journal, changes, watch)
        except Exception as exc:
            if watch is not None:
                watch.spoiled = True
            raise LateFailure(str(exc)) from exc
        if tally is not None and trusted:
            add_changes(tally, changes)
            tally.messages += len(new_messages(view, fx)) - gone
            tally.ok = True
            # The batch is in place: failing here only leaves the totals
            # untrusted, not the batch undone; said, not raised.
            try:
                self._counts.store(tally)
            except OSError as exc:
                log.warning("cannot store the totals in %s (untrusted until the next "
                            "check): %s", self._counts.path, exc)

    def _into_place(self, view: Batch, fx: Effects, temps: list[tuple[str, str]],
                    journal: Path | None, changes: list[tuple[str, int]],
                    watch: Watch | None) -> int:
        """Steps 3 to 5; returns how many messages lost their last control file."""
        root = self.root
        # 3. Into place.  Readers of this process wait; other processes see files move.
        dirs: set[str] = set()
        renames = [(root / tmp, root / final) for tmp, final in temps]
        renames += [(root / src, root / dst) for src, dst in fx.moves]
        with self._rw.writing():
            for target_dir in {dst.parent for _, dst in renames}:
                if not target_dir.is_dir():
                    target_dir.mkdir(parents=True, exist_ok=True)
                    dirs.add(str(target_dir.parent))
            # Independent renames: issued together, they share journal commits.
            in_parallel(lambda pair: os.rename(*pair), renames)
            in_parallel(unlink, [root / rel for rel, _ in fx.unlinks])
            if watch is not None:
                watch.record(changes)
        dirs.update(str(dst.parent) for _, dst in renames)
        dirs.update(str(src.parent) for src, _ in renames[len(temps):])
        dirs.update(str((root / rel).parent) for rel, _ in fx.unlinks)
        # 4. Every directory touched.
        fsync_paths(dirs)
        # 5. Done: the journal may go; so may links and content of what left.
        if journal is not None:
            unlink(journal)
        gone: list[str] = []
        with self._rw.writing():
            in_parallel(lambda ref: self._drop_ref(*ref), sorted(fx.ref_drops))
            if watch is not None:
                watch.record_links(fx.ref_drops, False)
            def drop(spid: str) -> None:
                if self._drop_if_unused(spid):
                    gone.append(spid)

            in_parallel(drop, sorted({spid for spid, _ in fx.ref_drops}))
            left = {rel.rsplit("/", 1)[0] for rel, _ in fx.unlinks}
            left |= {src.rsplit("/", 1)[0] for src, _ in fx.moves}
            for rel_dir in left:
                # Emptied: a deferred/<T> goes, an incoming bucket once no
                # new mail arrives in it.
                if rel_dir.startswith("deferred/") or (
                        rel_dir.startswith("incoming/")
                        and not bucket_is_current(rel_dir.split("/")[1])):
                    with contextlib.suppress(OSError):
                        os.rmdir(root / rel_dir)
            for hook in view.after:
                hook()
        return len(gone)

    def _drop_if_unused(self, spid: str) -> bool:
        """Delete a message's content once no control file links to it; whether it did."""
        try:
            links = os.stat(self.spool.path(spid)).st_nlink
        except FileNotFoundError:
            return False
        if links <= 1:
            # Nothing links to it any more, so nothing can again: the unlink
            # itself may come a moment later, on the spool's own thread.
            self.spool.delete_soon([spid])
            return True
        return False

    def _drop_ref(self, spid: str, idx0: int) -> None:
        unlink(self.spool.directory(spid) / f"{spid}-{idx0}.ref")

    def _add_ref(self, spid: str, idx0: int) -> None:
        ref = self.spool.directory(spid) / f"{spid}-{idx0}.ref"
        with contextlib.suppress(FileExistsError):
            os.link(self.spool.path(spid), ref)

    def _append_changes(self, changes: list[tuple[float, str, str]]) -> str:
        path = self.root / "changes.log"
        seq = self._last_seq()
        lines = []
        for at, qid, action in changes:
            seq += 1
            lines.append(f"{seq}\t{at!r}\t{qid}\t{action}\n")
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
        try:
            size = os.fstat(fd).st_size
            prefix = ""
            if size:
                with open(path, "rb") as f:
                    f.seek(size - 1)
                    if f.read(1) != b"\n":
                        prefix = "\n"  # a torn last line from a crash
            data = (prefix + "".join(lines)).encode()
            write_all(fd, data)
            self._seq_cache = (size + len(data), seq)
        finally:
            os.close(fd)
        return str(path)

    def _last_seq(self) -> int:
        path = self.root / "changes.log"
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return 0
        if size == self._seq_cache[0]:
            return self._seq_cache[1]
        with open(path, "rb") as f:
            f.seek(max(0, size - 4096))
            tail = f.read().decode("utf-8", "replace").splitlines()
        seq = 0
        for line in reversed(tail):
            parts = line.split("\t")
            if len(parts) == 4 and parts[0].isdigit():
                seq = int(parts[0])
                break
        self._seq_cache = (size, seq)
        return seq

    def _all_dirs(self) -> list[str]:
        out = [d for s, d in STATE_DIRS.items()
               if s not in (QueueState.DEFERRED, QueueState.INCOMING)]
        out += [f"deferred/{t}" for t in listdir(self.root / "deferred") if t.isdigit()]
        out += [f"incoming/{b}" for b in sorted_buckets(listdir(self.root / "incoming"))]
        return out

