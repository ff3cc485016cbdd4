"""The queue manager's recorder: attempt outcomes into the store, NDR runs, claims given back.

SUMMARY
    recorder = Recorder(queue, stats, health, spawn=..., io=..., notify_mail=...)
    recorder.record(results); recorder.bounce_soon(); await recorder.release(entries)
    await recorder.drain()          (when the manager stops)

DESCRIPTION
    Deliveries end with outcomes; the recorder logs the successes at once
    (Queue.log_successes: before anything is durable, so that no crash
    leaves a delivery without its line), applies the outcomes to the store
    (sluice.queue.Queue.record: delivered entries leave, failures are
    deferred or bounced) and counts them.  When some bounced, it runs the
    NDR generation soon after (Queue.run_bounces) and tells the manager of
    the NDRs it queued.  It also gives claims back (entries dropped from
    memory, and every entry still held when the manager stops).

STRATEGIES
    Group commit again, pipelined: outcomes that arrive in one turn of
    the loop make one batch, and a batch goes to the store at once even
    while earlier ones are still being committed and flushed (up to
    MAX_IN_FLIGHT; past that they gather into the next).  The store's
    committer commits them in that order and one WAL flush can cover
    several: with one batch at a time, an outcome that arrived during a
    commit waited for that commit's fsync before its own began, most of
    the ~4 ms a delivery waited to settle.  A delivery waits for the
    batch that holds its outcomes before its connection takes another
    message (record()'s future; sluice.delivery.agent, "Durable before
    reuse"), so a success is durable one commit after its reply, not
    whenever the loop gets to it.  With a success journal
    (sluice.journal; PostgreSQL's default) the successes are appended
    there first, the wait ends at the journal's sync, and the batch goes
    to the store only after that sync (so the store never has a success
    the journal lacks; if the journal fails, the wait is the store's);
    the journal hears from _flush when the store has them.  With
    queue.success_sync "write" no success waits for a flush: the wait
    ends at the journal's write, or at the store's commit (written, its
    flush to follow), as a failure's always did.  The
    batch goes from the loop straight to the store's committer
    (Queue.plan_record, apply_record, finish_record): no pool thread sits
    between them only to wait, which cost about 0.9 ms of each delivery's
    wait.  NDR runs wait a moment (BOUNCE_GATHER_S) so a burst of bounces
    makes few runs.

    A failing store is retried, not dropped.  A batch of outcomes that
    cannot be applied (a full disk) is kept and tried again after the
    back-off of its Trouble (sluice.runtime.parts): one warning, then a
    reminder now and then, then one line when it works.  Only when the
    manager stops are outcomes left unrecorded; their entries are still
    claimed in the store and return at the next start (and may be
    delivered twice, never lost), except the successes a journal kept,
    which the next start records.

SEE ALSO
    sluice.runtime.manager, sluice.queue, sluice.runtime.parts
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import Any, Protocol, TypeVar

from sluice import faults
from sluice.journal import SuccessJournal, first_of
from sluice.model import Delivered, PermFail, QueueEntry, QueueState, TempFail
from sluice.queue import AttemptResult, Queue
from sluice.runtime.parts import Health

__all__ = ["Recorder"]

log = logging.getLogger("sluice.manager")

T = TypeVar("T")

#: Batches of outcomes in the store's hands at once, at most.
MAX_IN_FLIGHT = 4

#: How long a stop waits for the success journal's syncs under way.
JOURNAL_WAIT_S = 5.0

#: How long an NDR run waits for more bounces to gather.
BOUNCE_GATHER_S = 0.2


class Counters(Protocol):
    """The manager's counters the recorder keeps (ManagerStats)."""

    delivered: int
    deferred: int
    bounced: int


class Recorder:
    """Outcomes to the store in batches; NDR runs; claims given back."""

    def __init__(self, queue: Queue, stats: Counters, health: Health, *,
                 spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None] | None],
                 io: Callable[..., Awaitable[Any]],
                 notify_mail: Callable[[int], None],
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.queue = queue
        self.stats = stats
        self._spawn = spawn
        self._io = io
        self._notify_mail = notify_mail
        self._sleep = sleep
        self._pending: list[AttemptResult] = []
        self._waiters: list[asyncio.Future[None]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._starting: asyncio.Task[None] | None = None  # started, not yet running
        self._bounce_pending = False
        self._stopping = False
        self._recording = health.part("recording outcomes")
        self._bouncing = health.part("queueing NDRs")
        self._journaling = health.part("journaling successes")
        self._logging = health.part("logging deliveries")
        self._syncing: set[asyncio.Future[None]] = set()  # journal syncs not yet ended
        #: The success journal (sluice.journal), when serve keeps one.
        self.journal: SuccessJournal | None = None
        #: Told of every batch of outcomes once the store has applied it
        #: (the deliveries' attempts marked by the mark log alone).
        self.on_applied: Callable[[Sequence[AttemptResult]], None] | None = None
        self._releasing = health.part("giving claims back")

    @property
    def tasks(self) -> frozenset[asyncio.Task[None]]:
        """The batches being recorded."""
        return frozenset(self._tasks)

    def record(self, results: Iterable[AttemptResult]) -> asyncio.Future[None]:
        """Queue outcomes for the store.

        The future resolves when the batch that holds them has been tried once:
        applied, or failed (they are then retried in the background); await it
        through asyncio.shield.  With a success journal, outcomes that hold
        a success are written there first and go to the store once they are
        synced; the future then resolves at that sync (or, if the journal
        fails, when the store has tried them).  So the store never has a
        journaled success before the journal does: a crash in between
        leaves it to the journal's replay.  With queue.success_sync "write"
        it resolves at the journal's write instead, or without a journal at
        the store's commit (the flush follows).
        """
        # The successes' lines first, before the journal or the store has
        # them (if the log fails, finish_record tries after the commit).
        results = self.queue.log_successes(results, self._logging)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        synced = self._journal(results)
        if synced is None:
            self._queue(results, done)
            return done
        self._syncing.add(synced)

        def to_store(fut: asyncio.Future[None]) -> None:
            self._syncing.discard(fut)
            self._queue(results, done)

        synced.add_done_callback(to_store)
        if not self.queue.flushes_successes:
            # queue.success_sync "write": the journal's write has them; the
            # connection goes on without waiting for its sync.
            done_now: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            done_now.set_result(None)
            return done_now
        return first_of(synced, done)

    def _queue(self, results: list[AttemptResult], done: asyncio.Future[None]) -> None:
        self._pending.extend(results)
        self._waiters.append(done)
        self._start()

    def _journal(self, results: Sequence[AttemptResult]) -> asyncio.Future[None] | None:
        """The successes among ``results`` to the success journal; None: not journaled."""
        if self.journal is None:
            return None
        delivered = [r for r in results if isinstance(r.outcome, Delivered)]
        if not delivered:
            return None
        try:
            synced = self.journal.append(delivered, self.queue.clock())
        except Exception as exc:  # the deliveries wait for the store instead
            self._journaling.failed(exc)
            return None
        synced.add_done_callback(self._journal_synced)
        return synced

    def _journal_synced(self, fut: asyncio.Future[None]) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is None:
            self._journaling.ok()
        else:
            self._journaling.failed(exc)

    def _start(self) -> None:
        """A new batch for what is pending, unless one is about to take it.

        Up to MAX_IN_FLIGHT batches are in the store at once; past that, or
        while a failed batch waits out its back-off, the pending outcomes
        go with the next batch that ends.
        """
        if (self._starting is not None or len(self._tasks) >= MAX_IN_FLIGHT
                or (self._recording.failing and self._tasks)):
            return
        task = self._spawn(self._flush())
        if task is None:  # the manager is ending: the next start redoes them
            self._wake(self._waiters)
            self._waiters = []
            return
        self._starting = task
        self._tasks.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if self._starting is task:  # cancelled before it ran
            self._starting = None

    @staticmethod
    def _wake(waiters: list[asyncio.Future[None]]) -> None:
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def failed(self, exc: BaseException) -> None:
        """A store change of the manager's own failed (held or dropped by a hook)."""
        self._recording.failed(exc)

    async def _flush(self) -> None:
        self._starting = None
        while self._pending:
            batch, self._pending = self._pending, []
            waiters, self._waiters = self._waiters, []
            try:
                # The store's own thread does the work; the loop waits for
                # its future, not for a thread of the pool that waits for it.
                plan = self.queue.plan_record(batch)
                applied = self.queue.finish_record(
                    plan, await asyncio.wrap_future(self.queue.apply_record(plan)),
                    trouble=self._logging)
                faults.point("after_commit", (r.entry.spid for r in batch))
            except BaseException as exc:
                # Failed (retried below) or cancelled: the deliveries
                # waiting for this batch go on.
                self._wake(waiters)
                if not isinstance(exc, Exception):
                    raise
                delay = self._recording.failed(exc)
                if self._stopping:
                    # The entries stay claimed and return at the next start.
                    log.warning("%d outcomes not recorded; their entries return at the next "
                                "start", len(batch))
                    return
                self._pending[:0] = batch
                await self._sleep(delay)
                continue
            self._wake(waiters)
            self._recording.ok()
            if self.on_applied is not None:
                self.on_applied(batch)
            if self.journal is not None:
                self.journal.committed(r.entry.qid for r in batch
                                       if isinstance(r.outcome, Delivered))
            self._count(applied)

    def _count(self, applied: Sequence[tuple[AttemptResult, QueueState | None]]) -> None:
        bounced = False
        for res, state in applied:
            match res.outcome:
                case PermFail():
                    self.stats.bounced += 1
                case TempFail():
                    self.stats.deferred += 1
                case _:
                    self.stats.delivered += 1
            if state is QueueState.BOUNCE:
                bounced = True
        if bounced:
            self.bounce_soon()

    def bounce_soon(self) -> None:
        """Queue the NDRs of bounced entries in a moment."""
        if self._bounce_pending or self._stopping:
            return
        self._bounce_pending = True
        if self._spawn(self._run_bounces()) is None:
            self._bounce_pending = False

    async def _run_bounces(self) -> None:
        try:
            await asyncio.sleep(BOUNCE_GATHER_S)
        finally:
            self._bounce_pending = False
        try:
            queued = await self._io(self.queue.run_bounces)
        except Exception as exc:
            # The expiry sweep looks for bounces left over and tries again.
            self._bouncing.failed(exc)
            return
        self._bouncing.ok()
        if queued:
            self._notify_mail(queued)

    async def release(self, entries: Sequence[QueueEntry]) -> None:
        """Give claims back untried (they return at the next start if this fails)."""
        if not entries:
            return
        try:
            await self._io(self.queue.release_claims, list(entries))
        except Exception as exc:
            self._releasing.failed(exc)
        else:
            self._releasing.ok()

    async def drain(self) -> None:
        """The manager stops: record what is pending, once, without retrying."""
        self._stopping = True
        if self._syncing:  # journaled successes join the pending ones after their sync
            await asyncio.wait(set(self._syncing), timeout=JOURNAL_WAIT_S)
            await asyncio.sleep(0)
        tasks = list(self._tasks)
        if self._recording.failing:
            for task in tasks:
                task.cancel()  # waiting out a back-off: its batch is pending again
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._pending:
            try:
                await self._flush()
            except Exception:
                log.exception("recording outcomes while stopping failed")
