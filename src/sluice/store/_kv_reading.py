"""The kv flavour's readers: listing, counting, qshape, expiry, the change feed.

SUMMARY
    Reading, a part of KvStore: get, entries, count, shape, expired,
    due_at, changes_since, open_content; candidates() finds the entries
    a selector picks (the operator actions use it too).

DESCRIPTION
    Every read works on one snapshot (a listing page at a time).  A
    selection by queue ids reads those keys; one by a few states walks
    the state index keys while they hold at most INDEX_SELECT_MAX
    recipients; one by transport iterates the zone; anything else scans
    the rcpt keys in queue-id order.

SEE ALSO
    sluice.store.kv, sluice.store._kv_keys
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
from collections.abc import Iterator, Sequence
from typing import IO, Any

import plyvel

from sluice.model import QueueEntry, QueueState, Selector, parse_qid
from sluice.spool import spid_time
from sluice.store import Action, Change, Counts, StorageError
from sluice.store._kv_batch import Loader
from sluice.store._kv_db import CHUNK_SIZE, ChunkReader, Database
from sluice.store._kv_keys import (
    AGED_READY_KEY,
    CHANGE_PREFIX,
    RCPT_PREFIX,
    STAT_NAMES,
    aged_parts,
    aged_prefix,
    b,
    meta_key,
    rcpt_index,
    spid_of_rcpt_index,
    stat_key,
    state_prefix,
    zone_of,
)

#: Selections by state use the state index keys when the selected states
#: hold at most this many recipients; otherwise one scan of the rcpt keys
#: costs less than sorting that many index keys.
INDEX_SELECT_MAX = 50_000


class Reading(Database):
    """The read side of KvStore."""

    def expired(self, cutoff_at: float, reports_cutoff_at: float, limit: int = 10000
                ) -> list[QueueEntry]:
        """Deferred entries that arrived before their cutoff (see Store.expired).

        The aged index lists the deferred by arrival, reports apart, so
        each walk stops at the first entry too young for its cutoff and
        reads only the expired; a queue without that index yet is scanned
        by due time.
        """
        out: list[QueueEntry] = []
        with self._snapshot() as loader:
            if loader.reader.get(AGED_READY_KEY) is not None:
                for report, cutoff in ((False, cutoff_at), (True, reports_cutoff_at)):
                    for key, dz in loader.reader.items(aged_prefix(report)):
                        arrival, spid = aged_parts(key)
                        if arrival > cutoff:
                            break
                        rec = loader.record(dz)
                        entry = None if rec is None or rec["s"] != "deferred" \
                            else loader.entry(spid, rec)
                        if entry is not None:
                            out.append(entry)
                            if len(out) >= limit:
                                return out
                return out
            for prio in (1, 0):
                for _, dz in loader.reader.items(state_prefix(QueueState.DEFERRED, prio)):
                    rec = loader.record(dz)
                    if rec is None:
                        continue
                    spid = dz.decode().split(" ")[2]
                    entry = loader.entry(spid, rec)
                    if entry is None:
                        continue
                    cutoff = reports_cutoff_at if entry.is_report else cutoff_at
                    if entry.arrival_at <= cutoff:
                        out.append(entry)
                        if len(out) >= limit:
                            return out
        return out

    def oldest(self) -> dict[QueueState, float]:
        """The oldest entry of each state (see Store.oldest).

        The state index lists a state in queue-id order (incoming: per
        priority), so its first key is the oldest, by its SPID's time: one
        seek.  The deferred are ordered by due time there; the aged index
        has them by arrival (one seek too).  A queue without it yet (see
        kv.recover) has every deferred message's arrival read instead.
        """
        out: dict[QueueState, float] = {}
        with self._snapshot() as loader:
            if loader.reader.get(AGED_READY_KEY) is not None:
                ages = [aged_parts(key)[0] for report in (False, True)
                        for key, _ in itertools.islice(
                            loader.reader.items(aged_prefix(report)), 1)]
                if ages:
                    out[QueueState.DEFERRED] = min(ages)
            else:
                arrivals = [meta["arrival_at"] for prio in (1, 0)
                            for key, _ in loader.reader.items(
                                state_prefix(QueueState.DEFERRED, prio))
                            if (meta := loader.meta(key.rsplit(b" ", 2)[1].decode()))]
                if arrivals:
                    out[QueueState.DEFERRED] = float(min(arrivals))
            for state in QueueState:
                if state is QueueState.DEFERRED:
                    continue
                prefixes = [state_prefix(state, p) for p in (1, 0)] \
                    if state is QueueState.INCOMING else [state_prefix(state)]
                firsts = [key.rsplit(b" ", 2)[1].decode() for prefix in prefixes
                          for key, _ in itertools.islice(loader.reader.items(prefix), 1)]
                if firsts:
                    out[state] = spid_time(min(firsts))
        return out

    def due_at(self) -> float | None:
        best: float | None = None
        with self._snapshot() as loader:
            for prio in (1, 0):
                for _, dz in loader.reader.items(state_prefix(QueueState.DEFERRED, prio)):
                    rec = loader.record(dz)
                    if rec is not None:
                        best = rec["n"] if best is None else min(best, rec["n"])
                        break
        return best

    def _candidates(self, loader: Loader, selector: Selector,
                    states: Sequence[QueueState], counts: dict[str, int] | None = None,
                    after: tuple[str, int] | None = None
                    ) -> Iterator[tuple[bytes, dict[str, Any], QueueEntry]]:
        """Recipients matching ``selector`` in ``states``, in queue-id order."""
        reader = loader.reader
        wanted = set(states)

        def emit(spid: str, dz: bytes) -> Iterator[tuple[bytes, dict[str, Any], QueueEntry]]:
            rec = loader.record(dz)
            if rec is None or QueueState(rec["s"]) not in wanted:
                return
            entry = loader.entry(spid, rec)
            if entry is not None and selector.matches(entry):
                yield dz, rec, entry

        def after_cursor(spid: str, idx: int) -> bool:
            return after is None or (spid, idx) > after

        if selector.qids:
            keys: list[tuple[str, int]] = []
            for qid in selector.qids:
                spid, idx = parse_qid(qid)
                if idx is None:
                    for key, _ in reader.items(RCPT_PREFIX + b(spid) + b" "):
                        keys.append(spid_of_rcpt_index(key))
                else:
                    keys.append((spid, idx))
            for spid, idx in sorted(set(keys)):
                dz = reader.get(rcpt_index(spid, idx))
                if dz is not None and after_cursor(spid, idx):
                    yield from emit(spid, dz)
            return
        if len(wanted) < len(QueueState) and counts is not None and \
                sum(counts.get(str(s), 0) for s in wanted) <= INDEX_SELECT_MAX:
            found = []
            for state in wanted:
                for key, dz in reader.items(state_prefix(state)):
                    parts = key.decode().split(" ")
                    spid, idx = parts[-2], int(parts[-1])
                    if after_cursor(spid, idx):
                        found.append((spid, idx, dz))
            for spid, _, dz in sorted(found):
                yield from emit(spid, dz)
            return
        if selector.transportid is not None:
            found2 = []
            for dz, raw in reader.items(b(f"delivery-zone {zone_of(selector.transportid)} ")):
                rec = json.loads(raw)
                spid = dz.decode().split(" ")[2]
                if after_cursor(spid, rec["i"]):
                    found2.append((spid, rec["i"], dz))
            for spid, _, dz in sorted(found2):
                yield from emit(spid, dz)
            return
        start = None
        if after is not None:
            start = rcpt_index(after[0], after[1]) + b"\x00" if after[1] >= 0 else \
                RCPT_PREFIX + b(after[0]) + b" "
        for key, dz in reader.items(RCPT_PREFIX, start=start):
            spid, _ = spid_of_rcpt_index(key)
            yield from emit(spid, dz)

    def changes_since(self, seq: int) -> tuple[int, list[Change]]:
        out: list[Change] = []
        top = seq
        with self._snapshot() as loader:
            start = CHANGE_PREFIX + b(f"{seq + 1:012d}")
            for key, raw in loader.reader.items(CHANGE_PREFIX, start=start):
                n = int(key.rsplit(b" ", 1)[1])
                item = json.loads(raw)
                out.append(Change(n, item["qid"], Action(item["action"])))
                top = max(top, n)
        return top, out

    # -- reading ------------------------------------------------------------------------

    def get(self, qid: str) -> QueueEntry | None:
        spid, idx = parse_qid(qid)
        if idx is None:
            raise ValueError(f"get() needs a full queue id, not a SPID: {qid!r}")
        with self._snapshot() as loader:
            found = loader.by_qid(spid, idx)
            return None if found is None else loader.entry(spid, found[1])

    def _stats(self, loader: Loader) -> dict[str, int]:
        out = {}
        for name in STAT_NAMES:
            raw = loader.reader.get(stat_key(name))
            out[name] = int(raw) if raw else 0
        return out

    def entries(self, selector: Selector, *, after: str | None = None,
                limit: int | None = None) -> Iterator[QueueEntry]:
        states = selector.states or tuple(QueueState)
        cursor: tuple[str, int] | None = None
        if after is not None:
            spid, idx = parse_qid(after)
            cursor = (spid, -1 if idx is None else idx)
        remaining = limit
        page_size = 1000
        while remaining is None or remaining > 0:
            n = page_size if remaining is None else min(page_size, remaining)
            page: list[QueueEntry] = []
            with self._snapshot() as loader:
                counts = self._stats(loader)
                for _, _, entry in self._candidates(loader, selector, states, counts, cursor):
                    page.append(entry)
                    if len(page) >= n:
                        break
            yield from page
            if len(page) < n:
                return
            cursor = (page[-1].spid, page[-1].idx)
            if remaining is not None:
                remaining -= len(page)

    def count(self, selector: Selector | None = None) -> Counts:
        with self._snapshot() as loader:
            stats = self._stats(loader)
            if selector is None or selector.is_empty:
                return Counts(by_state={s: stats[str(s)] for s in QueueState},
                              messages=stats["messages"])
            by_state = {s: 0 for s in QueueState}
            spids: set[str] = set()
            states = selector.states or tuple(QueueState)
            for _, _, entry in self._candidates(loader, selector, states, stats):
                by_state[entry.state] += 1
                spids.add(entry.spid)
        return Counts(by_state=by_state, messages=len(spids))

    def shape(self, selector: Selector, now: float, edges_s: Sequence[float]
              ) -> dict[str, list[int]]:
        edges = list(edges_s)
        out: dict[str, list[int]] = {}
        with self._snapshot() as loader:
            stats = self._stats(loader)
            states = selector.states or tuple(QueueState)
            for _, _, entry in self._candidates(loader, selector, states, stats):
                age = now - entry.arrival_at
                bucket = next((i for i, e in enumerate(edges) if age < e), len(edges))
                out.setdefault(entry.domain, [0] * (len(edges) + 1))[bucket] += 1
        return out

    def open_content(self, spid: str) -> IO[bytes]:
        self._ensure_open()
        with self._rw.reading():
            try:
                if self._db is None:
                    raise RuntimeError("the queue is not open")
                snap = self._db.snapshot()
                raw = snap.get(meta_key(spid))
            except (plyvel.Error, RuntimeError) as exc:
                raise StorageError(f"cannot open the content of {spid}: {exc}") from exc
        if raw is None:
            with contextlib.suppress(plyvel.Error, RuntimeError):
                snap.close()
            raise StorageError(f"no content for {spid}")
        chunks = int(json.loads(raw)["chunks"])
        return io.BufferedReader(ChunkReader(self, spid, snap, chunks), CHUNK_SIZE)

