"""Spool segments on a real file system: appends, locks, seals and sweeps.

What sluice.spool.segments promises: each content reads back as written;
a segment a writer may still fill is never swept; a sealed one goes only
when nothing refers to it, and only after the store's barrier; an idle
active segment retires on its own; a dead writer's files are cleaned up.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sluice.spool import SpoolIOError
from sluice.spool.segments import Segments, segment_number


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _segments(tmp_path: Path, **kw: object) -> tuple[Segments, Clock, set[int], list[str]]:
    """Segments whose store says ``refs`` are referenced, and logs barrier calls."""
    clock = Clock()
    segs = Segments(tmp_path, clock=clock, **kw)  # type: ignore[arg-type]
    refs: set[int] = set()
    log: list[str] = []

    def referenced(numbers: list[int]) -> set[int]:
        log.append("referenced")
        return refs & set(numbers)

    def barrier() -> None:
        log.append("barrier")

    segs.bind(referenced, barrier)
    return segs, clock, refs, log


def _is_locked(path: str) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_contents_read_back_as_written_side_by_side(tmp_path: Path) -> None:
    segs, *_ = _segments(tmp_path)
    bodies = [os.urandom(n) for n in (1, 100_000, 8191, 8192, 300_001)]
    files = [segs.write([b[:7], memoryview(b)[7:]], len(b)) for b in bodies]
    segs.sync(files)
    assert len({f.path for f in files}) == 1
    assert [f.offset for f in files] == [sum(map(len, bodies[:i])) for i in range(5)]
    for f, body in zip(files, bodies, strict=True):
        with segs.open(segment_number(f.path), f.offset, f.size) as fh:
            pieces = []
            while piece := fh.read(5000):
                pieces.append(piece)
        assert b"".join(pieces) == body
    segs.settle(files)
    segs.close()


def test_a_range_cut_short_on_disk_is_an_error_not_short_content(tmp_path: Path) -> None:
    segs, *_ = _segments(tmp_path)
    f = segs.write([b"x" * 1000], 1000)
    segs.sync([f])
    os.truncate(f.path, 600)
    with (segs.open(segment_number(f.path), f.offset, f.size) as fh,
          pytest.raises(OSError, match="early")):
        fh.read()
    segs.settle([f])
    segs.close()


def test_a_full_segment_is_retired_and_sealed_when_its_last_write_settles(
        tmp_path: Path) -> None:
    segs, _, refs, _ = _segments(tmp_path, segment_max=100_000)
    a = segs.write([b"a" * 60_000], 60_000)
    b = segs.write([b"b" * 60_000], 60_000)  # still fits: the check is before the write
    c = segs.write([b"c" * 10], 10)          # the first is full: a new segment
    assert a.path == b.path != c.path
    refs.update({segment_number(a.path), segment_number(c.path)})
    assert _is_locked(a.path) and _is_locked(c.path)
    segs.settle([a])
    assert _is_locked(a.path)               # b is not settled yet
    segs.settle([b])
    # Sealed: its writer let go (a sweep may hold it for a moment).
    deadline = time.monotonic() + 5
    while _is_locked(a.path) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _is_locked(a.path)
    assert _is_locked(c.path)               # the active one stays locked
    segs.settle([c])
    segs.close()


def test_a_locked_segment_is_never_swept_even_with_nothing_in_it(tmp_path: Path) -> None:
    segs, _, _, log = _segments(tmp_path)
    f = segs.write([b"x" * 10], 10)
    segs.settle([f])                        # discarded: nothing refers to it
    other, *_ = _segments(tmp_path)         # another process's view
    other.bind(lambda numbers: set(), None)
    assert other.sweep_all() == 0
    assert os.path.exists(f.path)
    segs.close()                            # retired, sealed, swept by its writer
    assert not os.path.exists(f.path)
    assert log == ["referenced", "barrier"]


def test_a_sweep_keeps_referenced_segments_and_runs_the_barrier_before_unlinking(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    segs, _, refs, log = _segments(tmp_path, segment_max=10)
    files = [segs.write([b"%d" % i * 20], 20) for i in range(3)]
    assert len({f.path for f in files}) == 3
    segs.settle(files)
    segs.close()
    for f in files:
        assert not os.path.exists(f.path)   # none referenced: all gone
    log.clear()
    segs, _, refs, log = _segments(tmp_path, segment_max=10)
    files = [segs.write([b"%d" % i * 20], 20) for i in range(3)]
    refs.add(segment_number(files[1].path))
    real_unlink = os.unlink

    def unlink(path: str, *a: object, **kw: object) -> None:
        log.append("unlink")
        real_unlink(path)

    monkeypatch.setattr(os, "unlink", unlink)
    segs.settle(files)
    segs.close()
    assert [os.path.exists(f.path) for f in files] == [False, True, False]
    assert log.index("barrier") < log.index("unlink")
    assert "unlink" not in log[: log.index("referenced")]


def test_an_idle_active_segment_retires_on_its_own(tmp_path: Path) -> None:
    segs, clock, _, _ = _segments(tmp_path, segment_age_s=10.0)
    f = segs.write([b"x" * 10], 10)
    segs.sync([f])
    segs.settle([f])
    segs._retire_idle()
    assert os.path.exists(f.path) and _is_locked(f.path)
    clock.now += 10.0
    segs._retire_idle()                     # what the janitor does each tick
    assert segs._active is None             # sealed and offered to the sweep
    segs.close()                            # which is done by now
    assert not os.path.exists(f.path)


def test_an_old_segment_takes_no_new_content(tmp_path: Path) -> None:
    segs, clock, _, _ = _segments(tmp_path, segment_age_s=10.0)
    a = segs.write([b"x"], 1)
    clock.now += 10.0
    b = segs.write([b"y"], 1)
    assert a.path != b.path
    segs.settle([a, b])
    segs.close()


_CHILD = """
import os, sys
from sluice.spool.segments import Segments, segment_number
segs = Segments(sys.argv[1])
f = segs.write([b"orphan" * 100], 600)
segs.sync([f])
print(f.path, flush=True)
os.kill(os.getpid(), 9)
"""


def test_a_dead_writer_s_segment_is_swept_at_start_up(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)],
                         capture_output=True, text=True, check=False)
    assert out.returncode == -9, out.stderr
    path = out.stdout.strip()
    assert os.path.exists(path) and not _is_locked(path)
    stale = tmp_path / "segments" / "0000000000000001.new"
    stale.write_bytes(b"half made")
    os.utime(stale, (time.time() - 3600,) * 2)
    fresh = tmp_path / "segments" / "0000000000000002.new"
    fresh.write_bytes(b"being made")
    segs, *_ = _segments(tmp_path)
    assert segs.sweep_all() == 1
    assert not os.path.exists(path)
    assert not stale.exists() and fresh.exists()


def test_a_referenced_segment_of_a_dead_writer_stays(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)],
                         capture_output=True, text=True, check=False)
    path = out.stdout.strip()
    segs, _, refs, _ = _segments(tmp_path)
    refs.add(segment_number(path))
    assert segs.sweep_all() == 0
    with segs.open(next(iter(refs)), 0, 600) as fh:
        assert fh.read() == b"orphan" * 100


def test_a_failed_write_is_a_spool_error_and_leaves_the_segment_sealable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    segs, _, _, _ = _segments(tmp_path)
    ok = segs.write([b"ok"], 2)

    def full(*a: object) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    with pytest.raises(SpoolIOError, match="No space"):
        segs.write([b"x" * 100], 100)
    monkeypatch.undo()
    segs.settle([ok])
    segs.close()
    assert not os.path.exists(ok.path)      # nothing pending kept it locked


def test_bad_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="segment_max"):
        Segments(tmp_path, segment_max=0)
    with pytest.raises(ValueError, match="segment_age_s"):
        Segments(tmp_path, segment_age_s=0)


def test_the_background_thread_compacts_when_it_is_due(tmp_path: Path) -> None:
    segs, clock, _, _ = _segments(tmp_path, segment_age_s=0.02)
    calls: list[float] = []
    segs.bind_compaction(lambda now: calls.append(now) or 0, every_s=60.0)
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:  # ticks pass; not due on the fake clock
        time.sleep(0.02)
    assert calls == []
    clock.now += 60.0
    deadline = time.monotonic() + 5
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(calls) == 1 and abs(calls[0] - time.time()) < 5  # POSIX time, for SPIDs
    segs.close()


def test_a_failed_sync_fails_every_write_pending_in_that_segment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # After an fdatasync error the kernel may report success next time for
    # pages it dropped; so no later batch may trust that segment.
    segs, *_ = _segments(tmp_path)
    a = segs.write([b"a" * 100], 100)
    b = segs.write([b"b" * 100], 100)
    real = os.fdatasync

    def failing(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", failing)
    with pytest.raises(SpoolIOError, match="Input/output"):
        segs.sync([a])
    monkeypatch.setattr(os, "fdatasync", real)
    with pytest.raises(SpoolIOError, match="Input/output"):
        segs.sync([b])  # fdatasync would now "succeed"
    c = segs.write([b"c" * 100], 100)
    assert c.path != a.path  # the failed segment takes nothing more
    segs.sync([c])
    segs.settle([a, b, c])
    segs.close()
    assert not os.path.exists(a.path)


def test_a_sweep_of_many_segments_holds_a_few_locks_at_a_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sluice.spool.segments.SWEEP_CHUNK", 2)
    writer = Segments(tmp_path, segment_max=10)
    files = [writer.write([b"x" * 20], 20) for _ in range(5)]
    writer.settle(files)  # sealed, never bound: nothing swept yet
    asked: list[int] = []
    segs, *_ = _segments(tmp_path)
    segs.bind(lambda numbers: (asked.append(len(numbers)), set())[1], None)
    assert segs.sweep_all() == 5 - 1  # the writer's active one is locked
    assert max(asked) <= 2
    writer.close()
