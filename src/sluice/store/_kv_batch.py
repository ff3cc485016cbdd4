"""The kv flavour's readers: a snapshot, and the committer's batch overlay.

SUMMARY
    SnapReader(snapshot), Batch(db) -- both Readers (get, items);
    Loader(reader) loads recipient records and their messages' metadata.

DESCRIPTION
    Readers outside the committer read one LevelDB snapshot, so a listing
    page, a count or a content stream sees one consistent state while the
    committer writes.  The committer runs every operation of a batch
    against one Batch: the database plus the batch's pending keys, merged
    into every lookup and iteration (read-your-writes inside a batch, so
    two claims of one batch never take the same recipient); an operation
    that fails is rolled back in the overlay, the others stay.

SEE ALSO
    sluice.store.kv, sluice.store._kv_db (the committer)
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from sluice.model import QueueEntry
from sluice.store._kv_keys import TOP, entry_of, meta_key, rcpt_index


class Reader(Protocol):
    def get(self, key: bytes) -> bytes | None: ...

    def items(self, prefix: bytes, start: bytes | None = None, stop: bytes | None = None
              ) -> Iterator[tuple[bytes, bytes]]: ...


class SnapReader:
    """Reads from one LevelDB snapshot: a consistent state."""

    def __init__(self, snap: Any) -> None:
        self.snap = snap

    def get(self, key: bytes) -> bytes | None:
        value: bytes | None = self.snap.get(key)
        return value

    def items(self, prefix: bytes, start: bytes | None = None, stop: bytes | None = None
              ) -> Iterator[tuple[bytes, bytes]]:
        it = self.snap.iterator(start=start or prefix, stop=stop or prefix + TOP)
        try:
            yield from it
        finally:
            it.close()


class Batch:
    """The committer's view: the database plus the batch's pending changes."""

    def __init__(self, db: Any) -> None:
        self.db = db
        self.pending: dict[bytes, bytes | None] = {}
        self._keys: list[bytes] = []  # the pending keys, sorted, for range lookups
        self.stats: dict[str, int] = {}
        self._undo: list[tuple[bytes, bool, bytes | None]] = []
        self._stats_undo: list[tuple[str, int]] = []

    def mark(self) -> tuple[int, int]:
        return len(self._undo), len(self._stats_undo)

    def rollback(self, mark: tuple[int, int]) -> None:
        while len(self._undo) > mark[0]:
            key, had, old = self._undo.pop()
            if had:
                self.pending[key] = old
            else:
                self.pending.pop(key, None)
                i = bisect.bisect_left(self._keys, key)
                if i < len(self._keys) and self._keys[i] == key:
                    del self._keys[i]
        while len(self._stats_undo) > mark[1]:
            name, delta = self._stats_undo.pop()
            self.stats[name] -= delta

    def get(self, key: bytes) -> bytes | None:
        if key in self.pending:
            return self.pending[key]
        value: bytes | None = self.db.get(key)
        return value

    def _set(self, key: bytes, value: bytes | None) -> None:
        had = key in self.pending
        self._undo.append((key, had, self.pending.get(key)))
        self.pending[key] = value
        if not had:
            bisect.insort(self._keys, key)

    def put(self, key: bytes, value: bytes) -> None:
        self._set(key, value)

    def delete(self, key: bytes) -> None:
        self._set(key, None)

    def count(self, name: str, delta: int) -> None:
        self.stats[name] = self.stats.get(name, 0) + delta
        self._stats_undo.append((name, delta))

    def items(self, prefix: bytes, start: bytes | None = None, stop: bytes | None = None
              ) -> Iterator[tuple[bytes, bytes]]:
        lo = start or prefix
        hi = stop or prefix + TOP
        extra = self._keys[bisect.bisect_left(self._keys, lo):bisect.bisect_left(self._keys, hi)]
        it = self.db.iterator(start=lo, stop=hi)
        try:
            i = 0
            for key, value in it:
                while i < len(extra) and extra[i] < key:
                    k = extra[i]
                    i += 1
                    v = self.pending.get(k)
                    if v is not None:
                        yield k, v
                if i < len(extra) and extra[i] == key:
                    i += 1
                if key in self.pending:
                    v = self.pending[key]
                    if v is None:
                        continue
                    yield key, v
                else:
                    yield key, value
            while i < len(extra):
                k = extra[i]
                i += 1
                v = self.pending.get(k)
                if v is not None:
                    yield k, v
        finally:
            it.close()




@dataclass(slots=True)
class Loader:
    """Loads recipients and their messages' metadata, caching the metadata."""

    reader: Reader
    metas: dict[str, dict[str, Any] | None] = field(default_factory=dict)

    def meta(self, spid: str) -> dict[str, Any] | None:
        if spid not in self.metas:
            raw = self.reader.get(meta_key(spid))
            self.metas[spid] = None if raw is None else json.loads(raw)
        return self.metas[spid]

    def record(self, dz: bytes) -> dict[str, Any] | None:
        raw = self.reader.get(dz)
        return None if raw is None else json.loads(raw)

    def by_qid(self, spid: str, idx: int) -> tuple[bytes, dict[str, Any]] | None:
        dz = self.reader.get(rcpt_index(spid, idx))
        if dz is None:
            return None
        rec = self.record(dz)
        return None if rec is None else (dz, rec)

    def entry(self, spid: str, rec: dict[str, Any]) -> QueueEntry | None:
        meta = self.meta(spid)
        return None if meta is None else entry_of(spid, meta, rec)


