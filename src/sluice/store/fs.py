"""Mailismus's filesystem meta queue (FilesysQueue): control files in state directories.

SUMMARY
    FsStore(path, spool, granularity_s=...) implements sluice.store.Store
    with control files under ``queue.path`` and content in the FsSpool.

DESCRIPTION
    Layout (Mailismus section 4.3.2, plus the states Sluice adds):

    incoming/             accepted, not yet tried
    deferred/<T>/         waiting for a retry; T is the due time in epoch
                          seconds rounded up by ``retry_granularity``, so
                          deferred mail clusters in few directories
    bounces/              failed for good, waiting for the NDR
    hold/                 on hold (Halon), ignored until released
    active/               claimed by the queue manager, in memory
    delivering/           a delivery attempt is in flight
    tmp/, journal/        control files being written; batch journals
    changes.log           the operator change feed, one line per change
    layout.json           the granularity the deferred tree is filed by
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

    Claims are renames (incoming/F -> active/F) done under the lock, so two
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

SEE ALSO
    sluice.store (the interface), sluice.spool.fs, seeds/000 section 4.3.2,
    docs/storage.md.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import functools
import heapq
import itertools
import json
import math
import os
import re
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import quote

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
from sluice.spool import Content, SpoolFile, SpoolIOError
from sluice.spool.fs import FsSpool
from sluice.store import ACTION_STATES, Action, Change, Counts, StorageError, Transition
from sluice.store._commit import GroupCommitter, Op, RWLock, fsync_paths, in_parallel
from sluice.store._refill import interleave, split_quota

if TYPE_CHECKING:
    from sluice.config import Config

__all__ = ["FsStore"]

LAYOUT_VERSION = 1

#: State directories (deferred has one level more: deferred/<T>/).
STATE_DIRS: dict[QueueState, str] = {
    QueueState.INCOMING: "incoming",
    QueueState.DEFERRED: "deferred",
    QueueState.BOUNCE: "bounces",
    QueueState.HOLD: "hold",
    QueueState.ACTIVE: "active",
    QueueState.DELIVERING: "delivering",
}
_DIR_STATES = {d: s for s, d in STATE_DIRS.items()}

#: How long content without control files must have existed before
#: recover() removes it: a submitter in another process may be between its
#: spool write and its commit.
ORPHAN_AGE_S = 3600.0

#: Operator changes are kept this long in the change feed.
CHANGES_KEEP_S = 3600.0

_SUFFIX = ".mmq"
_DOMAIN_MAX = 160
_REF_RE = re.compile(r"^([0-9A-F]{8,32})-(\d{1,6})\.ref$")


def _enc_domain(domain: str) -> str:
    return quote(domain, safe="-._[]:")[:_DOMAIN_MAX]


@dataclass(frozen=True, slots=True)
class _Name:
    spid: str
    idx0: int
    n: int
    priority: int
    domain: str  # encoded, maybe shortened

    @classmethod
    def parse(cls, name: str) -> _Name | None:
        return _parse_name(name)


_HEXUP = frozenset("0123456789ABCDEF")


@functools.lru_cache(maxsize=1 << 18)
def _parse_name(name: str) -> _Name | None:
    # String operations rather than a regular expression, and cached: a
    # refill lists the same names batch after batch, qcount lists them all.
    if not name.endswith(_SUFFIX):
        return None
    head, at, domain = name[:-len(_SUFFIX)].partition("@")
    spid, dash, rest = head.partition("-")
    idx0, plus, rest = rest.partition("+")
    n, p, prio = rest.partition("p")
    if not (at and dash and plus and p) or prio not in ("0", "1"):
        return None
    if not (8 <= len(spid) <= 32 and _HEXUP.issuperset(spid)):
        return None
    if not (idx0.isdigit() and n.isdigit() and len(idx0) <= 6 and len(n) <= 6):
        return None
    return _Name(spid, int(idx0), int(n), int(prio), domain)


@dataclass(frozen=True, slots=True)
class _Meta:
    """Message-level fields, the same in every control file of a message."""

    sender: str
    arrival_at: float
    tenantid: str
    jobid: str
    transportid: str
    localip: tuple[str, ...]
    is_report: bool
    size: int
    smtputf8: bool = False


@dataclass(slots=True)
class _Rcpt:
    idx: int
    rcpt: str
    attempts: int = 0
    reply: Reply | None = None


@dataclass(slots=True)
class _Control:
    """One control file: recipients of one message and domain, one state."""

    spid: str
    domain: str
    state: QueueState
    next_at: float
    priority: int
    meta: _Meta
    rcpts: list[_Rcpt]
    gen: str = ""
    path: str = ""  # relative to the root, "" while not yet placed
    prepared: str = ""  # a temporary file already holding dump(), relative to the root

    def name(self) -> str:
        return (f"{self.spid}-{self.rcpts[0].idx}+{len(self.rcpts)}p{self.priority}"
                f"@{_enc_domain(self.domain)}{_SUFFIX}")

    def entries(self) -> list[QueueEntry]:
        m = self.meta
        return [
            QueueEntry(
                spid=self.spid, idx=r.idx, sender=m.sender, recipient=r.rcpt,
                state=self.state, arrival_at=m.arrival_at, next_attempt_at=self.next_at,
                attempts=r.attempts, last_reply=r.reply, priority=self.priority,
                tenantid=m.tenantid, jobid=m.jobid, transportid=m.transportid,
                localip=m.localip, is_report=m.is_report, size=m.size, domain=self.domain,
                smtputf8=m.smtputf8,
            )
            for r in self.rcpts
        ]

    def same_content(self, other: _Control) -> bool:
        return (self.next_at == other.next_at and self.priority == other.priority
                and self.rcpts == other.rcpts)

    def dump(self) -> bytes:
        m = self.meta
        doc = {
            "v": LAYOUT_VERSION, "gen": self.gen, "spid": self.spid, "domain": self.domain,
            "next_at": self.next_at, "priority": self.priority, "sender": m.sender,
            "arrival_at": m.arrival_at, "tenantid": m.tenantid, "jobid": m.jobid,
            "transportid": m.transportid, "localip": list(m.localip),
            "is_report": m.is_report, "size": m.size, "smtputf8": m.smtputf8,
            "rcpts": [[r.idx, r.rcpt, r.attempts,
                       None if r.reply is None else r.reply.to_record()]
                      for r in self.rcpts],
        }
        return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"

    @classmethod
    def load(cls, data: bytes, state: QueueState, path: str) -> _Control:
        doc = json.loads(data)
        meta = _Meta(doc["sender"], doc["arrival_at"], doc["tenantid"], doc["jobid"],
                     doc["transportid"], tuple(doc["localip"]), doc["is_report"], doc["size"],
                     # Absent from files written before Sluice kept the flag.
                     doc.get("smtputf8", False))
        rcpts = [_Rcpt(r[0], r[1], r[2], None if r[3] is None else Reply.from_record(r[3]))
                 for r in doc["rcpts"]]
        return cls(doc["spid"], doc["domain"], state, doc["next_at"], doc["priority"], meta,
                   rcpts, doc["gen"], path)


_gen_counter = itertools.count()


def _new_gen() -> str:
    return f"{os.getpid():x}.{time.time_ns():x}.{next(_gen_counter):x}"


def _state_of(rel: str) -> QueueState:
    return _DIR_STATES[rel.split("/", 1)[0]]


def _read_control(root: Path, rel: str) -> _Control | None:
    try:
        data = (root / rel).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StorageError(f"cannot read {root / rel}: {exc}") from exc
    try:
        return _Control.load(data, _state_of(rel), rel)
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise StorageError(f"{root / rel} is not a control file: {exc}") from exc


def _listdir(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise StorageError(f"cannot list {path}: {exc}") from exc


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


# --------------------------------------------------------------------------
# The batch overlay


@dataclass(slots=True)
class _Effects:
    creates: list[tuple[_Control, str]] = field(default_factory=list)  # (control, final)
    moves: list[tuple[str, str]] = field(default_factory=list)
    unlinks: list[tuple[str, str]] = field(default_factory=list)  # (path, gen)
    ref_adds: set[tuple[str, int]] = field(default_factory=set)
    ref_drops: set[tuple[str, int]] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.creates or self.moves or self.unlinks)


class _View:
    """The tree as the operations of one batch see it: disk plus their changes."""

    def __init__(self, store: FsStore) -> None:
        self.store = store
        self.root = store.root
        self.files: dict[str, _Control | None] = {}
        self.origin: dict[str, str] = {}
        self.dirty: set[str] = set()
        self.disk_gen: dict[str, str] = {}
        self._disk: dict[str, set[str]] = {}  # directory -> names on disk
        self._cur: dict[str, dict[str, _Name]] = {}  # directory -> names now
        self._spids: dict[str, dict[str, set[str]]] = {}  # directory -> spid -> names
        self._deferred: set[int] | None = None
        self._undo: list[Callable[[], None]] = []
        self._touched: set[str] = set()
        self.needs_journal = False
        self.changes: list[tuple[float, str, str]] = []
        self.after: list[Callable[[], None]] = []

    # -- op boundaries ------------------------------------------------------------------

    def begin(self) -> int:
        self._touched = set()
        return len(self._undo)

    def rollback(self, mark: int) -> None:
        while len(self._undo) > mark:
            self._undo.pop()()

    def end(self) -> None:
        if len(self._touched) >= 2:
            self.needs_journal = True

    # -- the directory model ------------------------------------------------------------

    def _dir(self, rel_dir: str) -> dict[str, _Name]:
        cur = self._cur.get(rel_dir)
        if cur is None:
            cur = {}
            for n in _listdir(self.root / rel_dir):
                parsed = _parse_name(n)
                if parsed is not None:
                    cur[n] = parsed
            self._disk[rel_dir] = set(cur)
            self._cur[rel_dir] = cur
            if rel_dir.startswith("deferred/") and self._deferred is not None:
                self._deferred.add(int(rel_dir.split("/")[1]))
        return cur

    def _spid_index(self, rel_dir: str) -> dict[str, set[str]]:
        """Names of a directory by SPID (built when first needed)."""
        by_spid = self._spids.get(rel_dir)
        if by_spid is None:
            by_spid = defaultdict(set)
            for name, parsed in self._dir(rel_dir).items():
                by_spid[parsed.spid].add(name)
            self._spids[rel_dir] = by_spid
        return by_spid

    def _sync(self, path: str) -> None:
        """Bring the directory model in line with ``files`` for one path."""
        rel_dir, name = path.rsplit("/", 1)
        cur = self._dir(rel_dir)
        if path in self.files:
            present = self.files[path] is not None
        else:
            present = name in self._disk[rel_dir]
        by_spid = self._spids.get(rel_dir)
        if present and name not in cur:
            parsed = _parse_name(name)
            if parsed is not None:
                cur[name] = parsed
                if by_spid is not None:
                    by_spid[parsed.spid].add(name)
                if rel_dir.startswith("deferred/"):
                    self.deferred_dirs()  # make sure the set exists
                    assert self._deferred is not None
                    self._deferred.add(int(rel_dir.split("/")[1]))
        elif not present and name in cur:
            parsed = cur.pop(name)
            if by_spid is not None:
                by_spid[parsed.spid].discard(name)

    def _set(self, path: str, ctrl: _Control | None, *, dirty: bool,
             origin: str | None = None) -> None:
        had = path in self.files
        old = self.files.get(path)
        was_dirty = path in self.dirty
        old_origin = self.origin.get(path)

        def undo() -> None:
            if had:
                self.files[path] = old
            else:
                self.files.pop(path, None)
            if was_dirty:
                self.dirty.add(path)
            else:
                self.dirty.discard(path)
            if old_origin is None:
                self.origin.pop(path, None)
            else:
                self.origin[path] = old_origin
            self._sync(path)

        self._undo.append(undo)
        self.files[path] = ctrl
        if dirty:
            self.dirty.add(path)
        else:
            self.dirty.discard(path)
        if origin is None:
            self.origin.pop(path, None)
        else:
            self.origin[path] = origin
        self._sync(path)

    # -- reading ------------------------------------------------------------------------

    def names(self, rel_dir: str) -> list[tuple[str, _Name]]:
        """Control files of a directory (name, parsed name), with the batch's changes."""
        return list(self._dir(rel_dir).items())

    def live_names(self, rel_dir: str) -> Iterable[tuple[str, _Name]]:
        """As names(), without a copy: the caller must not change the view meanwhile."""
        return self._dir(rel_dir).items()

    def deferred_dirs(self) -> list[int]:
        """Due times of deferred/<T> directories, ascending."""
        if self._deferred is None:
            self._deferred = {int(d) for d in _listdir(self.root / "deferred") if d.isdigit()}
        return sorted(self._deferred)

    def state_dirs(self, states: Iterable[QueueState]) -> list[str]:
        out = []
        for state in dict.fromkeys(states):
            if state is QueueState.DEFERRED:
                out += [f"deferred/{t}" for t in self.deferred_dirs()]
            else:
                out.append(STATE_DIRS[state])
        return out

    def load(self, path: str) -> _Control | None:
        if path in self.files:
            ctrl = self.files[path]
            return None if ctrl is None else _copy(ctrl)
        ctrl = _read_control(self.root, path)
        if ctrl is not None:
            self.disk_gen[path] = ctrl.gen
        return ctrl

    def locate(self, spids: set[str], states: Iterable[QueueState]) -> dict[str, list[_Control]]:
        """The control files of ``spids`` in the directories of ``states``."""
        out: dict[str, list[_Control]] = defaultdict(list)
        for rel_dir in self.state_dirs(states):
            by_spid = self._spid_index(rel_dir)
            for spid in spids:
                for name in sorted(by_spid.get(spid, ())):
                    ctrl = self.load(f"{rel_dir}/{name}")
                    if ctrl is not None:
                        out[spid].append(ctrl)
        return out

    # -- changing -----------------------------------------------------------------------

    def _place(self, ctrl: _Control) -> str:
        return f"{self.store.dir_for(ctrl.state, ctrl.next_at)}/{ctrl.name()}"

    def remove(self, ctrl: _Control) -> None:
        self._set(ctrl.path, None, dirty=False)
        self._touched.add(ctrl.path)

    def write(self, ctrl: _Control, *, prepared: bool = False) -> None:
        """Place a new or changed control file.  ``prepared``: its temporary
        file was written (with its generation) by the submitter."""
        if not prepared:
            ctrl.prepared = ""
            ctrl.gen = _new_gen()
        ctrl.path = self._place(ctrl)
        self._set(ctrl.path, ctrl, dirty=True)
        self._touched.add(ctrl.path)

    def move(self, ctrl: _Control, state: QueueState) -> _Control:
        """Move a file unchanged to another state directory (a rename)."""
        old = ctrl.path
        moved = replace(ctrl, state=state, rcpts=list(ctrl.rcpts))
        moved.path = self._place(moved)
        if moved.path == old:
            return moved
        if old in self.dirty:  # written in this batch: still just a new file
            self._set(old, None, dirty=False)
            self._set(moved.path, moved, dirty=True)
            return moved
        source = self.origin.get(old, old)
        self._set(old, None, dirty=False)
        self._set(moved.path, moved, dirty=False, origin=source)
        return moved

    def swap(self, originals: Sequence[_Control], news: Sequence[_Control]) -> None:
        """Turn the ``originals`` of one message into ``news`` with the fewest changes."""
        left = {frozenset(r.idx for r in o.rcpts): o for o in originals}
        for new in news:
            match = left.pop(frozenset(r.idx for r in new.rcpts), None)
            if match is not None and match.same_content(new) and match.domain == new.domain:
                if match.state is not new.state:
                    self.move(match, new.state)
                continue
            if match is not None:
                self.remove(match)
            self.write(new)
        for orphan in left.values():
            self.remove(orphan)

    def log_change(self, at: float, qid: str, action: Action) -> None:
        self.changes.append((at, qid, str(action)))
        n = len(self.changes)
        self._undo.append(lambda: self.changes.__delitem__(slice(n - 1, None)))

    # -- the result ---------------------------------------------------------------------

    def effects(self) -> _Effects:
        fx = _Effects()
        clean_sources = {self.origin[p] for p, c in self.files.items()
                         if c is not None and p not in self.dirty and p in self.origin}
        created_refs: dict[str, set[int]] = defaultdict(set)
        dropped_refs: dict[str, set[int]] = defaultdict(set)
        for path, ctrl in self.files.items():
            if ctrl is None:
                if path in self.disk_gen and path not in clean_sources:
                    fx.unlinks.append((path, self.disk_gen[path]))
                    parsed = _Name.parse(path.rsplit("/", 1)[1])
                    if parsed is not None:
                        dropped_refs[parsed.spid].add(parsed.idx0)
            elif path in self.dirty:
                fx.creates.append((ctrl, path))
                if path not in self.disk_gen:
                    created_refs[ctrl.spid].add(ctrl.rcpts[0].idx)
            elif path in self.origin and self.origin[path] != path:
                fx.moves.append((self.origin[path], path))
        for spid in set(created_refs) | set(dropped_refs):
            for idx0 in created_refs[spid] - dropped_refs[spid]:
                fx.ref_adds.add((spid, idx0))
            for idx0 in dropped_refs[spid] - created_refs[spid]:
                fx.ref_drops.add((spid, idx0))
        return fx


def _copy(ctrl: _Control) -> _Control:
    return replace(ctrl, rcpts=[replace(r) for r in ctrl.rcpts])


@dataclass(slots=True)
class _Rec:
    """A recipient while an operation decides its fate."""

    rcpt: _Rcpt
    state: QueueState
    next_at: float
    priority: int


def _regroup(ctrls: Sequence[_Control], recs: dict[int, _Rec | None]) -> list[_Control]:
    """New control files for the surviving recipients of ``ctrls`` (one message)."""
    groups: dict[tuple[str, QueueState, float, int], list[_Rcpt]] = defaultdict(list)
    template: dict[str, _Control] = {}
    for ctrl in ctrls:
        template.setdefault(ctrl.domain, ctrl)
        for r in ctrl.rcpts:
            rec = recs.get(r.idx, _Rec(r, ctrl.state, ctrl.next_at, ctrl.priority))
            if rec is None:
                continue
            groups[(ctrl.domain, rec.state, rec.next_at, rec.priority)].append(rec.rcpt)
    out = []
    for (domain, state, next_at, prio), rcpts in groups.items():
        base = template[domain]
        out.append(_Control(base.spid, domain, state, next_at, prio, base.meta,
                            sorted(rcpts, key=lambda r: r.idx)))
    return out


def _recs(ctrls: Sequence[_Control]) -> dict[int, _Rec | None]:
    return {r.idx: _Rec(replace(r), c.state, c.next_at, c.priority)
            for c in ctrls for r in c.rcpts}


# --------------------------------------------------------------------------
# The store


class FsStore:
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
        self._batch_no = itertools.count()
        self._seq_cache: tuple[int, int] = (-1, 0)  # (changes.log size, last seq)
        # Where the last changes_since() answer ended: (file, seq, offset).
        self._feed_cursor: tuple[tuple[int, int], int, int] = ((0, 0), -1, 0)
        try:
            created = not self.root.exists()
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
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._committer = GroupCommitter(self._commit, max_batch=max_batch,
                                         name="sluice-fs-commit", dropped=self._dropped)

    @classmethod
    def from_config(cls, config: Config) -> FsStore:
        q = config.queue
        spool = FsSpool(q.spool.rootpath, q.spool.partitiondepth, q.spool.bufsize,
                        q.spool.sync_method)
        granularity = RetryPolicy.from_config(q).granularity_s
        return cls(q.path, spool, granularity_s=granularity, node_id=config.node.id,
                   max_batch=q.commit_max_batch)

    # -- layout ---------------------------------------------------------------------------

    def dir_for(self, state: QueueState, next_at: float) -> str:
        if state is QueueState.DEFERRED:
            return f"deferred/{self.due_dir(next_at)}"
        return STATE_DIRS[state]

    def due_dir(self, next_at: float) -> int:
        """The deferred/<T> directory for a due time: rounded up, whole seconds."""
        return max(0, math.ceil(self._policy.round_up(next_at) - 1e-6))

    @property
    def _window_s(self) -> float:
        # Files in deferred/T are due in (T - window, T].
        return self.granularity_s + 1.0

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
        for name in _listdir(self.root / "tmp"):
            path = self.root / "tmp" / name
            with contextlib.suppress(OSError):
                if path.stat().st_mtime < now - ORPHAN_AGE_S:
                    _unlink(path)

    def _check_layout(self) -> None:
        path = self.root / "layout.json"
        try:
            layout = json.loads(path.read_text())
        except FileNotFoundError:
            layout = None
        except (OSError, ValueError) as exc:
            raise StorageError(f"cannot read {path}: {exc}") from exc
        if layout is not None and layout.get("layout") != LAYOUT_VERSION:
            raise StorageError(f"{path}: unknown layout {layout.get('layout')!r}")
        if layout is not None and layout.get("granularity_s") != self.granularity_s:
            self._refile_deferred()
        if layout is None or layout.get("granularity_s") != self.granularity_s:
            self._write_small(path, json.dumps({"layout": LAYOUT_VERSION,
                                                "granularity_s": self.granularity_s}))

    def _write_small(self, path: Path, text: str) -> None:
        tmp = self.root / "tmp" / f"{path.name}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_paths([str(path.parent)])

    def _refile_deferred(self) -> None:
        """The granularity changed: move deferred files to their new directories."""
        dirs: set[str] = set()
        for d in _listdir(self.root / "deferred"):
            for name in _listdir(self.root / "deferred" / d):
                ctrl = _read_control(self.root, f"deferred/{d}/{name}")
                if ctrl is None:
                    continue
                target = f"deferred/{self.due_dir(ctrl.next_at)}"
                if target != f"deferred/{d}":
                    (self.root / target).mkdir(exist_ok=True)
                    os.rename(self.root / "deferred" / d / name, self.root / target / name)
                    dirs.update((str(self.root / target), str(self.root / "deferred" / d)))
        dirs.add(str(self.root / "deferred"))
        fsync_paths(dirs)
        for d in _listdir(self.root / "deferred"):
            with contextlib.suppress(OSError):
                os.rmdir(self.root / "deferred" / d)

    # -- journals -------------------------------------------------------------------------

    def _replay_journals(self) -> None:
        names = _listdir(self.root / "journal")
        if not names:
            return
        for name in sorted(names):
            path = self.root / "journal" / name
            try:
                lines = path.read_text().splitlines()
            except FileNotFoundError:
                continue
            if not lines or lines[-1] != "END":
                _unlink(path)  # torn: the batch never reached its commit point
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
                    ctrl = _read_control(self.root, rel)
                    if ctrl is not None and ctrl.gen == gen:
                        _unlink(self.root / rel)
                        dirs.add(str((self.root / rel).parent))
            dirs.add(str(self.root / "deferred"))
            fsync_paths(dirs)
            _unlink(path)
        fsync_paths([str(self.root / "journal")])

    # -- the committer --------------------------------------------------------------------

    def _op(self, work: Callable[[_View], Any], files: Sequence[SpoolFile] = (),
            prepared: Sequence[str] = ()) -> concurrent.futures.Future[Any]:
        if self._closed:
            raise StorageError("the store is closed")
        return self._committer.submit(work, files, extra=list(prepared))

    def _call(self, work: Callable[[_View], Any]) -> Any:
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
            _unlink(self.root / tmp)

    def _fail(self, batch: Sequence[Op], err: BaseException) -> None:
        for op in batch:
            if not op.future.done():
                for f in op.files:
                    self.spool.discard(f)
                for tmp in op.extra or ():
                    _unlink(self.root / tmp)
                op.future.set_exception(err)

    def _commit_locked(self, batch: list[Op]) -> None:
        view = _View(self)
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
        except _LateFailure as exc:
            # Some of the batch may be in place (or will be, by its journal):
            # keep every spool file; recover() removes the ones nobody uses.
            err = StorageError(f"queue commit failed: {exc.__cause__ or exc}")
            for op in batch:
                if not op.future.done():
                    op.future.set_exception(err)
            return
        except OSError as exc:
            err = StorageError(f"queue commit failed: {exc.strerror or exc}")
            self._fail(batch, err)
            return
        for op in failed:
            for f in op.files:
                self.spool.discard(f)
        # Files submitters wrote that the batch did not use (failed, or changed
        # again within the batch).
        used = {ctrl.prepared for ctrl, _ in fx.creates if ctrl.prepared}
        in_parallel(_unlink, [self.root / tmp for op in batch for tmp in op.extra or ()
                              if tmp not in used])
        for op, value, failure in results:
            if failure is None:
                op.future.set_result(value)
            else:
                op.future.set_exception(failure)

    def _durable(self, view: _View, fx: _Effects, files: list[SpoolFile]) -> None:
        """Make the batch's effects durable, in the order the module doc gives."""
        root = self.root
        batch_id = f"{os.getpid()}.{next(self._batch_no)}"
        temps: list[tuple[str, str]] = []
        written: list[str] = []
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
            in_parallel(lambda job: _write_file(*job), todo)
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
            if not fx and not view.after:
                return
            # 2. The journal: the commit point of a batch that changes several files.
            journal = None
            if view.needs_journal and (len(fx.creates) + len(fx.unlinks)) >= 2:
                journal = root / "journal" / f"{batch_id}.jnl"
                lines = [json.dumps({"c": [t, f]}) for t, f in temps]
                lines += [json.dumps({"u": [p, g]}) for p, g in fx.unlinks]
                _write_file(journal, ("\n".join([*lines, "END"]) + "\n").encode())
                fsync_paths([str(journal), str(root / "journal")])
        except OSError:
            for tmp in written:
                _unlink(root / tmp)
            for ctrl, _ in fx.creates:
                if ctrl.prepared:
                    _unlink(root / ctrl.prepared)
            raise
        try:
            self._into_place(view, fx, temps, journal)
        except Exception as exc:
            raise _LateFailure(str(exc)) from exc

    def _into_place(self, view: _View, fx: _Effects, temps: list[tuple[str, str]],
                    journal: Path | None) -> None:
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
            in_parallel(_unlink, [root / rel for rel, _ in fx.unlinks])
        dirs.update(str(dst.parent) for _, dst in renames)
        dirs.update(str(src.parent) for src, _ in renames[len(temps):])
        dirs.update(str((root / rel).parent) for rel, _ in fx.unlinks)
        # 4. Every directory touched.
        fsync_paths(dirs)
        # 5. Done: the journal may go; so may links and content of what left.
        if journal is not None:
            _unlink(journal)
        with self._rw.writing():
            in_parallel(_unlink, [self.spool.directory(spid) / f"{spid}-{idx0}.ref"
                                  for spid, idx0 in fx.ref_drops])
            in_parallel(self._drop_if_unused, sorted({spid for spid, _ in fx.ref_drops}))
            emptied = {rel.split("/")[1] for rel, _ in fx.unlinks if rel.startswith("deferred/")}
            emptied |= {src.split("/")[1] for src, _ in fx.moves if src.startswith("deferred/")}
            for t in emptied:
                with contextlib.suppress(OSError):
                    os.rmdir(root / "deferred" / t)
            for hook in view.after:
                hook()

    def _drop_if_unused(self, spid: str) -> None:
        """Delete a message's content once no control file links to it."""
        try:
            links = os.stat(self.spool.path(spid)).st_nlink
        except FileNotFoundError:
            return
        if links <= 1:
            # Nothing links to it any more, so nothing can again: the unlink
            # itself may come a moment later, on the spool's own thread.
            self.spool.delete_soon([spid])

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
            os.write(fd, data)
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

    # -- submission -----------------------------------------------------------------------

    def submit_future(self, submission: Submission, content: Content, now: float
                      ) -> concurrent.futures.Future[Accepted]:
        try:
            sf = self.spool.write(content, submission.spid)
        except SpoolIOError as exc:
            raise StorageError(f"spool write failed: {exc.strerror or exc}") from exc
        state, next_at = submission.initial_state(now)
        meta = _Meta(submission.sender, now, submission.tenantid, submission.jobid,
                     submission.transportid, tuple(submission.localip), submission.is_report,
                     sf.size, submission.smtputf8)
        by_domain: dict[str, list[_Rcpt]] = defaultdict(list)
        for i, rcpt in enumerate(submission.recipients):
            by_domain[recipient_domain(rcpt)].append(_Rcpt(i, rcpt))
        accepted = Accepted(
            spid=sf.spid,
            qids=tuple(format_qid(sf.spid, i) for i in range(len(submission.recipients))),
            size=sf.size,
        )

        # The control files are written here, in the submitter's thread, like
        # the content; the committer only makes them durable and renames them.
        ctrls = [_Control(sf.spid, domain, state, next_at, submission.priority, meta, rcpts,
                          gen=_new_gen()) for domain, rcpts in by_domain.items()]
        prepared: list[str] = []
        try:
            for ctrl in ctrls:
                ctrl.prepared = f"tmp/{os.getpid()}.{uuid.uuid4().hex}.tmp"
                _write_file(self.root / ctrl.prepared, ctrl.dump())
                prepared.append(ctrl.prepared)
        except OSError as exc:
            for tmp in prepared:
                _unlink(self.root / tmp)
            self.spool.discard(sf)
            raise StorageError(f"writing the control file failed: {exc.strerror or exc}"
                               ) from exc

        def work(view: _View) -> Accepted:
            for ctrl in ctrls:
                view.write(_copy(ctrl), prepared=True)
            return accepted

        try:
            return self._op(work, [sf], prepared)
        except BaseException:
            self.spool.discard(sf)
            for tmp in prepared:
                _unlink(self.root / tmp)
            raise

    def submit(self, submission: Submission, content: Content, now: float) -> Accepted:
        result: Accepted = self.submit_future(submission, content, now).result()
        return result

    # -- the queue manager's side ---------------------------------------------------------

    def _claimable(self, now: float) -> bool:
        try:
            with os.scandir(self.root / "incoming") as it:
                if any(e.name.endswith(_SUFFIX) for e in it):
                    return True
        except FileNotFoundError:
            pass
        return any(
            d.isdigit() and int(d) - self._window_s < now
            and any(n.endswith(_SUFFIX) for n in _listdir(self.root / "deferred" / d))
            for d in _listdir(self.root / "deferred"))

    def _due_candidates(self, view: _View, now: float) -> list[tuple[tuple[Any, ...], str]]:
        out = []
        for t in view.deferred_dirs():
            if t - self._window_s >= now:
                break
            rel_dir = f"deferred/{t}"
            for name, parsed in view.names(rel_dir):
                if t > now:  # the boundary directory: look at the exact times
                    ctrl = view.load(f"{rel_dir}/{name}")
                    if ctrl is None or ctrl.next_at > now:
                        continue
                out.append(((-parsed.priority, t, parsed.spid, parsed.idx0, parsed.n),
                            f"{rel_dir}/{name}"))
        return out

    def claim(self, limit: int, now: float, quota_deferred: int) -> list[QueueEntry]:
        if limit <= 0:
            return []
        # A queue manager polls often; answer "nothing" without the lock.
        if not self._claimable(now):
            return []

        def take(view: _View, cands: list[tuple[tuple[Any, ...], str]], k: int
                 ) -> list[QueueEntry]:
            out: list[QueueEntry] = []
            for _, path in cands:
                if k <= 0:
                    break
                ctrl = view.load(path)
                if ctrl is None:
                    continue
                if len(ctrl.rcpts) <= k:
                    moved = view.move(ctrl, QueueState.ACTIVE)
                    out += moved.entries()
                    k -= len(ctrl.rcpts)
                else:
                    part = replace(ctrl, state=QueueState.ACTIVE, rcpts=ctrl.rcpts[:k])
                    rest = replace(ctrl, rcpts=ctrl.rcpts[k:])
                    view.swap([ctrl], [part, rest])
                    out += part.entries()
                    k = 0
            return out

        def work(view: _View) -> list[QueueEntry]:
            inc = [((-parsed.priority, parsed.spid, parsed.idx0, parsed.n), f"incoming/{name}")
                   for name, parsed in view.live_names("incoming")]
            dfr = self._due_candidates(view, now)
            n_inc = sum(key[-1] for key, _ in inc)
            n_dfr = sum(key[-1] for key, _ in dfr)
            take_d, take_i = split_quota(limit, n_inc, n_dfr, quota_deferred)
            # Every file holds at least one recipient: the first ``limit`` files
            # in order are all a refill can need, whatever the backlog.
            return interleave(take(view, heapq.nsmallest(take_i, inc), take_i),
                              take(view, heapq.nsmallest(take_d, dfr), take_d))

        result: list[QueueEntry] = self._call(work)
        return result

    def _states_of(self, transitions: Sequence[Transition]) -> tuple[QueueState, ...]:
        states: dict[QueueState, None] = {}
        for t in transitions:
            if not t.expect:
                return tuple(QueueState)
            states.update(dict.fromkeys(t.expect))
        return tuple(states)

    def apply(self, transitions: Sequence[Transition], *, wait: bool = True,
              durable: bool = True) -> set[str]:
        if not transitions:
            return set()
        by_spid: dict[str, list[tuple[int, Transition]]] = defaultdict(list)
        for t in transitions:
            spid, idx = parse_qid(t.qid)
            if idx is None:
                raise ValueError(f"a transition needs a full queue id, not {t.qid!r}")
            by_spid[spid].append((idx, t))
        states = self._states_of(transitions)

        def work(view: _View) -> set[str]:
            applied: set[str] = set()
            # Most results are for entries in flight: look there first, and
            # in the other directories only for what was not found.
            first = [s for s in states if s in IN_FLIGHT_STATES]
            found = view.locate(set(by_spid), first) if first else {}
            missing = {spid for spid, items in by_spid.items()
                       if {idx for idx, _ in items} - {r.idx for c in found.get(spid, ())
                                                       for r in c.rcpts}}
            rest = [s for s in states if s not in IN_FLIGHT_STATES]
            if missing and rest:
                for spid, ctrls in view.locate(missing, rest).items():
                    found.setdefault(spid, []).extend(ctrls)
            for spid, ctrls in found.items():
                recs = _recs(ctrls)
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
                    view.swap(ctrls, _regroup(ctrls, recs))
            return applied

        fut = self._op(work)
        if not wait:
            return set()
        result: set[str] = fut.result()
        return result

    def claim_bounces(self, limit: int, now: float, lease_s: float) -> list[QueueEntry]:
        if limit <= 0:
            return []
        until = now + lease_s

        def work(view: _View) -> list[QueueEntry]:
            due: list[tuple[str, int, _Control]] = []
            for name, _ in view.names(STATE_DIRS[QueueState.BOUNCE]):
                ctrl = view.load(f"{STATE_DIRS[QueueState.BOUNCE]}/{name}")
                if ctrl is not None and ctrl.next_at <= now:
                    due += [(ctrl.spid, r.idx, ctrl) for r in ctrl.rcpts]
            due.sort(key=lambda item: item[:2])
            chosen = due[:limit]
            by_file: dict[str, list[int]] = defaultdict(list)
            files: dict[str, _Control] = {}
            for _, idx, ctrl in chosen:
                by_file[ctrl.path].append(idx)
                files[ctrl.path] = ctrl
            for path, idxs in by_file.items():
                ctrl = files[path]
                recs = _recs([ctrl])
                for idx in idxs:
                    rec = recs[idx]
                    assert rec is not None
                    rec.next_at = until
                view.swap([ctrl], _regroup([ctrl], recs))
            return [e for _, idx, ctrl in chosen
                    for e in replace(ctrl, next_at=until).entries() if e.idx == idx]

        result: list[QueueEntry] = self._call(work)
        return result

    def recover(self, now: float) -> int:
        def work(view: _View) -> int:
            moved = 0
            for state in (QueueState.ACTIVE, QueueState.DELIVERING):
                for name, _ in view.names(STATE_DIRS[state]):
                    ctrl = view.load(f"{STATE_DIRS[state]}/{name}")
                    if ctrl is None:
                        continue
                    new = replace(_copy(ctrl), state=QueueState.DEFERRED, next_at=now, gen="",
                                  path="")
                    view.swap([ctrl], [new])
                    moved += len(ctrl.rcpts)
            view.after.append(lambda: self._prune_changes(now))
            view.after.append(lambda: self._clean_tmp(now))
            view.after.append(lambda: self._reconcile(now))
            return moved

        result: int = self._call(work)
        return result

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

    def _reconcile(self, now: float) -> None:
        """Content links equal control files; content without any is removed."""
        controls: dict[str, set[int]] = defaultdict(set)
        for rel_dir in self._all_dirs():
            for name in _listdir(self.root / rel_dir):
                parsed = _Name.parse(name)
                if parsed is not None:
                    controls[parsed.spid].add(parsed.idx0)
        msgs: dict[str, float] = {}
        refs: dict[str, set[int]] = defaultdict(set)
        stack = [self.spool.root]
        while stack:
            top = stack.pop()
            try:
                with os.scandir(top) as it:
                    for entry in it:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(Path(entry.path))
                        elif entry.name.endswith(".msg"):
                            with contextlib.suppress(FileNotFoundError):
                                msgs[entry.name[:-4]] = entry.stat().st_mtime
                        else:
                            m = _REF_RE.match(entry.name)
                            if m:
                                refs[m.group(1)].add(int(m.group(2)))
            except FileNotFoundError:
                continue
        for spid in set(msgs) | set(refs):
            want = controls.get(spid, set())
            if not want:
                if spid in msgs and now - msgs[spid] < ORPHAN_AGE_S:
                    continue  # maybe a submission of another process, not yet committed
                for idx0 in refs.get(spid, set()):
                    _unlink(self.spool.directory(spid) / f"{spid}-{idx0}.ref")
                if spid in msgs:
                    self.spool.delete(spid)
                continue
            for idx0 in refs.get(spid, set()) - want:
                _unlink(self.spool.directory(spid) / f"{spid}-{idx0}.ref")
            if spid in msgs:
                for idx0 in want - refs.get(spid, set()):
                    self._add_ref(spid, idx0)

    def _all_dirs(self) -> list[str]:
        out = [d for s, d in STATE_DIRS.items() if s is not QueueState.DEFERRED]
        out += [f"deferred/{t}" for t in _listdir(self.root / "deferred") if t.isdigit()]
        return out

    def expired(self, cutoff_at: float, reports_cutoff_at: float, limit: int = 10000
                ) -> list[QueueEntry]:
        out: list[QueueEntry] = []
        for ctrl in self._controls((QueueState.DEFERRED,)):
            cutoff = reports_cutoff_at if ctrl.meta.is_report else cutoff_at
            if ctrl.meta.arrival_at <= cutoff:
                out += ctrl.entries()
                if len(out) >= limit:
                    return out[:limit]
        return out

    def due_at(self) -> float | None:
        with self._rw.reading():
            for t in sorted(int(d) for d in _listdir(self.root / "deferred") if d.isdigit()):
                times = []
                for name in _listdir(self.root / "deferred" / str(t)):
                    if name.endswith(_SUFFIX):
                        ctrl = _read_control(self.root, f"deferred/{t}/{name}")
                        if ctrl is not None:
                            times.append(ctrl.next_at)
                if times:
                    return min(times)
        return None

    # -- operator side --------------------------------------------------------------------

    def modify(self, selector: Selector, action: Action, now: float,
               priority: int | None = None, reply: Reply | None = None) -> list[QueueEntry]:
        if action is Action.PRIORITY and priority not in (0, 1):
            raise ValueError("priority must be 0 or 1")
        states = ACTION_STATES[action]
        if selector.states:
            states = tuple(s for s in states if s in selector.states)
        bounce = reply or Reply(550, "5.0.0", "bounced by the operator")

        may_match = _NameFilter(selector)

        def work(view: _View) -> list[QueueEntry]:
            by_spid: dict[str, list[_Control]] = defaultdict(list)
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
                recs = _recs(ctrls)
                hits = [e for c in ctrls for e in c.entries() if selector.matches(e)]
                if not hits:
                    continue
                for e in hits:
                    rec = recs[e.idx]
                    assert rec is not None
                    if action is Action.HOLD:
                        rec.state = QueueState.HOLD
                    elif action is Action.RELEASE:
                        rec.state = (QueueState.INCOMING if rec.rcpt.attempts == 0
                                     else QueueState.DEFERRED)
                        rec.next_at = now
                    elif action is Action.RETRY:
                        rec.next_at = now
                    elif action is Action.PRIORITY:
                        assert priority is not None
                        rec.priority = priority
                    elif action is Action.BOUNCE:
                        rec.state = QueueState.BOUNCE
                        rec.next_at = now
                        rec.rcpt.reply = bounce
                    elif action is Action.DELETE:
                        recs[e.idx] = None
                    view.log_change(now, e.qid, action)
                view.swap(ctrls, _regroup(ctrls, recs))
                touched += hits
            touched.sort(key=lambda e: (e.spid, e.idx))
            return touched

        result: list[QueueEntry] = self._call(work)
        return result

    def changes_since(self, seq: int) -> tuple[int, list[Change]]:
        path = self.root / "changes.log"
        out: list[Change] = []
        top = seq
        try:
            with open(path, "rb") as f:
                # A queue manager polls with the seq we answered last time:
                # start where that answer ended, unless the file was rewritten.
                st = os.fstat(f.fileno())
                inode, last_seq, offset = self._feed_cursor
                if inode == (st.st_dev, st.st_ino) and seq == last_seq and offset <= st.st_size:
                    f.seek(offset)
                end = f.tell()
                for raw in f:
                    if not raw.endswith(b"\n"):
                        break  # a line being written: next time
                    end += len(raw)
                    parts = raw.decode("utf-8", "replace").rstrip("\n").split("\t")
                    if len(parts) != 4 or not parts[0].isdigit():
                        continue
                    n = int(parts[0])
                    if n <= seq:
                        continue
                    with contextlib.suppress(ValueError):
                        out.append(Change(n, parts[2], Action(parts[3])))
                        top = max(top, n)
                self._feed_cursor = ((st.st_dev, st.st_ino), top, end)
        except FileNotFoundError:
            pass
        return top, out

    # -- reading --------------------------------------------------------------------------

    def _dirs(self, states: Iterable[QueueState]) -> list[str]:
        out = []
        for state in dict.fromkeys(states):
            if state is QueueState.DEFERRED:
                out += [f"deferred/{t}" for t in
                        sorted(int(d) for d in _listdir(self.root / "deferred") if d.isdigit())]
            else:
                out.append(STATE_DIRS[state])
        return out

    def _names(self, states: Iterable[QueueState], selector: Selector | None = None
               ) -> list[tuple[_Name, str]]:
        """(parsed name, relative path) of every control file in ``states``."""
        out = []
        may_match = _NameFilter(selector)
        for rel_dir in self._dirs(states):
            for name in _listdir(self.root / rel_dir):
                parsed = _parse_name(name)
                if parsed is not None and may_match(parsed):
                    out.append((parsed, f"{rel_dir}/{name}"))
        return out

    def _controls(self, states: Iterable[QueueState], selector: Selector | None = None
                  ) -> Iterator[_Control]:
        """Every control file in ``states`` the selector may pick, read in pieces.

        The read lock is held per piece, never while the caller has the
        generator suspended, so a caller may write to the store meanwhile.
        """
        with self._rw.reading():
            found = self._names(states, selector)
        for start in range(0, len(found), 500):
            with self._rw.reading():
                piece = [_read_control(self.root, rel) for _, rel in found[start:start + 500]]
            yield from (c for c in piece if c is not None)

    def get(self, qid: str) -> QueueEntry | None:
        spid, idx = parse_qid(qid)
        if idx is None:
            raise ValueError(f"get() needs a full queue id, not a SPID: {qid!r}")
        for ctrl in self._controls(tuple(QueueState), Selector(qids=(spid,))):
            for e in ctrl.entries():
                if e.idx == idx:
                    return e
        return None

    def entries(self, selector: Selector, *, after: str | None = None,
                limit: int | None = None) -> Iterator[QueueEntry]:
        states = selector.states or tuple(QueueState)
        cursor: tuple[str, int] | None = None
        if after is not None:
            spid, idx = parse_qid(after)
            cursor = (spid, -1 if idx is None else idx)
        with self._rw.reading():
            found = self._names(states, selector)
        groups: dict[str, list[str]] = defaultdict(list)
        for parsed, rel in found:
            if cursor is None or parsed.spid >= cursor[0]:
                groups[parsed.spid].append(rel)
        remaining = limit
        spids = sorted(groups)
        page = 200
        for start in range(0, len(spids), page):
            out: list[QueueEntry] = []
            with self._rw.reading():
                for spid in spids[start:start + page]:
                    message: list[QueueEntry] = []
                    for rel in groups[spid]:
                        ctrl = _read_control(self.root, rel)
                        if ctrl is not None:
                            message += ctrl.entries()
                    message.sort(key=lambda e: e.idx)
                    out += [e for e in message if selector.matches(e)
                            and (cursor is None or (e.spid, e.idx) > cursor)]
            for e in out:
                if remaining is not None:
                    if remaining <= 0:
                        return
                    remaining -= 1
                yield e

    def count(self, selector: Selector | None = None) -> Counts:
        by_state = {s: 0 for s in QueueState}
        spids: set[str] = set()
        if selector is None or selector.is_empty or _names_suffice(selector):
            states = tuple(QueueState) if selector is None or not selector.states \
                else selector.states
            may_match = _NameFilter(selector)
            with self._rw.reading():
                for rel_dir in self._dirs(states):
                    state = _state_of(rel_dir)
                    n = 0
                    for name in _listdir(self.root / rel_dir):
                        parsed = _parse_name(name)
                        if parsed is not None and may_match(parsed):
                            n += parsed.n
                            spids.add(parsed.spid)
                    by_state[state] += n
            return Counts(by_state=by_state, messages=len(spids))
        states = selector.states or tuple(QueueState)
        for ctrl in self._controls(states, selector):
            for e in ctrl.entries():
                if selector.matches(e):
                    by_state[e.state] += 1
                    spids.add(e.spid)
        return Counts(by_state=by_state, messages=len(spids))

    def shape(self, selector: Selector, now: float, edges_s: Sequence[float]
              ) -> dict[str, list[int]]:
        edges = list(edges_s)
        out: dict[str, list[int]] = {}
        for ctrl in self._controls(selector.states or tuple(QueueState), selector):
            for e in ctrl.entries():
                if not selector.matches(e):
                    continue
                age = now - e.arrival_at
                bucket = next((i for i, edge in enumerate(edges) if age < edge), len(edges))
                out.setdefault(e.domain, [0] * (len(edges) + 1))[bucket] += 1
        return out

    def open_content(self, spid: str) -> IO[bytes]:
        try:
            return self.spool.open(spid)
        except OSError as exc:
            raise StorageError(f"cannot open the content of {spid}: {exc}") from exc

    # -- life -----------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._committer.close()
        self._closed = True
        self.spool.close()
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)

    def __enter__(self) -> FsStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _NameFilter:
    """Whether a file of a given name may hold entries a selector picks.

    Built once per listing: a selection of thousands of queue ids is a set
    lookup per name, not a scan of the ids.
    """

    __slots__ = ("domain", "spids")

    def __init__(self, selector: Selector | None) -> None:
        self.spids: frozenset[str] | None = None
        self.domain: str | None = None
        if selector is not None:
            if selector.qids:
                self.spids = frozenset(parse_qid(q)[0] for q in selector.qids)
            if selector.domain is not None:
                self.domain = _enc_domain(selector.domain)

    def __call__(self, parsed: _Name) -> bool:
        if self.spids is not None and parsed.spid not in self.spids:
            return False
        return self.domain is None or parsed.domain == self.domain


def _names_suffice(selector: Selector) -> bool:
    """Whether counting by names alone answers the selector exactly."""
    return (not selector.qids and selector.sender is None and selector.recipient is None
            and selector.tenantid is None and selector.jobid is None
            and selector.transportid is None
            and (selector.domain is None or len(_enc_domain(selector.domain)) < _DOMAIN_MAX))


class _LateFailure(OSError):
    """A commit failed after its first changes may have become visible."""


def _write_file(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o640)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
    except BaseException:
        os.close(fd)
        _unlink(path)
        raise
    os.close(fd)

