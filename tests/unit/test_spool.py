"""The filesystem spool: SPIDs, partitioning, streaming writes and reads."""

from __future__ import annotations

import collections
import hashlib
import os
import threading
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.spool import iter_chunks, new_spid
from sluice.spool.fs import FsSpool

pytestmark = pytest.mark.unit


def test_partition_path_walks_backwards_from_the_end(tmp_path: Path) -> None:
    spool = FsSpool(tmp_path, partitiondepth=2)
    assert spool.path("CB891D28") == tmp_path / "8" / "2" / "CB891D28.msg"
    flat = FsSpool(tmp_path / "flat", partitiondepth=0)
    assert flat.path("CB891D28") == tmp_path / "flat" / "CB891D28.msg"
    deep = FsSpool(tmp_path / "deep", partitiondepth=3)
    assert deep.path("CB891D28") == tmp_path / "deep" / "8" / "2" / "D" / "CB891D28.msg"


def test_all_partitions_exist_after_open(tmp_path: Path) -> None:
    FsSpool(tmp_path, partitiondepth=2)
    dirs = [p for p in tmp_path.glob("*/*") if p.is_dir()]
    assert len(dirs) == 256


def test_spids_are_hex_time_ordered_and_uniform_in_the_last_digits() -> None:
    spids = [new_spid(now_ms=1_800_000_000_000 + i // 100) for i in range(20000)]
    assert all(len(s) == 16 and int(s, 16) >= 0 for s in spids)
    assert spids == sorted(spids, key=lambda s: s[:11])  # time prefix orders them
    last = collections.Counter(s[-1] for s in spids)
    assert set(last) == set("0123456789ABCDEF")
    # 20000 draws over 16 buckets: expect 1250 each; 5 sigma is about +-170.
    assert all(1000 < n < 1500 for n in last.values()), last


def test_spids_are_unique_in_the_spool_even_when_drawn_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spool = FsSpool(tmp_path)
    draws = iter(["AAAAAAAAAAA00001", "AAAAAAAAAAA00001", "AAAAAAAAAAA00002"])
    monkeypatch.setattr("sluice.spool.new_spid", lambda: next(draws))  # spid_candidates draws
    first = spool.write(b"one")
    second = spool.write(b"two")  # the same SPID was drawn: draw again
    assert (first.spid, second.spid) == ("AAAAAAAAAAA00001", "AAAAAAAAAAA00002")
    spool.sync([first, second])


def test_write_sync_read_delete(tmp_path: Path) -> None:
    spool = FsSpool(tmp_path)
    f = spool.write([b"Subject: x\r\n", b"\r\n", b"body\r\n"])
    assert f.fd >= 0 and f.size == 20
    spool.sync([f])
    assert f.fd == -1
    with spool.open(f.spid) as stream:
        assert stream.read() == b"Subject: x\r\n\r\nbody\r\n"
    assert spool.exists(f.spid)
    assert [s for s, _ in spool.spids()] == [f.spid]
    spool.delete(f.spid)
    spool.delete(f.spid)  # already gone: not an error
    assert not spool.exists(f.spid)


def test_discard_removes_an_unsynced_file(tmp_path: Path) -> None:
    spool = FsSpool(tmp_path)
    f = spool.write(b"data")
    spool.discard(f)
    assert not spool.exists(f.spid)


def test_a_failing_content_source_leaves_nothing_behind(tmp_path: Path) -> None:
    spool = FsSpool(tmp_path)

    def broken() -> Iterator[bytes]:
        yield b"first piece"
        raise ConnectionResetError("client went away")

    with pytest.raises(ConnectionResetError):
        spool.write(broken())
    assert list(spool.spids()) == []


def test_chunks_never_exceed_bufsize() -> None:
    assert [len(c) for c in iter_chunks(b"x" * 20000, 8192)] == [8192, 8192, 3616]
    assert [len(c) for c in iter_chunks([b"a" * 10000, b"b"], 4096)] == [4096, 4096, 1808, 1]


class _Reader:
    """A file-like source that records the size of every read."""

    def __init__(self, total: int) -> None:
        self.left = total
        self.reads: list[int] = []

    def read(self, n: int) -> bytes:
        self.reads.append(n)
        k = min(n, self.left)
        self.left -= k
        return b"z" * k


def test_file_content_is_read_in_bufsize_pieces(tmp_path: Path) -> None:
    spool = FsSpool(tmp_path, bufsize=1024)
    src = _Reader(10_000)
    f = spool.write(src)  # type: ignore[arg-type]
    spool.sync([f])
    assert f.size == 10_000
    assert set(src.reads) == {1024}


def test_a_100mb_message_is_never_held_in_memory(tmp_path: Path) -> None:
    spool = FsSpool(tmp_path, bufsize=8192)
    piece = os.urandom(8192)
    count = (100 * 1024 * 1024) // len(piece)
    digest = hashlib.sha256()

    def pieces() -> Iterator[bytes]:
        for _ in range(count):
            digest.update(piece)
            yield piece

    tracemalloc.start()
    try:
        f = spool.write(pieces())
        spool.sync([f])
        _, write_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        check = hashlib.sha256()
        with spool.open(f.spid) as stream:
            for block in iter(lambda: stream.read(8192), b""):
                check.update(block)
        _, read_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert f.size == count * 8192
    assert check.digest() == digest.digest()
    assert write_peak < 2 * 1024 * 1024, write_peak
    assert read_peak < 2 * 1024 * 1024, read_peak


def test_deletions_that_queued_up_wait_for_one_barrier_call(tmp_path: Path) -> None:
    spool = FsSpool(tmp_path / "spool", partitiondepth=1)
    spids = []
    for _ in range(4):
        f = spool.write(iter([b"x\r\n"]))
        spool.sync([f])
        spids.append(f.spid)

    class Store:
        flushes = 0

        def flush(self) -> None:
            self.flushes += 1

    store = Store()
    gate, started = threading.Event(), threading.Event()

    def hold() -> None:  # keeps the deletion thread busy while more queues up
        started.set()
        gate.wait(5)

    spool.delete_soon(spids[:1], barrier=hold)
    assert started.wait(5)
    for spid in spids[1:]:  # a fresh bound method each time, as a store passes
        spool.delete_soon([spid], barrier=store.flush)
    gate.set()
    spool.close()
    assert store.flushes == 1
    assert not any(spool.exists(s) for s in spids)
