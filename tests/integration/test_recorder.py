"""The queue manager's recorder on a real SQLite queue: outcome batches are
pipelined into the store, and a failing store is retried after a back-off
without losing or double-counting an outcome."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from sluice.journal import SuccessJournal, journal_paths, read_journal
from sluice.model import Delivered, QueueState, Reply, Selector, Submission, TempFail
from sluice.queue import AttemptResult, Queue
from sluice.runtime.parts import Health
from sluice.runtime.recorder import Recorder
from sluice.store import StorageError
from sluice.store.sqlite import SqliteStore
from tests.integration.stores import flavour_config

pytestmark = pytest.mark.integration

T0 = 1_800_000_000.0
OK = Delivered(Reply(250, "2.0.0", "queued as X"))


class Counters:
    delivered = 0
    deferred = 0
    bounced = 0


def _queue(tmp_path: Path, n: int, success_sync: str = "flush", content: bytes = b"x\r\n"
           ) -> tuple[Queue, list[AttemptResult]]:
    # A big content in a file of its own, whose deletion waits for the flush.
    config = flavour_config("sqlite", tmp_path, queue={"success_sync": success_sync,
                                                      "spool": {"layout": "files"}})
    queue = Queue.open(config, clock=lambda: T0)
    for i in range(n):
        queue.submit(Submission("a@example.org", (f"r{i}@example.net",)), content)
    claimed = queue.claim(100)
    queue.mark_delivering(claimed)
    return queue, [AttemptResult(e, OK, remoteip="127.0.0.1") for e in claimed]


def _recorder(queue: Queue, tasks: list[asyncio.Task[None]],
              sleeps: list[float] | None = None) -> tuple[Recorder, Counters]:
    def spawn(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        tasks.append(task)
        return task

    async def sleep(delay: float) -> None:
        if sleeps is not None:
            sleeps.append(delay)
        await asyncio.sleep(0)

    async def io(fn: Any, *args: Any) -> Any:
        return fn(*args)

    stats = Counters()
    return Recorder(queue, stats, Health(), spawn=spawn, io=io, notify_mail=lambda n: None,
                    sleep=sleep), stats


async def _eventually(check: Callable[[], bool], seconds: float = 10.0) -> bool:
    """Whether ``check`` holds within ``seconds``, looked at every millisecond."""
    deadline = asyncio.get_running_loop().time() + seconds
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.001)
    return True


def _run(main: Callable[[], Coroutine[Any, Any, None]], queue: Queue,
         release: threading.Event | None = None) -> None:
    """Run a test's ``main``; then let any held flush go and close the queue, whatever happened."""
    try:
        asyncio.run(main())
    finally:
        if release is not None:
            release.set()
        queue.close()


def _states(queue: Queue) -> dict[str, QueueState]:
    return {e.qid: e.state for e in queue.store.entries(Selector())}


def _hold_flushes(queue: Queue, monkeypatch: pytest.MonkeyPatch
                  ) -> tuple[threading.Event, threading.Event]:
    """The store's WAL flushes wait for ``release`` (10 s at most); ``in_flush``: one began."""
    store = queue.store
    assert isinstance(store, SqliteStore)
    in_flush, release = threading.Event(), threading.Event()
    flush = store._flush_wal

    def slow_flush() -> None:
        in_flush.set()
        release.wait(10)
        flush()

    monkeypatch.setattr(store, "_flush_wal", slow_flush)
    return in_flush, release


def test_a_batch_goes_to_the_store_while_the_last_one_is_still_being_flushed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One batch at a time: an outcome that arrived during a commit waited
    # for that commit's fsync before its own commit began.
    queue, (first, second) = _queue(tmp_path, 2)
    in_flush, release = _hold_flushes(queue, monkeypatch)

    async def main() -> None:
        tasks: list[asyncio.Task[None]] = []
        recorder, stats = _recorder(queue, tasks)
        one = recorder.record([first])
        assert await asyncio.to_thread(in_flush.wait, 10)
        two = recorder.record([second])
        try:
            # the second batch is committed while the first is held
            assert await _eventually(lambda: second.entry.qid not in _states(queue))
            assert not one.done() and not two.done()  # neither answered before its flush
        finally:
            release.set()
        await asyncio.wait_for(asyncio.gather(one, two), 10)
        assert stats.delivered == 2 and _states(queue) == {}
        await recorder.drain()

    _run(main, queue, release)


def test_a_failing_store_is_retried_after_a_back_off_and_counts_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    queue, results = _queue(tmp_path, 6)
    apply_future = queue.store.apply_future
    failures = [2]

    def flaky(transitions: Any, **how: Any) -> Any:
        if failures[0]:
            failures[0] -= 1
            raise StorageError("disk full")
        return apply_future(transitions, **how)

    monkeypatch.setattr(queue.store, "apply_future", flaky)

    async def main() -> None:
        tasks: list[asyncio.Task[None]] = []
        sleeps: list[float] = []
        recorder, stats = _recorder(queue, tasks, sleeps)
        waiting = [recorder.record([r]) for r in results[:3]]
        await asyncio.sleep(0)
        waiting += [recorder.record([r]) for r in results[3:]]
        await asyncio.wait_for(asyncio.gather(*waiting), 10)  # tried once: answered
        for _ in range(1000):
            if stats.delivered == 6:
                break
            await asyncio.sleep(0.001)
        await recorder.drain()
        assert stats.delivered == 6 and _states(queue) == {}
        assert len(sleeps) == 2  # one back-off per failure
        assert len(tasks) <= 2 + 2  # a batch per turn of the loop, and the retries in them

    _run(main, queue)


def test_with_a_journal_a_success_is_answered_once_synced_there_before_the_store_has_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    queue, (first,) = _queue(tmp_path, 1)
    in_flush, release = _hold_flushes(queue, monkeypatch)
    paths = journal_paths(tmp_path, "n1")

    async def main() -> None:
        tasks: list[asyncio.Task[None]] = []
        recorder, stats = _recorder(queue, tasks)
        recorder.journal = journal = SuccessJournal.open(paths, asyncio.get_running_loop())
        try:
            done = recorder.record([first])
            await asyncio.wait_for(asyncio.shield(done), 10)
            assert await asyncio.to_thread(in_flush.wait, 10)
            assert stats.delivered == 0  # the store's batch is still held in its flush
            kept = read_journal(paths)
            assert list(kept) == [first.entry.qid]
            assert kept[first.entry.qid].reply == OK.reply
            assert kept[first.entry.qid].remoteip == "127.0.0.1"
            # Its line was written before the journal's: the replay writes none.
            assert kept[first.entry.qid].logged
            assert ("delivered", first.entry.qid) in _logged(queue)
        finally:
            release.set()
        for task in list(tasks):
            await asyncio.wait_for(task, 10)
        assert stats.delivered == 1 and _states(queue) == {}
        assert not any(f.held for f in journal._files)  # the store has it: the line may go
        await recorder.drain()
        journal.close()

    _run(main, queue, release)


BIG = b"".join(b"line %06d of a message kept in a spool file\r\n" % i for i in range(2000))


@pytest.mark.parametrize("content", [b"x\r\n", BIG], ids=["inline", "in a spool file"])
def test_with_success_sync_write_a_success_is_answered_at_its_commit_then_flushed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: bytes) -> None:
    # queue.success_sync "write": the connection goes on once the commit
    # has written the success (Postfix's way), and the flush follows at once,
    # not whenever some other change needs one. A content kept in a spool
    # file of its own goes only after that flush: a power cut before it
    # leaves the entry, and so its content, to send again.
    queue, (first,) = _queue(tmp_path, 1, "write", content)
    spool_files = [f for f in (tmp_path / "spool").rglob("*") if f.is_file()]
    assert len(spool_files) == (len(content) > 65536)
    in_flush, release = _hold_flushes(queue, monkeypatch)

    async def main() -> None:
        tasks: list[asyncio.Task[None]] = []
        recorder, stats = _recorder(queue, tasks)
        try:
            done = recorder.record([first])
            await asyncio.wait_for(asyncio.shield(done), 10)  # before any flush ended
            assert _states(queue) == {}  # committed: the entry is gone
            assert await asyncio.to_thread(in_flush.wait, 10)  # the flush follows
            assert all(f.exists() for f in spool_files)  # its content waits for it
        finally:
            release.set()
        for task in list(tasks):
            await asyncio.wait_for(task, 10)
        assert stats.delivered == 1
        assert await _eventually(lambda: not any(f.exists() for f in spool_files))
        await recorder.drain()

    _run(main, queue, release)


def test_with_success_sync_write_and_a_journal_a_success_is_answered_at_its_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    queue, (first,) = _queue(tmp_path, 1, "write")
    paths = journal_paths(tmp_path, "n1")

    async def main() -> None:
        tasks: list[asyncio.Task[None]] = []
        recorder, stats = _recorder(queue, tasks)
        recorder.journal = journal = SuccessJournal.open(paths, asyncio.get_running_loop())
        synced = threading.Event()
        sync = os.fdatasync

        def held_sync(fd: int) -> None:  # the journal's thread syncs with it
            synced.wait(10)
            sync(fd)

        monkeypatch.setattr(os, "fdatasync", held_sync)
        try:
            done = recorder.record([first])
            assert done.done()  # the journal's write has it: no wait for its sync
            assert list(read_journal(paths)) == [first.entry.qid]
            assert stats.delivered == 0  # the store has it only after the sync
        finally:
            synced.set()
        assert await _eventually(lambda: stats.delivered == 1)
        assert _states(queue) == {}
        await recorder.drain()
        journal.close()

    _run(main, queue)


@pytest.mark.parametrize("flags", [os.O_RDONLY, os.O_WRONLY | os.O_APPEND],
                         ids=["the write fails", "the sync fails"])
def test_a_journal_that_fails_leaves_the_wait_to_the_store(tmp_path: Path, flags: int) -> None:
    """/dev/null for the files: read-only, a write fails (EBADF); else fdatasync (EINVAL)."""
    queue, (first,) = _queue(tmp_path, 1)
    health = Health()

    async def main() -> None:
        tasks: list[asyncio.Task[None]] = []
        recorder, stats = _recorder(queue, tasks)
        recorder._journaling = health.part("journaling successes")
        recorder.journal = journal = SuccessJournal.open(journal_paths(tmp_path, "n1"),
                                                         asyncio.get_running_loop())
        for f in journal._files:
            os.close(f.fd)
            f.fd = os.open(os.devnull, flags)
        await asyncio.wait_for(recorder.record([first]), 10)
        assert stats.delivered == 1 and _states(queue) == {}  # answered by the store
        assert health.part("journaling successes").failing
        await recorder.drain()
        journal.close()

    _run(main, queue)


def _logged(queue: Queue) -> list[tuple[str, str]]:
    """(event, qid) of every line of the accounting log, in order."""
    assert queue.accounting is not None
    out = []
    for path in sorted(queue.accounting.path.glob("sluice-acct-*.jsonl")):
        if path.is_symlink():  # to /dev/full, which reads as endless zeros
            continue
        for line in path.read_text().splitlines():
            event = json.loads(line)
            out.append((event["event"], event["qid"]))
    return out


def test_a_success_is_logged_before_the_store_commits_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Logged after the commit, a crash between the two left a delivery
    # that went out with no line at all.
    queue, results = _queue(tmp_path, 3)
    results[2] = AttemptResult(results[2].entry, TempFail(Reply(451, "4.3.0", "later")))
    apply_future = queue.store.apply_future
    at_commit: list[list[tuple[str, str]]] = []

    def looking(transitions: Any, **how: Any) -> Any:
        at_commit.append(_logged(queue))
        return apply_future(transitions, **how)

    monkeypatch.setattr(queue.store, "apply_future", looking)

    async def main() -> None:
        tasks: list[asyncio.Task[None]] = []
        recorder, stats = _recorder(queue, tasks)
        await asyncio.wait_for(recorder.record(results), 10)
        await recorder.drain()
        assert (stats.delivered, stats.deferred) == (2, 1)

    _run(main, queue)
    ok, deferred = {r.entry.qid for r in results[:2]}, results[2].entry.qid
    # The successes were in the log when the store was given them; the
    # deferral, a queue transition like any other, is logged once applied.
    assert {q for e, q in at_commit[0] if e == "delivered"} == ok
    assert ("deferred", deferred) not in at_commit[0]
    lines = _logged(queue)
    assert sorted(q for e, q in lines if e == "delivered") == sorted(ok)  # once each
    assert [q for e, q in lines if e == "deferred"] == [deferred]


def _hour_full(queue: Queue, at: float) -> None:
    """The accounting file of ``at``'s hour becomes /dev/full: its writes fail (ENOSPC)."""
    assert queue.accounting is not None
    hour = queue.accounting.path / queue.accounting.filename(at)
    hour.unlink(missing_ok=True)
    hour.symlink_to("/dev/full")
    queue.accounting.close()  # the next line opens the hour's file again


def test_a_log_that_cannot_be_written_does_not_stop_the_outcomes(tmp_path: Path) -> None:
    """The hour's file is /dev/full: every write of a line fails with ENOSPC."""
    queue, results = _queue(tmp_path, 2)
    _hour_full(queue, T0)
    health = Health()

    async def main() -> None:
        tasks: list[asyncio.Task[None]] = []
        recorder, stats = _recorder(queue, tasks)
        recorder._logging = health.part("logging deliveries")
        recorder._recording = health.part("recording outcomes")
        await asyncio.wait_for(recorder.record(results), 10)
        await recorder.drain()
        assert stats.delivered == 2 and _states(queue) == {}

    _run(main, queue)
    assert health.part("logging deliveries").failing
    assert health.part("logging deliveries").errors_total == 2  # before and after the commit
    assert health.part("recording outcomes").errors_total == 0


def test_lines_written_before_a_failing_one_are_not_written_twice(tmp_path: Path) -> None:
    """A replay's successes keep their own times: one write per hour's file,
    and only the second hour's file fails (/dev/full)."""
    queue, (first, second) = _queue(tmp_path, 2)
    first = dataclasses.replace(first, at=T0 - 7200)
    second = dataclasses.replace(second, at=T0)
    _hour_full(queue, T0)
    trouble = Health().part("logging deliveries")
    try:
        marked = queue.log_successes([first, second], trouble)
        assert [r.logged for r in marked] == [True, False]
        assert trouble.failing
        plan = queue.plan_record(marked)
        queue.finish_record(plan, queue.apply_record(plan).result(), trouble)
    finally:
        queue.close()
    assert _logged(queue) == [("delivered", first.entry.qid)]  # once, not again
    assert trouble.errors_total == 2  # the second's line, before and after the commit
