"""ZoneMTA's LevelDB layout as a meta queue and spool in one: the ``kv`` flavour.

SUMMARY
    KvStore(path, node_id=..., max_batch=...) implements sluice.store.Store
    on LevelDB (plyvel).  ``queue.path`` is the LevelDB directory.

DESCRIPTION
    Keys are ZoneMTA's (seeds/002), with the message id being the SPID:

    message <SPID> 000001 ...    the content in 64 KB chunks, in arrival
                                 order, numbered from 1.
    message <SPID> #             the message exists; its creation time.
    message <SPID> *             JSON metadata: envelope sender, the
                                 recipients in envelope order, tenantid,
                                 jobid, transportid, localip, size, number
                                 of chunks, arrival time, report flag,
                                 SMTPUTF8 flag (absent in older metadata:
                                 false).
    delivery-zone <ZONE> <SPID> <RCPT>
                                 one per recipient, JSON: envelope index,
                                 state, next attempt, attempts, last reply,
                                 priority.  Iterating ``delivery-zone <ZONE> ``
                                 walks a zone's recipients from the oldest
                                 message (SPIDs sort by arrival).

    The zone.  In ZoneMTA a sending zone is a named pool of outbound
    addresses chosen per message; Sluice's equivalent is the ``transportid``
    (Halon's choice of transport and source IPs), so the zone is the
    transportid, or ``default`` when there is none.  Selections by
    transport iterate the zone.  (A second copy of the same address in one
    envelope gets `` #<index>`` after it, so that keys stay unique.)

    ZoneMTA iterates zones and skips what is not due; Sluice's refill needs
    new mail apart from deferred mail, due times and priorities, so the
    extra keys below (all under ``sluice ``, all written in the same atomic
    batch as the recipient keys they describe) index the states:

    sluice rcpt <SPID> <IDX6>            -> the delivery-zone key (listing in
                                            queue-id order, get, apply)
    sluice queue incoming <P> <SPID> <IDX6>           refill, FIFO
    sluice queue deferred <P> <DUE> <SPID> <IDX6>     refill by due time
    sluice queue hold|active|delivering|bounce <SPID> <IDX6>
    sluice aged r|m <ARRIVAL> <SPID> <IDX6>
                                         deferred again, by arrival,
                                         reports (r) apart: the oldest
                                         deferred entry and expiry read
                                         only what they need
    sluice stat <state>|messages         counts for qcount
    sluice change <SEQ12>                operator change feed (JSON)
    sluice pending <SPID>                content being written, not yet
                                         committed (removed by the commit;
                                         leftovers are swept by recover)

    <P> is 0 for priority 1 and 1 for priority 0, so that urgent mail comes
    first; <DUE> is the next attempt time as %017.6f seconds, so that keys
    sort by it; the index keys' values are the delivery-zone key.

STRATEGIES
    Content first, then meta, one synchronous batch.  A submitter streams
    its content into chunk keys as it arrives (plain writes, not synced)
    and then hands the meta keys to the committer thread.  The committer
    takes every operation that queued up, makes the content of the batch
    durable by fsyncing LevelDB's log files (one fsync round for the whole
    batch: a synchronous write only syncs the current log, and chunks may
    sit in the previous one if LevelDB switched logs meanwhile), and then
    writes all the batch's meta keys, index keys and counters in one
    WriteBatch and syncs the log files again.  ZoneMTA lost data on
    recovery with unsynced writes; here a message is visible only through
    keys of a synced atomic batch whose content was already on disk.
    Claims and "delivering" marks are not synced (sluice.store._kv_db).

    Read-your-writes inside a batch: operations of one batch see each
    other's changes through an overlay of pending keys merged into every
    lookup and iteration, so two claims in one batch never take the same
    recipient; an operation that fails is rolled back in the overlay.

    Deletion (ZoneMTA): when the last recipient of a message goes, all of
    its keys go in the same batch -- chunks, ``#``, ``*``.

    Errors.  LevelDB refuses writes after some I/O errors, and a failed
    write may leave a torn record in its log; so after any write error the
    database is closed and reopened (which replays the log) before the
    next write, and a batch that follows a reopen checks that the content
    of its submissions survived it.  A full disk is a StorageError (451)
    until space is freed.

    Readers use LevelDB snapshots: a listing page, a count or a content
    stream sees one consistent state while the committer writes.

INVARIANTS
    Every recipient key has exactly one state index key and one rcpt key,
    and an aged key if and only if it is deferred (once ``sluice layout
    aged`` is there: recover() builds the aged keys of a queue written
    without them).
    The ``sluice stat`` counters equal the index keys per state.  A message
    has its ``#``/``*`` keys and its chunks as long as a recipient key
    exists.

LIMITATIONS
    LevelDB locks its directory: one process only (``shared_access`` is
    False), so ``sluice qlist`` cannot open the queue while ``sluice serve``
    runs on it (use the API).  Selections by sender, tenant or job scan
    every recipient.

PARTS
    This file keeps the store's operations; the nouns they use are in
    _kv_keys (the key scheme and records), _kv_batch (snapshot readers and
    the committer's overlay), _kv_db (LevelDB, its reopening, the
    committer, content chunks), _kv_reading (listing, counting,
    qshape, expiry, the change feed) and _kv_aged (the aged index kept
    whole across versions).

SEE ALSO
    sluice.store (the interface), sluice.store._actions (operator
    actions), seeds/002 (ZoneMTA), docs/storage.md.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice.store import StorageError

try:
    import plyvel
except ImportError as exc:  # an optional extra: say which
    raise StorageError("the kv store needs plyvel: pip install 'sluice-mta[kv]'") from exc

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
)
from sluice.spool import Content
from sluice.store import CHANGES_KEEP_S, Action, ApplyByFuture, Transition, applied_nothing
from sluice.store import _kv_aged as aged
from sluice.store._actions import OperatorChange
from sluice.store._commit import GroupCommitter, RWLock
from sluice.store._kv_batch import Batch, Loader, Reader
from sluice.store._kv_db import CHUNK_SIZE, Submit
from sluice.store._kv_keys import (
    CHANGE_PREFIX,
    PENDING_PREFIX,
    RCPT_PREFIX,
    STAT_NAMES,
    aged_key,
    b,
    chunk_key,
    due_key,
    dumps,
    dz_key,
    edited,
    exists_key,
    index_keys,
    meta_key,
    rcpt_index,
    rcpt_keys,
    state_key,
    state_prefix,
    zone_of,
)
from sluice.store._kv_reading import Reading
from sluice.store._refill import (
    EQUAL,
    TenantMemo,
    TenantWeights,
    fair_pick,
    interleave,
    split_quota,
)

if TYPE_CHECKING:
    from sluice.config import Config

__all__ = ["CHUNK_SIZE", "KvStore"]


# --------------------------------------------------------------------------
# The store


#: The most keys of one side (incoming, due deferred) a refill reads to share
#: it between tenants: this many times its limit, and at least SCAN_MIN.
SCAN_PER_PICK, SCAN_MIN = 64, 10_000


class KvStore(ApplyByFuture, Reading):
    """Meta queue and content in LevelDB, ZoneMTA's layout; see the module doc."""

    flavour = "kv"
    shared_access = False
    inline_max = 0  # content always goes to body chunks, whatever its size
    #: Tenants' weights for sharing a refill (from_config: scheduler.tenants).
    tenant_weights: TenantWeights = EQUAL

    def __init__(self, path: str | os.PathLike[str], *, node_id: str = "local",
                 max_batch: int = 2000) -> None:
        self.dir = Path(path)
        self.node_id = node_id
        self._rw = RWLock()
        self._wlock = threading.Lock()
        self._broken = False
        self._reopened = False
        self._inflight: set[str] = set()
        self._inflight_lock = threading.Lock()
        self._tenants = TenantMemo()  # SPID -> tenant, for refills
        self._closed = False
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create the queue directory {self.dir}: {exc}") from exc
        self._db: Any | None = self._open_db()
        try:
            db = self._open_handle()
            last = next(db.iterator(prefix=CHANGE_PREFIX, reverse=True,
                                    include_value=False), None)
            aged.mark_if_nothing_deferred(db)
        except plyvel.Error as exc:
            raise StorageError(f"cannot read the queue at {self.dir}: {exc}") from exc
        self._seq = int(last.rsplit(b" ", 1)[1]) if last else 0
        self._committer = GroupCommitter(
            self._commit, max_batch=max_batch, name="sluice-kv-commit",
            dropped=lambda op: self._drop_content(op.extra)
            if isinstance(op.extra, Submit) else None)

    @classmethod
    def from_config(cls, config: Config) -> KvStore:
        """The store the queue section of a configuration describes."""
        q = config.queue
        store = cls(q.path, node_id=config.node.id, max_batch=q.commit_max_batch)
        store.tenant_weights = TenantWeights.of(config.scheduler.tenants)
        return store

    def submit_future(self, submission: Submission, content: Content, now: float
                      ) -> concurrent.futures.Future[Accepted]:
        """Store.submit_future: content chunks written now, the keys by the committer."""
        if self._closed:
            raise StorageError("the store is closed")
        sub = self._write_content(content, submission.spid)
        spid = sub.spid
        state, next_at = submission.initial_state(now)
        rcpts = list(submission.recipients)
        zone = zone_of(submission.transportid)
        keys = rcpt_keys(rcpts)
        size = sub.size
        meta = {
            "sender": submission.sender, "rcpts": rcpts, "zone": zone,
            "tenantid": submission.tenantid, "jobid": submission.jobid,
            "transportid": submission.transportid, "localip": list(submission.localip),
            "is_report": submission.is_report, "size": size, "chunks": sub.chunks,
            "arrival_at": now, "smtputf8": submission.smtputf8,
        }
        accepted = Accepted(spid=spid, qids=tuple(format_qid(spid, i) for i in range(len(rcpts))),
                            size=size)

        def work(view: Batch) -> Accepted:
            view.put(exists_key(spid), repr(now).encode())
            view.put(meta_key(spid), dumps(meta))
            for i, key in enumerate(keys):
                dz = dz_key(zone, spid, key)
                rec = {"i": i, "s": str(state), "n": next_at, "a": 0, "r": None,
                       "p": submission.priority}
                view.put(dz, dumps(rec))
                view.put(rcpt_index(spid, i), dz)
                for ikey in index_keys(spid, i, rec, (now, submission.is_report)):
                    view.put(ikey, dz)
            view.count(str(state), len(keys))
            view.count("messages", 1)
            view.delete(PENDING_PREFIX + b(spid))
            return accepted

        try:
            return self._op(work, extra=sub)
        except BaseException:
            self._drop_content(sub)
            raise

    def submit(self, submission: Submission, content: Content, now: float) -> Accepted:
        """Store.submit: submit_future(), waited for."""
        result: Accepted = self.submit_future(submission, content, now).result()
        return result

    # -- the queue manager's side -------------------------------------------------------

    def _claimable(self, reader: Reader, now: float) -> bool:
        if next(reader.items(state_prefix(QueueState.INCOMING)), None) is not None:
            return True
        for prio in (1, 0):
            prefix = state_prefix(QueueState.DEFERRED, prio)
            if next(reader.items(prefix, stop=prefix + b(due_key(now)) + b"~"), None):
                return True
        return False

    def _refill_candidates(self, view: Batch, loader: Loader, state: QueueState,
                           due: float | None, limit: int
                           ) -> list[tuple[bytes, bytes, dict[str, Any]]]:
        """Up to ``limit`` of a refill's (key, dz, record) in ``state``, shared by tenant.

        Each tenant's priority 1 first, then in key order (oldest, or due
        first); at most ``limit`` read of each, among the first
        ``max(SCAN_PER_PICK * limit, SCAN_MIN)`` keys (a bounded walk: no
        index by tenant).  Not fair: the first ``limit`` keys, as if all
        were one tenant.
        """
        weights = self.tenant_weights
        by_tenant: dict[str, list[tuple[bytes, bytes, dict[str, Any]]]] = {}
        n = 0
        budget = max(SCAN_PER_PICK * limit, SCAN_MIN)
        for prio in (1, 0):
            prefix = state_prefix(state, prio)
            stop = None if due is None else prefix + b(due_key(due)) + b"~"
            for key, dz in view.items(prefix, stop=stop):
                if (not weights.fair and n >= limit) or budget <= 0:
                    break
                budget -= 1
                spid = key.decode().rsplit(" ", 2)[1]
                line = by_tenant.setdefault(self._tenant_of(loader, spid), [])
                if len(line) >= limit:
                    continue
                rec = loader.record(dz)
                if rec is not None and (due is None or rec["n"] <= due):
                    line.append((key, dz, rec))
                    n += 1
        return fair_pick(by_tenant, weights, limit)

    def _tenant_of(self, loader: Loader, spid: str) -> str:
        """The tenant of message ``spid`` ("" for all when not fair), remembered."""
        if not self.tenant_weights.fair:
            return ""

        def read() -> str:
            meta = loader.meta(spid)
            return str(meta.get("tenantid") or "") if meta is not None else ""

        return self._tenants.get(spid, read)

    def claim(self, limit: int, now: float, quota_deferred: int) -> list[QueueEntry]:
        """Store.claim over the incoming and due deferred keys.

        A queue manager polls often: "nothing" is answered from a snapshot.
        """
        if limit <= 0:
            return []
        # A queue manager polls often; answer "nothing" from a snapshot.
        with self._snapshot() as loader:
            if not self._claimable(loader.reader, now):
                return []

        def work(view: Batch) -> list[QueueEntry]:
            loader = Loader(view)
            incoming = self._refill_candidates(view, loader, QueueState.INCOMING, None, limit)
            deferred = self._refill_candidates(view, loader, QueueState.DEFERRED, now, limit)
            take_d, take_i = split_quota(limit, len(incoming), len(deferred), quota_deferred)
            out = []
            for key, dz, rec in interleave(incoming[:take_i], deferred[:take_d]):
                spid = key.decode().rsplit(" ", 2)[1]
                view.delete(key)
                if rec["s"] == "deferred":
                    view.delete(aged_key(aged.age(loader, spid), spid, rec["i"]))
                view.count(rec["s"], -1)
                rec["s"] = "active"
                view.count("active", 1)
                view.put(dz, dumps(rec))
                view.put(state_key(spid, rec["i"], rec), dz)
                entry = loader.entry(spid, rec)
                if entry is not None:
                    out.append(entry)
            return out

        # A claim lost in a power cut leaves its entries queued: not synced.
        result: list[QueueEntry] = self._call(work, durable=False)
        return result

    def _change_state(self, loader: Loader, view: Batch, spid: str, dz: bytes,
                      rec: dict[str, Any], new: dict[str, Any] | None, gone: set[str]
                      ) -> None:
        """Replace one recipient's record (None: it leaves the queue)."""
        idx = rec["i"]
        # The message's age, for the aged key of a deferred record (the
        # metadata is read only then, once per message and batch).
        age = aged.age(loader, spid) if "deferred" in (rec["s"], new and new["s"]) else (0.0, False)
        for key in index_keys(spid, idx, rec, age):
            view.delete(key)
        view.count(rec["s"], -1)
        if new is None:
            view.delete(dz)
            view.delete(rcpt_index(spid, idx))
            gone.add(spid)
            return
        view.put(dz, dumps(new))
        for key in index_keys(spid, idx, new, age):
            view.put(key, dz)
        view.count(new["s"], 1)

    def _collect_gone(self, view: Batch, spids: Iterable[str]) -> None:
        """Remove every key of the messages that have no recipient left."""
        for spid in spids:
            if next(view.items(RCPT_PREFIX + b(spid) + b" "), None) is not None:
                continue
            raw = view.get(meta_key(spid))
            chunks = json.loads(raw)["chunks"] if raw else 0
            for n in range(1, chunks + 1):
                view.delete(chunk_key(spid, n))
            view.delete(exists_key(spid))
            view.delete(meta_key(spid))
            view.count("messages", -1)

    def apply_future(self, transitions: Sequence[Transition], *, durable: bool = True,
                     flush_soon: bool = False) -> concurrent.futures.Future[set[str]]:
        """Store.apply_future: the state keys and stats of each entry changed in one batch."""
        if not transitions:
            return applied_nothing()
        items = []
        for t in transitions:
            spid, idx = parse_qid(t.qid)
            if idx is None:
                raise ValueError(f"a transition needs a full queue id, not {t.qid!r}")
            items.append((spid, idx, t))

        def work(view: Batch) -> set[str]:
            loader = Loader(view)
            applied: set[str] = set()
            gone: set[str] = set()
            for spid, idx, t in items:
                found = loader.by_qid(spid, idx)
                if found is None:
                    continue
                dz, rec = found
                if t.expect and QueueState(rec["s"]) not in t.expect:
                    continue
                new: dict[str, Any] | None = None
                if t.state is not None:
                    new = dict(rec)
                    new["s"] = str(t.state)
                    if t.next_attempt_at is not None:
                        new["n"] = t.next_attempt_at
                    if t.reply is not None:
                        new["r"] = t.reply.to_record()
                    if t.attempted:
                        new["a"] = rec["a"] + 1
                self._change_state(loader, view, spid, dz, rec, new, gone)
                applied.add(t.qid)
            self._collect_gone(view, gone)
            return applied

        return self._op(work, durable=durable, soon=flush_soon)

    def claim_bounces(self, limit: int, now: float, lease_s: float) -> list[QueueEntry]:
        """Store.claim_bounces: bounce keys due, leased by moving their due time."""
        if limit <= 0:
            return []
        until = now + lease_s

        def work(view: Batch) -> list[QueueEntry]:
            loader = Loader(view)
            out: list[QueueEntry] = []
            for key, dz in list(view.items(state_prefix(QueueState.BOUNCE))):
                if len(out) >= limit:
                    break
                rec = loader.record(dz)
                if rec is None or rec["n"] > now:
                    continue
                spid = key.decode().split(" ")[3]
                new = dict(rec, n=until)
                self._change_state(loader, view, spid, dz, rec, new, set())
                entry = loader.entry(spid, new)
                if entry is not None:
                    out.append(entry)
            return out

        result: list[QueueEntry] = self._call(work)
        return result

    def recover(self, now: float) -> int:
        """Store.recover: in-flight entries back to deferred, due now.

        Also removes content whose submission never committed and old operator
        changes, and counts the stats again.
        """
        def work(view: Batch) -> int:
            aged.ensure_index(view.db)
            loader = Loader(view)
            moved = 0
            for state in IN_FLIGHT_STATES:
                for key, dz in list(view.items(state_prefix(state))):
                    rec = loader.record(dz)
                    if rec is None:
                        view.delete(key)
                        continue
                    spid = key.decode().split(" ")[3]
                    new = dict(rec, s="deferred", n=now)
                    self._change_state(loader, view, spid, dz, rec, new, set())
                    moved += 1
            # Content whose submission never committed (a crash mid-stream).
            # Which submissions are under way is asked now, in the committer,
            # not before: a receiver may already be streaming a message whose
            # record commits after this batch (a snapshot taken earlier would
            # not name it, and its content would go while its record stays).
            for key, _ in list(view.items(PENDING_PREFIX)):
                spid = key[len(PENDING_PREFIX):].decode()
                with self._inflight_lock:
                    busy = spid in self._inflight
                if busy:
                    continue
                if view.get(exists_key(spid)) is None:
                    prefix = b(f"message {spid} ")
                    for ckey, _ in list(view.items(prefix)):
                        view.delete(ckey)
                view.delete(key)
            # Old operator changes.
            for key, raw in list(view.items(CHANGE_PREFIX)):
                if json.loads(raw)["at"] >= now - CHANGES_KEEP_S:
                    break
                view.delete(key)
            # Recount, as insurance against counters left wrong by an older version.
            counts = {name: 0 for name in STAT_NAMES}
            for state in QueueState:
                counts[str(state)] = sum(1 for _ in view.items(state_prefix(state)))
            last = None
            for key, _ in view.items(RCPT_PREFIX):
                spid = key.decode().split(" ")[2]
                if spid != last:
                    counts["messages"] += 1
                    last = spid
            current = self._read_stats(view.db)
            for name in STAT_NAMES:
                view.count(name, counts[name] - current.get(name, 0) - view.stats.get(name, 0))
            return moved

        result: int = self._call(work)
        return result

    # -- operator side ------------------------------------------------------------------

    def modify(self, selector: Selector, action: Action, now: float,
               priority: int | None = None, reply: Reply | None = None) -> list[QueueEntry]:
        """Store.modify over the candidate keys of the selector, the stats kept in step."""
        change = OperatorChange(action, now, priority, reply)
        states = tuple(s for s in change.states if not selector.states or s in selector.states)

        def work(view: Batch) -> list[QueueEntry]:
            loader = Loader(view)
            counts = self._read_stats(view.db)
            for name, delta in view.stats.items():
                counts[name] = counts.get(name, 0) + delta
            found = list(self._candidates(loader, selector, states, counts))
            gone: set[str] = set()
            entries = []
            for dz, rec, entry in found:
                spid = entry.spid
                edit = change.edit(rec["a"])
                new = None if edit is None else edited(rec, edit)
                self._change_state(loader, view, spid, dz, rec, new, gone)
                self._seq += 1
                view.put(CHANGE_PREFIX + b(f"{self._seq:012d}"),
                         dumps({"at": now, "qid": entry.qid, "action": str(action)}))
                entries.append(entry)
            self._collect_gone(view, gone)
            return entries

        seq_before = self._seq
        try:
            result: list[QueueEntry] = self._call(work)
        except BaseException:
            self._seq = max(self._seq, seq_before)
            raise
        return result

    # -- life ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the committer and close the database."""
        if self._closed:
            return
        self._committer.close()
        self._closed = True
        with self._rw.writing(), contextlib.suppress(plyvel.Error, RuntimeError):
            if self._db is not None:
                self._db.close()

    def __enter__(self) -> KvStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
