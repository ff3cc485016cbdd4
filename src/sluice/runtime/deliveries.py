"""The queue manager's deliveries: carry out StartDelivery and DeferJob.

SUMMARY
    deliveries = Deliveries(queue, planner, recorder, agent, shaper, hooks, jobs,
                            stats, io=..., post=..., spawn=..., spawn_delivery=...,
                            stopping=...)
    deliveries.start(job, localip, qids)      (StartDelivery)
    deliveries.mark_started()                 (at the end of each loop step)
    deliveries.defer_dead(job, qids, reply)   (DeferJob)

DESCRIPTION
    start() hands a job's entries to the delivery agent as one task; when
    the agent is done, the post-delivery hook settles each outcome (the
    Planner), the shaper sees the replies, the outcomes go to the recorder
    and the scheduler hears DeliveryFinished.  defer_dead() settles the
    entries of a dead destination as temporary failures without a
    connection.

STRATEGIES
    At least once, with short windows (docs/queue.md, "What is
    promised").  The "delivering" marks of every attempt started in one
    loop step are one line of the mark log (sluice.marks), and a delivery
    waits for it after the server's 354, before the message goes out.
    Where no line can be written (a full disk, or a store shared by nodes,
    which keeps no log) the marks are one store operation instead, and the
    deliveries wait for its commit.  A crash after that point is logged at
    the next start as "in flight at crash, may be a duplicate".

    Attempts marked by a line alone are kept in memory (_unmarked) until
    their outcomes are in the store (the recorder calls applied()).  When
    the mark log retires a full file, those of its attempts still under
    way get the store's mark, in one operation, and the file is emptied
    (_cover): so the store always says what an emptied line said, and the
    store's write lock is taken for marks once a file, not once a step.

    Once the replies are in, the agent calls back (DeliveryRequest.
    settle): the outcomes go to the recorder's next group commit and the
    connection waits for it (or, with a success journal, for its sync,
    which precedes the store's), so a success is durable one commit after
    its reply.  Outcomes of deliveries without a transaction are recorded
    after, as before.

    One read for a step's contents.  The small contents of every
    delivery started in one loop step are read with one statement at
    the step's end (sluice.store.ReadsContentsAhead: SQLite, where each
    read of its own meets a page cache that the committer's writes have
    dropped, and PostgreSQL, where each is a round trip to the server;
    docs/benchmarks.md).  Each delivery holds its own in an
    _Ahead, made when it is spawned, so the bytes go with the delivery
    and nothing is kept for one that never ran; without them (another
    flavour, a failed read) it reads its content from the store.  A
    content larger than the store's ahead_max (its entry's size says so)
    is neither read ahead nor looked for in the database: it is opened
    where such contents are kept (ReadsContentsAhead.open_large; for
    SQLite the spool file).  At 100 KB each delivery had paid a cold read
    transaction of its own on the event loop, after the step's read-ahead
    had asked for it in vain.

    Exactly one answer.  Every StartDelivery is answered by exactly one
    DeliveryFinished: at once when stopping or when the job is gone,
    with no outcomes when the task is cancelled (the entries stay claimed
    and marked, and return at the next start), and with temporary
    failures when the delivery crashed.

SEE ALSO
    sluice.runtime.manager, sluice.runtime.jobs, sluice.delivery.agent,
    sluice.runtime.recorder
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import io
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import IO, Any, Protocol

from sluice.delivery.agent import DeliveryAgent, DeliveryRequest, DeliveryResult
from sluice.delivery.plan import Planner
from sluice.delivery.router import NextHop
from sluice.hooks import Hooks
from sluice.marks import MarkLog, mark_of
from sluice.model import QueueEntry, Reply, TempFail
from sluice.queue import AttemptResult, Queue
from sluice.runtime.jobs import Job, Jobs
from sluice.runtime.recorder import Recorder
from sluice.scheduler import DeliveryFinished, DeliveryJob, Event
from sluice.shaping.runtime import Shaper
from sluice.store import ReadsContentsAhead

__all__ = ["Deliveries"]

log = logging.getLogger("sluice.manager")

#: A failed store mark that covers a retired file of the mark log is tried
#: again after this, doubling up to MARK_RETRY_MAX_S.
MARK_RETRY_S = 0.05
MARK_RETRY_MAX_S = 5.0

Spawn = Callable[[Coroutine[Any, Any, None]], "asyncio.Task[None] | None"]


class DeliveryCounters(Protocol):
    """The manager's counter of deliveries started (ManagerStats)."""

    deliveries: int


class _Ahead:
    """One delivery's content, read ahead at the end of the step that started it."""

    __slots__ = ("data", "large", "spid")

    def __init__(self, spid: str, large: bool) -> None:
        self.spid = spid
        self.large = large  # over the store's ahead_max: opened, never read ahead
        self.data: bytes | None = None  # None: not read ahead, read from the store


class Deliveries:
    """Starts deliveries, records their outcomes and answers the scheduler."""

    def __init__(self, queue: Queue, planner: Planner, recorder: Recorder,
                 agent: DeliveryAgent, shaper: Shaper, hooks: Hooks, jobs: Jobs,
                 stats: DeliveryCounters, *,
                 post: Callable[[Event], None], spawn: Spawn, spawn_delivery: Spawn,
                 stopping: Callable[[], bool]) -> None:
        self.queue = queue
        self.planner = planner
        self.recorder = recorder
        self.agent = agent
        self.shaper = shaper
        self.hooks = hooks
        self.jobs = jobs
        self.stats = stats
        self._post = post
        self._spawn = spawn
        self._spawn_delivery = spawn_delivery
        self._stopping = stopping
        #: The mark log (sluice.marks), set by the manager when it keeps one:
        #: a step's marks are written there and its deliveries go on at once.
        self.marks: MarkLog | None = None
        #: Attempts marked by a line alone whose outcomes are not yet in the
        #: store: queue id -> (entry, the token of the line's file).
        self._unmarked: dict[str, tuple[QueueEntry, int]] = {}
        self._delivering: list[QueueEntry] = []
        self._marked: asyncio.Future[None] | None = None  # the mark of this step's starts
        # The contents to read ahead for this step's starts; the store is the
        # queue's for good, so whether it can is decided once.
        self._ahead: list[_Ahead] = []
        store = queue.store
        self._reads_ahead = store if isinstance(store, ReadsContentsAhead) else None

    def start(self, job: DeliveryJob, localip: str, qids: tuple[str, ...]) -> None:
        """Start delivering ``qids`` of ``job`` from ``localip`` (StartDelivery)."""
        info = self.jobs.get(job.ref)
        if info is None or self._stopping():
            # Stopping (or the job vanished): answer at once, give the claims back.
            entries = [info.entries[q] for q in qids if q in info.entries] if info else []
            self.jobs.pop(job.ref)
            self._post(DeliveryFinished(job.ref, (), connection_failed=False,
                                        new_connection=False, localip=localip))
            if entries:
                self._spawn(self.recorder.release(entries))
            return
        info.started = True
        entries = [info.entries[q] for q in qids]
        self._delivering.extend(entries)
        if self._marked is None:
            self._marked = asyncio.get_running_loop().create_future()
        self.stats.deliveries += 1
        # The entry's size is its content's (QueueEntry.size): one over the
        # store's ahead_max cannot be read ahead, so it is not asked for.
        reader = self._reads_ahead
        ahead = _Ahead(entries[0].spid,
                       reader is not None and entries[0].size > reader.ahead_max)
        if self._spawn_delivery(self._deliver(info, tuple(entries), localip,
                                              self._marked, ahead)) is None:
            self._post(DeliveryFinished(job.ref, (), connection_failed=False,
                                        new_connection=False, localip=localip))
        elif reader is not None and not ahead.large:
            self._ahead.append(ahead)

    def mark_started(self) -> None:
        """Mark the attempts started in this step "delivering": a line, else the store.

        Each of them waits for it after the server's 354.
        """
        if self._ahead:
            ahead, self._ahead = self._ahead, []
            self._read_ahead(ahead)
        if not self._delivering:
            return
        entries, marked = self._delivering, self._marked
        self._delivering, self._marked = [], None
        marks = self.marks
        token = None if marks is None else marks.write([mark_of(e) for e in entries])
        if marks is not None:
            retired = marks.take_retired()
            if retired is not None:
                self._spawn(self._cover(retired))  # if not (stopping): read at the next start
        if token is None:
            if (marked is not None and self._spawn(self._mark(entries, marked)) is None
                    and not marked.done()):
                marked.set_result(None)
            return
        for e in entries:
            self._unmarked[e.qid] = (e, token)
        if marked is not None:
            marked.set_result(None)  # the line has it: the content may go now

    def _read_ahead(self, ahead: list[_Ahead]) -> None:
        """The small contents of this step's starts, in one read (ReadsContentsAhead).

        A failed read leaves each delivery to read its own, as without it.
        """
        reader = self._reads_ahead
        if reader is None:  # start() keeps no _Ahead then
            return
        try:
            contents = reader.inline_contents(list({a.spid for a in ahead}))
        except Exception:
            log.debug("reading contents ahead failed; each delivery reads its own",
                      exc_info=True)
            return
        for one in ahead:
            one.data = contents.get(one.spid)

    def _content(self, ahead: _Ahead) -> IO[bytes]:
        """A delivery's content: read ahead for it, else from the store."""
        if ahead.data is not None:
            return io.BytesIO(ahead.data)
        if ahead.large and self._reads_ahead is not None:
            return self._reads_ahead.open_large(ahead.spid)
        return self.queue.store.open_content(ahead.spid)

    async def _mark(self, entries: list[QueueEntry], marked: asyncio.Future[None]) -> None:
        """The store's mark of a step's attempts, where no line has them.

        A failed mark only costs the note at a restart; the deliveries go
        on after it.
        """
        try:
            await asyncio.wrap_future(self.queue.mark_delivering_future(entries))
        except Exception as exc:
            self.recorder.failed(exc)
        finally:
            if not marked.done():
                marked.set_result(None)

    async def _cover(self, token: int) -> None:
        """The store's mark of the attempts a retired file names still under way; then empty it.

        Tried until it is in, or until the manager stops (the file is then
        read at the next start, as its lines say).
        """
        entries = [e for e, t in self._unmarked.values() if t == token]
        delay = MARK_RETRY_S
        while entries:
            try:
                await asyncio.wrap_future(self.queue.mark_delivering_future(entries))
                break
            except Exception as exc:
                self.recorder.failed(exc)
                if self._stopping():
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, MARK_RETRY_MAX_S)
                # Ended meanwhile (and maybe claimed again): no mark for those.
                entries = [e for e in entries if self._line_alone(e, token)]
        for e in entries:
            if self._line_alone(e, token):
                del self._unmarked[e.qid]
        if self.marks is not None:
            self.marks.covered(token)

    def _line_alone(self, entry: QueueEntry, token: int | None = None) -> bool:
        """Whether this attempt is marked by a line alone (in file ``token``, if given).

        This very entry object: a later attempt of the same entry is another.
        """
        kept = self._unmarked.get(entry.qid)
        return kept is not None and kept[0] is entry and (token is None or kept[1] == token)

    def applied(self, results: Sequence[AttemptResult]) -> None:
        """These outcomes are in the store: their attempts need no mark any more."""
        if self._unmarked:
            for r in results:
                if self._line_alone(r.entry):
                    del self._unmarked[r.entry.qid]

    async def _deliver(self, info: Job, entries: tuple[QueueEntry, ...], localip: str,
                       marked: asyncio.Future[None], ahead: _Ahead) -> None:
        ref = info.job.ref
        # Outcomes made durable while the agent still held the connection.
        settled: list[AttemptResult] = []

        async def started() -> None:
            await asyncio.shield(marked)

        async def settle(result: DeliveryResult) -> None:
            results = await self.planner.finish(result)
            settled.extend(results)
            await asyncio.shield(self.recorder.record(results))

        rest: list[AttemptResult] = []
        try:
            request = DeliveryRequest(
                route=info.hop, entries=entries,
                content=functools.partial(self._content, ahead),
                localip=localip, smtputf8=entries[0].smtputf8, started=started, settle=settle)
            result = await self.agent.deliver(request)
            done = {r.entry.qid for r in settled}
            if len(done) < len(result.outcomes):
                # No transaction (a refusal, no connection), or only part of
                # the entries had one (sluice.delivery.agent._deliver_safe_part).
                rest = await self.planner.finish(dataclasses.replace(result, outcomes=tuple(
                    (e, o) for e, o in result.outcomes if e.qid not in done)))
            results = settled + rest
            self.shaper.observe(info.job.route, results)  # shaping
            self.shaper.take(self.hooks)  # shaping: Shape decisions of the post hook
            self._post(DeliveryFinished(
                ref, tuple((r.entry.qid, r.outcome) for r in results),
                connection_failed=result.connection_failed,
                new_connection=result.new_connection, localip=localip))
        except asyncio.CancelledError:
            # Stopped hard: the entries stay claimed, marked, and return at the next start.
            self._post(DeliveryFinished(ref, (), connection_failed=False,
                                        new_connection=False, localip=localip))
            raise
        except Exception:
            log.exception("delivery of %s failed unexpectedly", ref)
            reply = Reply(451, "4.3.0", "local error during delivery, will retry")
            done = {r.entry.qid for r in settled}
            rest = [AttemptResult(e, TempFail(reply), attempted=False) for e in entries
                    if e.qid not in done]
            self._post(DeliveryFinished(ref, tuple((r.entry.qid, r.outcome)
                                                   for r in settled + rest),
                                        connection_failed=False, new_connection=False,
                                        localip=localip))
        finally:
            self.jobs.pop(ref)
        if rest:
            self.recorder.record(rest)

    def defer_dead(self, job: DeliveryJob, qids: tuple[str, ...], reply: Reply) -> None:
        """Settle ``qids`` of a dead destination's job without a connection (DeferJob)."""
        info = self.jobs.pop(job.ref)
        if info is None:
            return
        entries = [info.entries[q] for q in qids if q in info.entries]
        self._spawn(self._settle_dead(entries, info.hop, reply))

    async def _settle_dead(self, entries: list[QueueEntry], hop: NextHop, reply: Reply) -> None:
        results = []
        for entry in entries:
            outcome = await self.planner.settle(entry, TempFail(reply))
            results.append(AttemptResult(entry, outcome, attempted=False,
                                         remotemx=hop.remotemx, remoteip=hop.remoteip))
        self.recorder.record(results)
