"""Mailismus's filesystem meta queue (FilesysQueue): control files in state directories.

SUMMARY
    FsStore(path, spool, granularity_s=...) implements sluice.store.Store
    with control files under ``queue.path`` and content in the FsSpool.

DESCRIPTION
    Layout (Mailismus section 4.3.2, plus the states Sluice adds):

    incoming/<bucket>/    accepted, not yet tried; the bucket is named by
                          priority, the SPID's first 8 digits (4.1 s of
                          arrival) and the tenant, so a refill lists the
                          first buckets only (sluice.store._fs_buckets)
    deferred/<T>/         waiting for a retry; T is the due time in epoch
                          seconds rounded up by ``retry_granularity``, so
                          deferred mail clusters in few directories
    bounces/              failed for good, waiting for the NDR
    hold/                 on hold (Halon), ignored until released
    active/               claimed by the queue manager, in memory
    delivering/           a delivery attempt is in flight
    tmp/, journal/        control files being written; batch journals
    changes.log           the operator change feed, one line per change
    layout.json           the layout's version (2: incoming/ in buckets) and
                          the granularity the deferred tree is filed by
    lock                  writers of all processes take it (flock)

    A control file holds the recipients of one message for one destination
    domain (Mailismus aggregates them so), all in the same state, with the
    same next attempt time and priority.  Its name carries the SPID and the
    domain: ``<SPID>-<first index>+<recipients>p<priority>@<domain>.mmq``,
    e.g. ``018C2F3A1B7E4D20-0+3p0@example.net.mmq``: the first part is the
    queue id of its first recipient.  The content is one JSON object: the
    message's envelope and queue fields, and per recipient its index,
    address, attempts and last reply.  When recipients of one file part
    ways (one delivered, one deferred), the file is split, so that a
    file's directory is always the state of all its recipients.

    Listing walks the tree.  Counting (qcount) reads directory names only:
    the state is the directory and the recipient count is in the name, so
    it costs one readdir per directory and no file reads; selections by
    sender, tenant, job or transport, qshape and expiry read the files.

STRATEGIES
    Group commit.  One committer thread per process takes every operation
    that queued up and runs them under an exclusive flock on ``lock`` (so
    several processes may share the queue, as with SQLite).  Operations see
    each other's changes through an overlay of the batch's files.  Then:
    (1) new control files are in tmp/ -- a submitter writes its own, like
    its content, before it queues; the committer writes the others, all at
    once -- and are fsynced in parallel with the batch's spool files and
    the change feed; (2) if any operation
    changes more than one file (a split, a rewrite into another directory,
    a message for several domains), a journal of the batch's creations and
    removals is written and fsynced -- the commit point; (3) files are
    renamed into place, moved and removed; (4) every directory touched is
    fsynced; (5) the journal is removed.  A batch of claims is only
    renames.  A crash before (2) leaves temporary files that recover()
    removes once they are an hour old; after it, the next writer (any
    process) replays the
    journal before doing anything else.  Replay is idempotent and a stale
    journal is harmless: a temporary file is renamed only if it still
    exists, a removal happens only if the file still has the generation the
    journal names.

    Claims are renames (incoming/B/F -> active/F) done under the lock, so two
    processes never claim the same file; a file larger than what is left of
    the claim's limit is split.

    Content lifetime by link count.  Every control file of a message has a
    hard link ``<SPID>-<first index>.ref`` to the message's spool file,
    created and synced before the control file is.  When a control file
    goes, its link goes right after the commit (before the next batch: a
    later batch may link the same name again), and when the spool file's
    link count drops to one, the content is deleted -- on the spool's own
    thread, since nothing can link to it any more.  So content is never
    deleted while a control file exists, in any process; a crash can only
    leave an extra link, which recover() reconciles.

    Due times: a deferred file is filed under T = the next attempt time
    rounded up, so everything in deferred/T is due by T.  A refill takes
    all of the directories with T <= now and reads the files of the one
    directory whose window (T - granularity, T] contains now.

INVARIANTS
    Every recipient is in exactly one control file; a file's directory is
    its recipients' state.  Names of live control files of one message
    differ by their first index.  Content exists while a control file of
    its message exists.

LIMITATIONS
    Listing, get() of one queue id and selections by envelope fields walk
    the whole tree (Mailismus leaves listing to the operator's tools for
    this reason).  In-process readers see whole batches; a reader in
    another process may see a file between two directories while a batch
    is being applied.  Every process that shares the tree should use the
    same retry_granularity: the tree is re-filed when it changes.

PARTS
    This file keeps the store's operations; the nouns they use are in
    _fs_files (a control file: name, format, read, write), _fs_layout (the
    directory of a file, layout.json), _fs_batch (the overlay one batch
    works on), _fs_commit (group commit, journals, content links, the
    change feed), _fs_refill (which files a claim takes), _fs_due (due
    times in the window, kept by stamp), _fs_recovery (what a restart puts
    back) and _fs_reading (listing, counting, qshape, expiry, the feed's
    reader).

SEE ALSO
    sluice.store (the interface), sluice.store._actions (operator
    actions), sluice.spool.fs, seeds/000 section 4.3.2, docs/storage.md.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import os
import threading
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from sluice.model import (
    IN_FLIGHT_STATES,
    Accepted,
    QueueEntry,
    QueueState,
    Reply,
    Selector,
    Submission,
    format_qid,
    parse_qid,
    recipient_domain,
)
from sluice.retry import RetryPolicy
from sluice.spool import Content, SpoolIOError
from sluice.spool.fs import FsSpool
from sluice.store import Action, ApplyByFuture, StorageError, Transition, applied_nothing
from sluice.store._actions import OperatorChange
from sluice.store._commit import GroupCommitter, RWLock, fsync_paths
from sluice.store._fs_batch import Batch, copy_control, recs_of, regroup
from sluice.store._fs_check import Watch
from sluice.store._fs_counts import CountsFile, Tally
from sluice.store._fs_due import DueTimes
from sluice.store._fs_files import (
    STATE_DIRS,
    Control,
    Meta,
    NameFilter,
    Rcpt,
    new_gen,
    unlink,
    write_file,
)
from sluice.store._fs_layout import Layout
from sluice.store._fs_oldest import OldestSpids
from sluice.store._fs_reading import Reading
from sluice.store._fs_recovery import Recovering
from sluice.store._fs_refill import Refilling
from sluice.store._refill import (
    TenantMemo,
    TenantWeights,
)

if TYPE_CHECKING:
    from sluice.config import Config

__all__ = ["FsStore"]


class FsStore(ApplyByFuture, Layout, Refilling, Recovering, Reading):
    """Mailismus-style control files with a filesystem spool; see the module doc."""

    flavour = "fs"
    shared_access = True
    inline_max = 0  # content always goes to a spool file
    def __init__(self, path: str | os.PathLike[str], spool: FsSpool, *,
                 granularity_s: float = 900.0, node_id: str = "local",
                 max_batch: int = 2000) -> None:
        self.root = Path(path)
        self.spool = spool
        self.node_id = node_id
        self._policy = RetryPolicy(delays_s=(max(2 * granularity_s, 1.0),),
                                   granularity_s=granularity_s)
        self.granularity_s = self._policy.granularity_s
        self._rw = RWLock()
        self._closed = False
        self._counts = CountsFile(self.root)
        self._watch: Watch | None = None
        self._check_thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._check_lock = threading.Lock()
        self._check_again = False
        self._batch_no = itertools.count()
        self._seq_cache: tuple[int, int] = (-1, 0)  # (changes.log size, last seq)
        #: Where this process last put each SPID's files in flight (_commit_locked).
        self._in_flight: dict[str, set[str]] = {}
        self._tenants = TenantMemo()  # SPID -> tenant, for refills
        self._due_times = DueTimes()  # of directories not wholly due: refills, due_at()
        self._oldest = OldestSpids()  # the smallest SPID of each directory, for oldest()
        # Where the last changes_since() answer ended: (file, seq, offset).
        self._feed_cursor: tuple[tuple[int, int], int, int] = ((0, 0), -1, 0)
        try:
            created = not self.root.exists()
            # No state directory yet: a new queue, whose totals are zero.
            fresh = not any((self.root / d).exists() for d in STATE_DIRS.values())
            self.root.mkdir(parents=True, exist_ok=True)
            for d in (*(d for d in STATE_DIRS.values()), "tmp", "journal"):
                if not (self.root / d).is_dir():
                    (self.root / d).mkdir()
                    created = True
            if created:
                fsync_paths([str(self.root / d) for d in STATE_DIRS.values()]
                            + [str(self.root / "tmp"), str(self.root / "journal"),
                               str(self.root)] + ([str(self.root.parent)]
                                                  if self.root.parent.exists() else []))
            self._lock_fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                                    0o640)
        except OSError as exc:
            raise StorageError(f"cannot open the queue at {self.root}: {exc}") from exc
        try:
            with self._locked():
                self._check_layout()
                if fresh and not self._counts.path.exists():
                    self._counts.store(Tally(ok=True))
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._committer = GroupCommitter(self._commit, max_batch=max_batch,
                                         name="sluice-fs-commit", dropped=self._dropped)

    @classmethod
    def from_config(cls, config: Config) -> FsStore:
        """The store the queue section of a configuration describes, with its FsSpool."""
        q = config.queue
        spool = FsSpool(q.spool.rootpath, q.spool.partitiondepth, q.spool.bufsize,
                        q.spool.sync_method)
        granularity = RetryPolicy.from_config(q).granularity_s
        store = cls(q.path, spool, granularity_s=granularity, node_id=config.node.id,
                    max_batch=q.commit_max_batch)
        store.tenant_weights = TenantWeights.of(config.scheduler.tenants)
        return store

    # -- submission -----------------------------------------------------------------------

    def submit_future(self, submission: Submission, content: Content, now: float
                      ) -> concurrent.futures.Future[Accepted]:
        """Store.submit_future: content to the spool now, control files by the committer."""
        try:
            sf = self.spool.write(content, submission.spid)
        except SpoolIOError as exc:
            raise StorageError(f"spool write failed: {exc.strerror or exc}") from exc
        state, next_at = submission.initial_state(now)
        meta = Meta(submission.sender, now, submission.tenantid, submission.jobid,
                     submission.transportid, tuple(submission.localip), submission.is_report,
                     sf.size, submission.smtputf8)
        by_domain: dict[str, list[Rcpt]] = defaultdict(list)
        for i, rcpt in enumerate(submission.recipients):
            by_domain[recipient_domain(rcpt)].append(Rcpt(i, rcpt))
        accepted = Accepted(
            spid=sf.spid,
            qids=tuple(format_qid(sf.spid, i) for i in range(len(submission.recipients))),
            size=sf.size,
        )

        # The control files are written here, in the submitter's thread, like
        # the content; the committer only makes them durable and renames them.
        ctrls = [Control(sf.spid, domain, state, next_at, submission.priority, meta, rcpts,
                          gen=new_gen()) for domain, rcpts in by_domain.items()]
        prepared: list[str] = []
        try:
            for ctrl in ctrls:
                ctrl.prepared = f"tmp/{os.getpid()}.{uuid.uuid4().hex}.tmp"
                write_file(self.root / ctrl.prepared, ctrl.dump())
                prepared.append(ctrl.prepared)
        except OSError as exc:
            for tmp in prepared:
                unlink(self.root / tmp)
            self.spool.discard(sf)
            raise StorageError(f"writing the control file failed: {exc.strerror or exc}"
                               ) from exc

        def work(view: Batch) -> Accepted:
            for ctrl in ctrls:
                view.write(copy_control(ctrl), prepared=True)
            view.add_message(sf.spid)
            return accepted

        try:
            return self._op(work, [sf], prepared)
        except BaseException:
            self.spool.discard(sf)
            for tmp in prepared:
                unlink(self.root / tmp)
            raise

    def submit(self, submission: Submission, content: Content, now: float) -> Accepted:
        """Store.submit: submit_future(), waited for."""
        result: Accepted = self.submit_future(submission, content, now).result()
        return result

    # -- the queue manager's side ---------------------------------------------------------

    def _states_of(self, transitions: Sequence[Transition]) -> tuple[QueueState, ...]:
        states: dict[QueueState, None] = {}
        for t in transitions:
            if not t.expect:
                return tuple(QueueState)
            states.update(dict.fromkeys(t.expect))
        return tuple(states)

    def apply_future(self, transitions: Sequence[Transition], *, durable: bool = True,
                     flush_soon: bool = False) -> concurrent.futures.Future[set[str]]:
        """Store.apply_future in one batch, looking in the in-flight directories first."""
        if not transitions:
            return applied_nothing()
        by_spid: dict[str, list[tuple[int, Transition]]] = defaultdict(list)
        for t in transitions:
            spid, idx = parse_qid(t.qid)
            if idx is None:
                raise ValueError(f"a transition needs a full queue id, not {t.qid!r}")
            by_spid[spid].append((idx, t))
        states = self._states_of(transitions)
        wanted = {spid: {idx for idx, _ in items} for spid, items in by_spid.items()}

        def work(view: Batch) -> set[str]:
            applied: set[str] = set()
            # Most results are for entries in flight: look there first (where
            # this process put them, else by listing), and in the other
            # directories only for what was not found.
            first = [s for s in states if s in IN_FLIGHT_STATES]
            found: dict[str, list[Control]] = {}
            if first:
                found, unknown = view.locate_known(wanted, self._in_flight, first)
                if unknown:
                    found.update(view.locate(unknown, first))
            missing = {spid for spid, idxs in wanted.items()
                       if idxs - {r.idx for c in found.get(spid, ()) for r in c.rcpts}}
            rest = [s for s in states if s not in IN_FLIGHT_STATES]
            if missing and rest:
                for spid, ctrls in view.locate(missing, rest).items():
                    found.setdefault(spid, []).extend(ctrls)
            for spid, ctrls in found.items():
                recs = recs_of(ctrls)
                changed = False
                for idx, t in by_spid[spid]:
                    rec = recs.get(idx)
                    if rec is None or (t.expect and rec.state not in t.expect):
                        continue
                    if t.state is None:
                        recs[idx] = None
                    else:
                        rec.state = t.state
                        if t.next_attempt_at is not None:
                            rec.next_at = t.next_attempt_at
                        if t.reply is not None:
                            rec.rcpt.reply = t.reply
                        if t.attempted:
                            rec.rcpt.attempts += 1
                    applied.add(t.qid)
                    changed = True
                if changed:
                    view.swap(ctrls, regroup(ctrls, recs))
            return applied

        return self._op(work)

    def claim_bounces(self, limit: int, now: float, lease_s: float) -> list[QueueEntry]:
        """Store.claim_bounces: bounces/ entries due, leased by moving their due time."""
        if limit <= 0:
            return []
        until = now + lease_s

        def work(view: Batch) -> list[QueueEntry]:
            due: list[tuple[str, int, Control]] = []
            for name, _ in view.names(STATE_DIRS[QueueState.BOUNCE]):
                ctrl = view.load(f"{STATE_DIRS[QueueState.BOUNCE]}/{name}")
                if ctrl is not None and ctrl.next_at <= now:
                    due += [(ctrl.spid, r.idx, ctrl) for r in ctrl.rcpts]
            due.sort(key=lambda item: item[:2])
            chosen = due[:limit]
            by_file: dict[str, list[int]] = defaultdict(list)
            files: dict[str, Control] = {}
            for _, idx, ctrl in chosen:
                by_file[ctrl.path].append(idx)
                files[ctrl.path] = ctrl
            for path, idxs in by_file.items():
                ctrl = files[path]
                recs = recs_of([ctrl])
                for idx in idxs:
                    rec = recs[idx]
                    assert rec is not None
                    rec.next_at = until
                view.swap([ctrl], regroup([ctrl], recs))
            return [e for _, idx, ctrl in chosen
                    for e in replace(ctrl, next_at=until).entries() if e.idx == idx]

        result: list[QueueEntry] = self._call(work)
        return result

    # -- operator side --------------------------------------------------------------------

    def modify(self, selector: Selector, action: Action, now: float,
               priority: int | None = None, reply: Reply | None = None) -> list[QueueEntry]:
        """Store.modify over the state directories, skipping files whose names cannot match."""
        change = OperatorChange(action, now, priority, reply)
        states = tuple(s for s in change.states if not selector.states or s in selector.states)
        may_match = NameFilter(selector)

        def work(view: Batch) -> list[QueueEntry]:
            by_spid: dict[str, list[Control]] = defaultdict(list)
            for rel_dir in view.state_dirs(states):
                for name, parsed in view.names(rel_dir):
                    if not may_match(parsed):
                        continue
                    ctrl = view.load(f"{rel_dir}/{name}")
                    if ctrl is not None:
                        by_spid[ctrl.spid].append(ctrl)
            touched: list[QueueEntry] = []
            for spid in sorted(by_spid):
                ctrls = by_spid[spid]
                recs = recs_of(ctrls)
                hits = [e for c in ctrls for e in c.entries() if selector.matches(e)]
                if not hits:
                    continue
                for e in hits:
                    rec = recs[e.idx]
                    assert rec is not None
                    edit = change.edit(rec.rcpt.attempts)
                    if edit is None:
                        recs[e.idx] = None
                    else:
                        rec.apply(edit)
                    view.log_change(now, e.qid, action)
                view.swap(ctrls, regroup(ctrls, recs))
                touched += hits
            touched.sort(key=lambda e: (e.spid, e.idx))
            return touched

        result: list[QueueEntry] = self._call(work)
        return result

    # -- life -----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the committer, close the spool and release the queue's lock."""
        if self._closed:
            return
        self._stopping.set()
        self.wait_check(30.0)
        self._committer.close()
        self._closed = True
        self.spool.close()
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)

    def __enter__(self) -> FsStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


