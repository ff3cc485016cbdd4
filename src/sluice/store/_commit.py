"""Group commit and locking helpers shared by the fs, kv, postgres and sqlite flavours.

SUMMARY
    GroupCommitter(commit, max_batch=..., name=...), Op, RWLock,
    fsync_paths(paths), fsync_fds(fds).

DESCRIPTION
    A store flavour hands every write to one committer thread as an Op (a
    function of the flavour's batch context, a future, and the spool files
    the write depends on).  The thread takes everything that queued up
    while its previous commit ran -- no artificial wait -- and passes the
    batch to the flavour's ``commit`` function, which makes the whole
    batch durable at once (one fsync round, one synchronous write batch,
    one transaction) and resolves every op's future.  Callers block on
    their future, so "returned" still means "durable".

STRATEGIES
    Group commit: concurrent submitters share one commit.  Order: ops run
    in the order they were queued, so a caller that did not wait for a
    write (``apply(wait=False)``) sees it applied once a later write of
    its own has returned.

    Never leave a caller waiting: if ``commit`` raises, every op of the
    batch that is still unresolved fails with StorageError.

    Cancellation: an op's future is marked running when the committer takes
    it, so a caller that cancels later cannot make a committed batch report
    failure; an op cancelled before that is dropped (``dropped`` undoes
    what the caller had written for it, e.g. its content).

    Parallel fsync: the kernel merges concurrent fsyncs into few journal
    commits, so a batch of files costs little more than one of them.

    The thread starts with the first write, not with the store: a process
    that only reads has no thread of it.

INVARIANTS
    Exactly one thread runs ``commit``; a batch never holds more than
    ``max_batch`` ops.

SEE ALSO
    sluice.store.sqlite (with its WAL syncer beside), sluice.store.fs,
    sluice.store.kv, sluice.store.postgres.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import queue as queuelib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice._batches import take_queued
from sluice._fsync import fsync_fds, fsync_paths, in_parallel
from sluice.spool import SpoolFile
from sluice.store import StorageError

__all__ = ["GroupCommitter", "Op", "RWLock", "fsync_fds", "fsync_paths", "in_parallel"]


@dataclass(slots=True)
class Op:
    """One write: ``work`` runs inside the flavour's batch; its value resolves ``future``."""

    work: Callable[[Any], Any]
    future: concurrent.futures.Future[Any]
    files: list[SpoolFile] = field(default_factory=list)
    #: Flavour-specific data the commit needs besides ``work`` (e.g. content keys).
    extra: Any = None
    #: False: losing this write in a power cut only repeats work (a delivery
    #: outcome, a claim); a flavour may then skip the flush for the batch.
    durable: bool = True
    #: With durable False: answered at the commit, but flushed right after
    #: it, not whenever another batch needs a flush (queue.success_sync
    #: "write").
    soon: bool = False

    def __init__(self, work: Callable[[Any], Any], future: concurrent.futures.Future[Any],
                 files: list[SpoolFile] | None = None, extra: Any = None,
                 durable: bool = True, soon: bool = False) -> None:
        self.work = work
        self.future = future
        self.files = [] if files is None else files
        self.extra = extra
        self.durable = durable
        self.soon = soon


_STOP = object()


class GroupCommitter:
    """One thread that commits whatever queued up, as one batch."""

    def __init__(self, commit: Callable[[list[Op]], None], *, max_batch: int = 2000,
                 name: str = "sluice-commit",
                 dropped: Callable[[Op], None] | None = None) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self._commit = commit
        self._dropped = dropped
        self.max_batch = max_batch
        self._ops: queuelib.SimpleQueue[Op | object] = queuelib.SimpleQueue()
        self._closed = False
        self._name = name
        # Started by the first write: a process that only reads (qcount,
        # qlist) keeps a single thread, and may fork its helpers
        # (sluice._workers).
        self._worker: threading.Thread | None = None
        self._gate = threading.Lock()  # the thread's start, every submit, the close

    def submit(self, work: Callable[[Any], Any], files: Sequence[SpoolFile] = (),
               extra: Any = None, *, durable: bool = True, soon: bool = False
               ) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        op = Op(work, fut, list(files), extra, durable, soon)
        # Under the lock close() takes: no op is queued behind its stop,
        # and no thread starts once it has looked.
        with self._gate:
            if self._closed:
                raise StorageError("the store is closed")
            if self._worker is None:
                worker = threading.Thread(target=self._run, name=self._name, daemon=True)
                worker.start()
                self._worker = worker
            self._ops.put(op)
        return fut

    def call(self, work: Callable[[Any], Any]) -> Any:
        """Run ``work`` in the next batch and wait for the batch to be durable."""
        return self.submit(work).result()

    def _take(self, op: Op, batch: list[Op]) -> None:
        # A caller may cancel its future (asyncio.wrap_future does when its
        # task is cancelled).  Once running it cannot be cancelled any more,
        # so a committed batch's results reach every caller; an operation
        # cancelled before that is dropped, and the flavour removes what it
        # had written for it.
        if op.future.set_running_or_notify_cancel():
            batch.append(op)
        elif self._dropped is not None:
            with contextlib.suppress(Exception):  # best effort: recover() sweeps the rest
                self._dropped(op)

    def _run(self) -> None:
        while True:
            first = self._ops.get()
            if first is _STOP:
                return
            assert isinstance(first, Op)
            taken, stop = take_queued(self._ops, first, _STOP, self.max_batch)
            batch: list[Op] = []
            for op in taken:
                self._take(op, batch)
            if not batch:
                if stop:
                    return
                continue
            try:
                self._commit(batch)
            except BaseException as exc:  # never leave a caller waiting
                err = exc if isinstance(exc, StorageError) else StorageError(
                    f"commit failed: {exc}")
                for op in batch:
                    if not op.future.done():
                        op.future.set_exception(err)
            if stop:
                return

    def close(self) -> None:
        """Commit what is queued, then stop the thread."""
        with self._gate:
            if self._closed:
                return
            self._closed = True
            worker = self._worker
            if worker is not None:  # never started: nothing was queued
                self._ops.put(_STOP)
        if worker is not None:
            worker.join()


class RWLock:
    """Many readers or one writer; a waiting writer keeps new readers out.

    The flavours' committers take it exclusively only while they change
    files or swap a connection, so that a reader in the same process never
    sees half of a batch.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False
        self._waiting_writers = 0

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        with self._cond:
            while self._writer or self._waiting_writers:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        with self._cond:
            self._waiting_writers += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._waiting_writers -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()
