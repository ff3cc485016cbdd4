"""The kv flavour's aged index: the deferred by arrival, kept whole across versions.

SUMMARY
    age(loader, spid); mark_if_nothing_deferred(db) (at open);
    ensure_index(db) (in recover(), before it changes anything).

DESCRIPTION
    ``sluice aged r|m <ARRIVAL> <SPID> <IDX6>`` (sluice.store._kv_keys)
    lists every deferred recipient by its message's arrival, reports
    apart, so that the oldest deferred entry and the expiry sweep read
    only what they need (sluice.store._kv_reading).  The store's batches
    keep it with the state keys (sluice.store.kv).  This module keeps it
    whole for a queue that a version without it wrote: the marker
    ``sluice layout aged`` says the index is complete; an empty deferred
    state is complete as it is; otherwise recover() checks it and builds
    it again.

STRATEGIES
    An order-free checksum.  The aged keys and the deferred state keys
    sort the recipients differently, so each side is summed (a hash per
    "<SPID> <IDX6>", modulo 2**64) and counted: two key scans at a start,
    beside the recount recover() makes anyway.  It catches an older
    version that deferred one entry and claimed another, which leaves the
    counts equal.

    Built beside the overlay.  A million deferred entries would not fit
    one batch's overlay, so the keys go straight into LevelDB in batches
    of 10,000.  The marker goes first, with the old keys, and comes back
    last: readers scan the deferred index meanwhile, and a crash part-way
    only means that the next start builds it again.

SEE ALSO
    sluice.store.kv (the layout), sluice.store._kv_keys (the keys)
"""

from __future__ import annotations

import json
from typing import Any

from sluice.model import QueueState
from sluice.store._kv_batch import Loader
from sluice.store._kv_keys import (
    AGED_PREFIX,
    AGED_READY_KEY,
    Age,
    age_of,
    aged_key,
    meta_key,
    state_prefix,
)

__all__ = ["age", "ensure_index", "mark_if_nothing_deferred"]

_DEFERRED = state_prefix(QueueState.DEFERRED)


def age(loader: Loader, spid: str) -> Age:
    """A message's age, from its metadata as ``loader`` has it."""
    return age_of(loader.meta(spid))


def mark_if_nothing_deferred(db: Any) -> None:
    """At open: a queue with nothing deferred has its aged index complete already."""
    if db.get(AGED_READY_KEY) is None and next(
            db.iterator(prefix=_DEFERRED, include_value=False), None) is None:
        db.put(AGED_READY_KEY, b"1", sync=True)


def ensure_index(db: Any) -> None:
    """Build the aged index again unless it is marked complete and matches the deferred."""
    if not _complete(db):
        _build(db)


def _complete(db: Any) -> bool:
    if db.get(AGED_READY_KEY) is None:
        return False

    def checksum(prefix: bytes) -> tuple[int, int]:
        # An aged key ends "<SPID> <IDX6>", as a deferred state key does.
        n = total = 0
        for key in db.iterator(prefix=prefix, include_value=False):
            _, spid, idx = key.rsplit(b" ", 2)
            n += 1
            total = (total + hash((spid, idx))) & 0xFFFFFFFFFFFFFFFF
        return n, total

    return checksum(AGED_PREFIX) == checksum(_DEFERRED)


def _build(db: Any, chunk: int = 10_000) -> None:
    with db.write_batch() as wb:
        wb.delete(AGED_READY_KEY)
        for key in db.iterator(prefix=AGED_PREFIX, include_value=False):
            wb.delete(key)
    ages: dict[str, Age] = {}  # by SPID: the metadata is read once a message
    wb = db.write_batch()
    for n, (key, dz) in enumerate(db.iterator(prefix=_DEFERRED), 1):
        spid, idx = key.decode().rsplit(" ", 2)[1:]
        got = ages.get(spid)
        if got is None:
            raw = db.get(meta_key(spid))
            got = ages[spid] = age_of(None if raw is None else json.loads(raw))
        wb.put(aged_key(got, spid, int(idx)), dz)
        if n % chunk == 0:
            wb.write()
            wb = db.write_batch()
    wb.put(AGED_READY_KEY, b"1")
    wb.write()
