"""Spool segments under three processes: two writers, and a manager that delivers and compacts.

The lock protocol of sluice.spool.segments is tested piece by piece in
test_spool_segments.py.  Here it runs whole, as `serve` runs it: two
receiving processes append big contents to segments of their own (small
segments, so that they rotate and seal all the time) while the queue
manager's process claims, delivers or defers, compacts every segment it may
and reads back what is queued.  Each content carries its own name, so every
read checks the bytes it got against the ones that were written.  At the
end no queued content is lost or changed, and after a restart no segment is
left that no message needs.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import random
import sqlite3
import time
from pathlib import Path
from typing import Any

from sluice.model import QueueState, Submission
from sluice.spool.segments import segment_name
from sluice.store import Transition
from sluice.store.sqlite import SqliteStore
from tests.integration.stores import open_flavour

MSG = Submission("a@example.org", ("b@example.net",))
SPOOL = {"inline_max": 100, "segment_max": 120_000, "segment_age": 0.3}
WRITERS = 2
EACH = 150


def _content(writer: int, i: int) -> bytes:
    """A content that names itself: its first line says how to make the rest."""
    head = f"{writer}:{i}\r\n".encode()
    size = 2_000 + (writer * 7919 + i * 104_729) % 38_000
    seed = hashlib.sha256(head).digest()
    return head + (seed * (size // len(seed) + 1))[:size]


def _check(data: bytes) -> None:
    writer, i = (int(x) for x in data.split(b"\r\n", 1)[0].split(b":"))
    assert data == _content(writer, i), f"content {writer}:{i} read back changed"


def _store(root: Path) -> SqliteStore:
    store = open_flavour("sqlite", root, queue={"spool": dict(SPOOL)})
    assert isinstance(store, SqliteStore)
    return store


def _write(root: str, writer: int, done: Any) -> None:
    """A receiving process: EACH big contents, one at a time, each durable when it returns."""
    with _store(Path(root)) as store:
        for i in range(EACH):
            store.submit(MSG, _content(writer, i), time.time())
            time.sleep(0.002)
    done.put(writer)


def _read_queued(store: SqliteStore, spids: list[str]) -> int:
    for spid in spids:
        with store.open_content(spid) as stream:
            _check(stream.read())
    return len(spids)


def _queued_spids(store: SqliteStore) -> list[str]:
    with sqlite3.connect(store.db_path) as conn:
        return [f"{i:016X}" for i, in conn.execute("SELECT id FROM content_at")]


def test_writers_a_manager_and_its_compaction_lose_nothing(tmp_path: Path) -> None:
    rng = random.Random(5)
    ctx = multiprocessing.get_context("spawn")
    done: multiprocessing.Queue[int] = ctx.Queue()
    with _store(tmp_path) as manager:
        manager.recover(time.time())
        writers = [ctx.Process(target=_write, args=(str(tmp_path), w, done))
                   for w in range(WRITERS)]
        for p in writers:
            p.start()
        delivered = deferred = compacted = reads = 0
        finished = 0
        try:
            while finished < WRITERS:
                while not done.empty():
                    done.get()
                    finished += 1
                now = time.time()
                outcomes = []
                for entry in manager.claim(50, now, 50):
                    with manager.open_large(entry.spid) as stream:
                        _check(stream.read())  # what a delivery would send
                    reads += 1
                    if rng.random() < 0.8:
                        outcomes.append(Transition(entry.qid, None))
                        delivered += 1
                    else:  # stays queued, in a segment that otherwise empties
                        outcomes.append(Transition(entry.qid, QueueState.DEFERRED,
                                                   next_attempt_at=now + 86_400))
                        deferred += 1
                manager.apply(outcomes)
                # Every segment counts as old: whatever is under half queued moves.
                compacted += manager.compact_segments(now + 3_600)
                queued = _queued_spids(manager)
                reads += _read_queued(manager, rng.sample(queued, min(10, len(queued))))
                time.sleep(0.01)
        finally:
            for p in writers:
                p.join(timeout=60)
        assert all(p.exitcode == 0 for p in writers)
        # What arrived after the last claim goes too, then the deferred ones stay.
        entries = manager.claim(10_000, time.time(), 10_000)
        for entry in entries:
            with manager.open_large(entry.spid) as stream:
                _check(stream.read())
        manager.apply([Transition(e.qid, None) for e in entries])
        delivered += len(entries)
        compacted += manager.compact_segments(time.time() + 3_600)
        queued = _queued_spids(manager)
        assert delivered + deferred == WRITERS * EACH
        assert len(queued) == deferred == manager.count().messages
        assert _read_queued(manager, queued) == deferred
        assert compacted > 0 and reads > delivered
    # After a restart only the segments that hold a deferred content are left.
    with _store(tmp_path) as manager:
        manager.recover(time.time())
        with sqlite3.connect(manager.db_path) as conn:
            needed = {segment_name(s) for s, in conn.execute("SELECT DISTINCT seg FROM content_at")}
        on_disk = {p.name for p in (tmp_path / "spool" / "segments").iterdir()}
        assert on_disk == needed
        assert _read_queued(manager, _queued_spids(manager)) == deferred
