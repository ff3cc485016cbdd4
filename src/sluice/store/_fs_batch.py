"""The filesystem flavour's batch: the tree as the operations of one commit see it.

SUMMARY
    Batch(store) -- disk plus the batch's changes; Effects (what the
    batch does to the tree); Rec, recs_of, regroup (recipients while an
    operation decides their fate, and the control files they end in).

DESCRIPTION
    The committer runs every operation of a batch against one Batch: an
    overlay of the control files the batch has read, written, moved or
    removed, and of the directory listings those change, so an operation
    sees what the ones before it in the batch did.  An operation that
    fails is undone in the overlay (begin/rollback) and leaves the others
    alone.  effects() then says what must happen on disk: files to
    create, to move (a rename, for a file that only changes state), to
    remove, and the content links to add and drop.

STRATEGIES
    Fewest changes.  swap() turns a message's control files into their new
    grouping with renames where the recipients of a file did not change,
    and rewrites only the files whose recipients did.

SEE ALSO
    sluice.store.fs (the store and its commit order), sluice.store._fs_files
"""

from __future__ import annotations

import contextlib
import heapq
import os
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from sluice.model import QueueState
from sluice.store import Action
from sluice.store._actions import Edit
from sluice.store._fs_buckets import (
    BUCKET_DIGITS,
    bucket_is_current,
    bucket_tenant,
    sorted_buckets,
)
from sluice.store._fs_due import Stamp, stamped
from sluice.store._fs_files import (
    STATE_DIRS,
    Control,
    Name,
    Rcpt,
    listdir,
    new_gen,
    parse_name,
    read_control,
    scandir,
)

if TYPE_CHECKING:
    from pathlib import Path


class Tree(Protocol):
    """Where a batch's files go: the store's root and its deferred directories."""

    root: Path

    def dir_for(self, ctrl: Control) -> str: ...

@dataclass(slots=True)
class Effects:
    creates: list[tuple[Control, str]] = field(default_factory=list)  # (control, final)
    moves: list[tuple[str, str]] = field(default_factory=list)
    unlinks: list[tuple[str, str]] = field(default_factory=list)  # (path, gen)
    ref_adds: set[tuple[str, int]] = field(default_factory=set)
    ref_drops: set[tuple[str, int]] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.creates or self.moves or self.unlinks)


class Batch:
    """The tree as the operations of one batch see it: disk plus their changes."""

    def __init__(self, store: Tree) -> None:
        self.store = store
        self.root = store.root
        self.files: dict[str, Control | None] = {}
        self.origin: dict[str, str] = {}
        self.dirty: set[str] = set()
        self.disk_gen: dict[str, str] = {}
        self._disk: dict[str, set[str]] = {}  # directory -> names on disk
        self._cur: dict[str, dict[str, Name]] = {}  # directory -> names now
        self._spids: dict[str, dict[str, set[str]]] = {}  # directory -> spid -> names
        self._deferred: set[int] | None = None
        self._buckets: set[str] | None = None  # incoming/<bucket> names on disk
        self._new_buckets: set[str] = set()  # and those the batch placed files in
        self._undo: list[Callable[[], None]] = []
        self._touched: set[str] = set()
        self.needs_journal = False
        self.changes: list[tuple[float, str, str]] = []
        self.after: list[Callable[[], None]] = []
        self.new_spids: list[str] = []  # submissions (sluice.store._fs_counts)

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

    def _dir(self, rel_dir: str) -> dict[str, Name]:
        cur = self._cur.get(rel_dir)
        if cur is None:
            cur = {}
            for n in listdir(self.root / rel_dir):
                parsed = parse_name(n)
                if parsed is not None:
                    cur[n] = parsed
            self._disk[rel_dir] = set(cur)
            self._cur[rel_dir] = cur
            if rel_dir.startswith("deferred/") and self._deferred is not None:
                self._deferred.add(int(rel_dir.split("/")[1]))
            # What the batch did to the directory before anyone listed it.
            prefix = rel_dir + "/"
            for path in [p for p in self.files if p.startswith(prefix) and "/" not in
                         p[len(prefix):]]:
                self._sync(path)
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
        """Bring the directory model in line with ``files`` for one path.

        Only for a directory this batch has listed: a submission's batch
        writes into incoming/ without listing it (a million names), and
        _dir() folds the batch's files in if it is listed later.
        """
        rel_dir, name = path.rsplit("/", 1)
        if rel_dir.startswith("deferred/") and self.files.get(path) is not None:
            self.deferred_dirs()  # make sure the set exists
            assert self._deferred is not None
            self._deferred.add(int(rel_dir.split("/")[1]))
        if rel_dir.startswith("incoming/") and self.files.get(path) is not None:
            # Not listed here: a submission's batch need not read incoming/.
            self._new_buckets.add(rel_dir.split("/")[1])
        cur = self._cur.get(rel_dir)
        if cur is None:
            return
        if path in self.files:
            present = self.files[path] is not None
        else:
            present = name in self._disk[rel_dir]
        by_spid = self._spids.get(rel_dir)
        if present and name not in cur:
            parsed = parse_name(name)
            if parsed is not None:
                cur[name] = parsed
                if by_spid is not None:
                    by_spid[parsed.spid].add(name)
        elif not present and name in cur:
            parsed = cur.pop(name)
            if by_spid is not None:
                by_spid[parsed.spid].discard(name)

    def _set(self, path: str, ctrl: Control | None, *, dirty: bool,
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

    def names(self, rel_dir: str) -> list[tuple[str, Name]]:
        """Control files of a directory (name, parsed name), with the batch's changes."""
        return list(self._dir(rel_dir).items())

    def smallest(self, rel_dir: str, k: int, key: Callable[[Name], tuple[Any, ...]]
                 ) -> tuple[list[tuple[tuple[Any, ...], str]], int]:
        """The ``k`` control files of a directory with the smallest ``key``.

        Returns them as (key, path) in order, and the recipients the directory
        holds in all.  A directory this batch has not listed is read as a stream, so a
        refill from a million files holds ``k`` of them, not all.
        """
        total = 0

        def counted() -> Iterator[tuple[tuple[Any, ...], str]]:
            nonlocal total
            for parsed, item in self.keyed(rel_dir, key):
                total += parsed.n
                yield item

        best = heapq.nsmallest(k, counted())
        return best, total

    def keyed(self, rel_dir: str, key: Callable[[Name], tuple[Any, ...]]
              ) -> Iterator[tuple[Name, tuple[tuple[Any, ...], str]]]:
        """Each control file of a directory as (parsed name, (key, path)), one at a time.

        A directory this batch has not listed is read as a stream.
        """
        if rel_dir in self._cur:
            found: Iterable[tuple[str, Name]] = self._dir(rel_dir).items()
        else:
            found = self._streamed(rel_dir)
        for name, parsed in found:
            yield parsed, (key(parsed), f"{rel_dir}/{name}")

    def first_incoming(self, k: int, key: Callable[[Name], tuple[Any, ...]], *,
                       by_tenant: bool = False) -> list[tuple[tuple[Any, ...], str]]:
        """The first ``k`` incoming control files by ``key`` (of each tenant if ``by_tenant``).

        As (key, path) in order.  ``key`` must order files the way their
        buckets are ordered (priority, then SPID), so the first buckets are
        all a refill lists: of each tenant's, if ``by_tenant``.  Old empty
        buckets it passes are removed after the batch.
        """
        lines: dict[tuple[str, str], list[str]] = defaultdict(list)
        for rel_dir in self.incoming_dirs():
            bucket = rel_dir.split("/")[1]
            tenant = bucket_tenant(bucket) if by_tenant else ""
            # A tenant whose name had to be cut is a line of its own per bucket.
            lines[("t", tenant) if tenant is not None else ("b", bucket)].append(rel_dir)
        out: list[tuple[tuple[Any, ...], str]] = []
        empty: list[str] = []
        head = len("incoming/p0-") + BUCKET_DIGITS
        for buckets in lines.values():
            # Buckets of one priority and time (one per tenant) are read together.
            groups: list[list[str]] = []
            for rel_dir in buckets:
                if groups and groups[-1][0][:head] == rel_dir[:head]:
                    groups[-1].append(rel_dir)
                else:
                    groups.append([rel_dir])
            got: list[tuple[tuple[Any, ...], str]] = []
            for group in groups:
                need = k - len(got)
                part: list[tuple[tuple[Any, ...], str]] = []
                for rel_dir in group:
                    best, _ = self.smallest(rel_dir, need, key)
                    if not best and not bucket_is_current(rel_dir.split("/")[1]):
                        empty.append(rel_dir)
                    part += best
                if len(group) > 1:
                    part.sort()
                got += part[:need]
                if len(got) >= k:
                    break
            out += got
        out.sort()
        if empty:
            root = self.root

            def rmdirs() -> None:
                for rel in empty:
                    with contextlib.suppress(OSError):
                        os.rmdir(root / rel)

            self.after.append(rmdirs)
        return out

    def _streamed(self, rel_dir: str) -> Iterator[tuple[str, Name]]:
        """A directory's control files as _dir() would have them, one at a time."""
        prefix = rel_dir + "/"
        for entry in scandir(self.root / rel_dir):
            if prefix + entry in self.files:
                continue  # the batch's own version follows
            # Not the cached parse: a million names would only churn its cache.
            parsed = parse_name.__wrapped__(entry)
            if parsed is not None:
                yield entry, parsed
        for name in self._own_names(prefix):
            parsed = parse_name(name)
            if parsed is not None:
                yield name, parsed

    def _own_names(self, prefix: str) -> list[str]:
        """Names of the control files this batch keeps in the directory ``prefix`` names."""
        return [path[len(prefix):] for path, ctrl in self.files.items()
                if ctrl is not None and path.startswith(prefix)
                and "/" not in path[len(prefix):]]

    def stamped(self, rel_dir: str) -> Iterator[tuple[str, Stamp]]:
        """A directory's control file names as _streamed() has them, with their stamps.

        Unparsed; a file of this batch has no stamp (sluice.store._fs_due).
        """
        prefix = rel_dir + "/"
        yield from stamped(self.root / rel_dir, lambda name: prefix + name in self.files)
        for name in self._own_names(prefix):
            yield name, None

    def deferred_dirs(self) -> list[int]:
        """Due times of deferred/<T> directories, ascending."""
        if self._deferred is None:
            self._deferred = {int(d) for d in listdir(self.root / "deferred") if d.isdigit()}
        return sorted(self._deferred)

    def incoming_dirs(self) -> list[str]:
        """The incoming/<bucket> directories in claim order (high priority, then oldest)."""
        if self._buckets is None:
            self._buckets = set(sorted_buckets(listdir(self.root / "incoming")))
        return [f"incoming/{b}" for b in sorted_buckets(self._buckets | self._new_buckets)]

    def state_dirs(self, states: Iterable[QueueState]) -> list[str]:
        out = []
        for state in dict.fromkeys(states):
            if state is QueueState.DEFERRED:
                out += [f"deferred/{t}" for t in self.deferred_dirs()]
            elif state is QueueState.INCOMING:
                out += self.incoming_dirs()
            else:
                out.append(STATE_DIRS[state])
        return out

    def load(self, path: str) -> Control | None:
        if path in self.files:
            ctrl = self.files[path]
            return None if ctrl is None else copy_control(ctrl)
        ctrl = read_control(self.root, path)
        if ctrl is not None:
            self.disk_gen[path] = ctrl.gen
        return ctrl

    def locate(self, spids: set[str], states: Iterable[QueueState]) -> dict[str, list[Control]]:
        """The control files of ``spids`` in the directories of ``states``."""
        out: dict[str, list[Control]] = defaultdict(list)
        for rel_dir in self.state_dirs(states):
            by_spid = self._spid_index(rel_dir)
            for spid in spids:
                for name in sorted(by_spid.get(spid, ())):
                    ctrl = self.load(f"{rel_dir}/{name}")
                    if ctrl is not None:
                        out[spid].append(ctrl)
        return out

    def locate_known(self, wanted: dict[str, set[int]], known: dict[str, set[str]],
                     states: Iterable[QueueState]
                     ) -> tuple[dict[str, list[Control]], set[str]]:
        """Control files of ``wanted`` SPIDs read where ``known`` says; the rest to locate().

        A SPID's files count as found when they hold every wanted index.
        ``known`` is where this process last put each SPID's files in
        ``states`` (FsStore notes it after each commit): reading those few
        files answers without listing a directory of thousands.  A file
        gone, moved or split by another process leaves an index unfound,
        and that SPID is looked up by listing, as before.
        """
        dirs = set(self.state_dirs(states))
        found: dict[str, list[Control]] = {}
        rest: set[str] = set()
        for spid, idxs in wanted.items():
            ctrls = [ctrl for path in sorted(known.get(spid, ()))
                     if path.rsplit("/", 1)[0] in dirs and (ctrl := self.load(path)) is not None]
            if ctrls and idxs <= {r.idx for c in ctrls for r in c.rcpts}:
                found[spid] = ctrls
            else:
                rest.add(spid)
        return found, rest

    # -- changing -----------------------------------------------------------------------

    def _place(self, ctrl: Control) -> str:
        return f"{self.store.dir_for(ctrl)}/{ctrl.name()}"

    def remove(self, ctrl: Control) -> None:
        self._set(ctrl.path, None, dirty=False)
        self._touched.add(ctrl.path)

    def write(self, ctrl: Control, *, prepared: bool = False) -> None:
        """Place a new or changed control file.

        ``prepared``: its temporary file was written (with its generation) by
        the submitter.
        """
        if not prepared:
            ctrl.prepared = ""
            ctrl.gen = new_gen()
        ctrl.path = self._place(ctrl)
        self._set(ctrl.path, ctrl, dirty=True)
        self._touched.add(ctrl.path)

    def move(self, ctrl: Control, state: QueueState) -> Control:
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

    def swap(self, originals: Sequence[Control], news: Sequence[Control]) -> None:
        """Turn the ``originals`` of one message into ``news`` with the fewest changes.

        Every original that goes is removed before anything is placed: a
        name tells the first recipient and how many, not which, so a new
        file ({0, 1}) may take the name of one that goes ({0, 3}), and
        removing that one afterwards would remove the new one.
        """
        left = {frozenset(r.idx for r in o.rcpts): o for o in originals}
        kept: list[tuple[Control, Control]] = []
        written: list[Control] = []
        for new in news:
            match = left.pop(frozenset(r.idx for r in new.rcpts), None)
            if match is not None and match.same_content(new) and match.domain == new.domain:
                kept.append((match, new))
                continue
            if match is not None:
                self.remove(match)
            written.append(new)
        for orphan in left.values():
            self.remove(orphan)
        for match, new in kept:
            if match.state is not new.state:
                self.move(match, new.state)
        for new in written:
            self.write(new)

    def add_message(self, spid: str) -> None:
        """A submission's message, for the totals."""
        self.new_spids.append(spid)

        def undo() -> None:
            self.new_spids.pop()

        self._undo.append(undo)

    def log_change(self, at: float, qid: str, action: Action) -> None:
        self.changes.append((at, qid, str(action)))
        n = len(self.changes)
        self._undo.append(lambda: self.changes.__delitem__(slice(n - 1, None)))

    # -- the result ---------------------------------------------------------------------

    def effects(self) -> Effects:
        fx = Effects()
        clean_sources = {self.origin[p] for p, c in self.files.items()
                         if c is not None and p not in self.dirty and p in self.origin}
        created_refs: dict[str, set[int]] = defaultdict(set)
        dropped_refs: dict[str, set[int]] = defaultdict(set)
        for path, ctrl in self.files.items():
            if ctrl is None:
                if path in self.disk_gen and path not in clean_sources:
                    fx.unlinks.append((path, self.disk_gen[path]))
                    parsed = Name.parse(path.rsplit("/", 1)[1])
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


def copy_control(ctrl: Control) -> Control:
    return replace(ctrl, rcpts=[replace(r) for r in ctrl.rcpts])


@dataclass(slots=True)
class Rec:
    """A recipient while an operation decides its fate."""

    rcpt: Rcpt
    state: QueueState
    next_at: float
    priority: int

    def apply(self, edit: Edit) -> None:
        """An operator action's edit (sluice.store._actions)."""
        if edit.state is not None:
            self.state = edit.state
        if edit.next_attempt_at is not None:
            self.next_at = edit.next_attempt_at
        if edit.priority is not None:
            self.priority = edit.priority
        if edit.last_reply is not None:
            self.rcpt.reply = edit.last_reply


def regroup(ctrls: Sequence[Control], recs: dict[int, Rec | None]) -> list[Control]:
    """New control files for the surviving recipients of ``ctrls`` (one message)."""
    groups: dict[tuple[str, QueueState, float, int], list[Rcpt]] = defaultdict(list)
    template: dict[str, Control] = {}
    for ctrl in ctrls:
        template.setdefault(ctrl.domain, ctrl)
        for r in ctrl.rcpts:
            rec = recs.get(r.idx, Rec(r, ctrl.state, ctrl.next_at, ctrl.priority))
            if rec is None:
                continue
            groups[(ctrl.domain, rec.state, rec.next_at, rec.priority)].append(rec.rcpt)
    out = []
    for (domain, state, next_at, prio), rcpts in groups.items():
        base = template[domain]
        out.append(Control(base.spid, domain, state, next_at, prio, base.meta,
                            sorted(rcpts, key=lambda r: r.idx)))
    return out


def recs_of(ctrls: Sequence[Control]) -> dict[int, Rec | None]:
    return {r.idx: Rec(replace(r), c.state, c.next_at, c.priority)
            for c in ctrls for r in c.rcpts}


