"""The queue's life cycle on top of a store: submit, outcomes, expiry, NDRs, operator actions.

SUMMARY
    Queue(config, store, accounting, clock).  Queue.open(config) opens the
    configured store flavour and the accounting log.

DESCRIPTION
    The store keeps entries; this module decides what happens to them, the
    same way for every flavour, and writes one accounting line for each
    change:

    submit      spool + meta, durable before it returns ("250").
    claim       refill for the active queue (store.claim with quota_deferred).
    record      outcomes of delivery attempts: 2xx delivered (gone);
                5xx bounce; 4xx deferred by the retry rules, or bounce when
                the message has outlived retry_maxtime (sluice.retry).
    expire      the periodic sweep (bounces_interval) that bounces
                deferred entries past retry_maxtime.
    run_bounces NDRs for entries in the bounce state: one RFC 3464 report
                per message, from <> to the sender, queued like any other
                mail.  Never an NDR for an NDR or for mail from <>: those
                are discarded and logged ("discarded").
    act         operator actions on a selector: hold, release, retry,
                delete, priority, bounce.

STRATEGIES
    Late results lose to operators.  A failed attempt's result applies only
    while the entry is still active/delivering, so an operator's hold or
    delete made meanwhile wins.  A successful delivery always removes the
    entry: the mail is out, keeping it would send it twice.

    At least once.  Between queueing an NDR and removing the bounce entries
    a crash may leave both: the NDR is then sent twice, never lost.

    A success is logged before the store has it.  The next hop has the
    message whatever the store hears afterwards, so its ``delivered`` line
    is written when the reply is read (log_successes), before the success
    journal and the store's commit: a crash after the commit can no longer
    leave a delivery without its line.  A crash before the commit sends
    the message again, and the log then has both deliveries, as happened.
    Failures are logged after the commit, as every other transition: they
    apply only while the entry is in flight (above).

SEE ALSO
    sluice.store, sluice.retry, sluice.bounce, sluice.accounting
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from sluice.accounting import AccountingLog, EventKind, make_event
from sluice.attempts import AttemptResult
from sluice.bounce import FailedRecipient, build_ndr, read_header_block
from sluice.config import Config, make_directories
from sluice.marks import mark_of
from sluice.model import (
    IN_FLIGHT_STATES,
    Accepted,
    Delivered,
    PermFail,
    QueueEntry,
    QueueState,
    Reply,
    Selector,
    Submission,
    TempFail,
    recipient_domain,
)
from sluice.retry import RetryPolicy
from sluice.spool import Content
from sluice.store import Action, SharedClaims, StorageError, Store, Transition, open_store

if TYPE_CHECKING:
    from sluice.journal import JournaledSuccess

__all__ = ["QSHAPE_EDGES_MIN", "AttemptResult", "Queue", "RecordPlan"]

log = logging.getLogger("sluice.queue")

#: Postfix qshape's age buckets, in minutes: T 5 10 20 40 80 160 320 640 1280 1280+
QSHAPE_EDGES_MIN: tuple[int, ...] = (5, 10, 20, 40, 80, 160, 320, 640, 1280)

#: How long an NDR run holds the bounce entries it works on.
NDR_LEASE_S = 600.0

#: The accounting note of an entry whose attempt was cut short by a crash.
IN_FLIGHT_REPLY = Reply(451, "4.4.2", "in flight at crash, may be a duplicate")

#: Reply recorded when an entry expires without a reply of its own.
EXPIRED_REPLY = Reply(451, "4.4.7", "delivery time expired")

_ACTION_EVENT = {
    Action.HOLD: EventKind.HELD,
    Action.RELEASE: EventKind.RELEASED,
    Action.RETRY: EventKind.RETRY,
    Action.DELETE: EventKind.DELETED,
    Action.PRIORITY: EventKind.PRIORITY,
    Action.BOUNCE: EventKind.BOUNCED,
}


class LogTrouble(Protocol):
    """Where a failing accounting log is reported (sluice.runtime.parts.Trouble)."""

    def failed(self, exc: BaseException) -> float:
        """The log could not be written."""
        ...

    def ok(self) -> None:
        """Lines were written."""
        ...


@contextlib.contextmanager
def _reported(trouble: LogTrouble | None) -> Iterator[None]:
    """Lines written inside: ``trouble`` hears ok, or of the OSError (none: a warning)."""
    try:
        yield
    except OSError as exc:
        if trouble is None:
            log.warning("accounting log: cannot write outcome lines: %s", exc)
        else:
            trouble.failed(exc)
    else:
        if trouble is not None:
            trouble.ok()


@dataclass(frozen=True, slots=True)
class RecordPlan:
    """Queue.plan_record(): the store changes for some outcomes, and what to log after."""

    now: float
    transitions: list[Transition]
    planned: list[tuple[AttemptResult, QueueState | None, EventKind, Reply]]
    #: A success among them: flushed before the caller goes on (see record()).
    durable: bool
    #: A success among them under queue.success_sync "write": answered at
    #: the commit, flushed right after it (Store.apply_future).
    flush_soon: bool = False

    def __init__(self, now: float, transitions: list[Transition],
                 planned: list[tuple[AttemptResult, QueueState | None, EventKind, Reply]],
                 durable: bool, flush_soon: bool = False) -> None:
        object.__setattr__(self, "now", now)
        object.__setattr__(self, "transitions", transitions)
        object.__setattr__(self, "planned", planned)
        object.__setattr__(self, "durable", durable)
        object.__setattr__(self, "flush_soon", flush_soon)


class Queue:
    """The life cycle of queued mail over any Store flavour."""

    def __init__(self, config: Config, store: Store, accounting: AccountingLog | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.store = store
        self.accounting = accounting
        self.clock = clock
        self.retry = RetryPolicy.from_config(config.queue)
        self.node = config.node.id
        #: queue.success_sync "flush": a success is on stable storage before
        #: its connection carries the next message; "write": written to the
        #: kernel (docs/queue.md, "What is promised").
        self.flushes_successes = config.queue.success_sync == "flush"

    @classmethod
    def open(cls, config: Config, clock: Callable[[], float] = time.time) -> Queue:
        """Open the queue a configuration describes: its directories, store and accounting log."""
        make_directories(config)  # a bad path is a ConfigError naming its key
        store = open_store(config)
        acct = AccountingLog(config.accounting.path, config.accounting.rotate,
                             config.accounting.keep, node=config.node.id)
        return cls(config, store, acct, clock)

    def close(self) -> None:
        """Close the store and the accounting log."""
        self.store.close()
        if self.accounting is not None:
            self.accounting.close()

    def __enter__(self) -> Queue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- accounting ----------------------------------------------------------------

    def _log(self, events: Iterable[dict[str, Any]], now: float) -> None:
        if self.accounting is not None:
            self.accounting.record(events, now)

    def _event(self, kind: EventKind, entry: QueueEntry, now: float, **kw: Any
               ) -> dict[str, Any]:
        return make_event(kind, entry, now, node=self.node, **kw)

    @staticmethod
    def entries_of(submission: Submission, accepted: Accepted, now: float) -> list[QueueEntry]:
        """The entries a submission created, as the store holds them."""
        state, next_at = submission.initial_state(now)
        return [
            QueueEntry(
                spid=accepted.spid, idx=i, sender=submission.sender, recipient=rcpt,
                state=state, arrival_at=now, next_attempt_at=next_at,
                priority=submission.priority, tenantid=submission.tenantid,
                jobid=submission.jobid, transportid=submission.transportid,
                localip=submission.localip, is_report=submission.is_report,
                size=accepted.size, domain=recipient_domain(rcpt),
                smtputf8=submission.smtputf8,
            )
            for i, rcpt in enumerate(submission.recipients)
        ]

    # -- submission --------------------------------------------------------------------

    def submit(self, submission: Submission, content: Content) -> Accepted:
        """Queue a message; returns once content and meta are durable."""
        return self.submit_future(submission, content).result()

    def submit_future(self, submission: Submission, content: Content
                      ) -> concurrent.futures.Future[Accepted]:
        """As submit(); the future resolves when durable (for async servers)."""
        now = self.clock()
        fut = self.store.submit_future(submission, content, now)

        def logged(done: concurrent.futures.Future[Accepted]) -> None:
            if done.cancelled() or done.exception() is not None:
                return
            accepted = done.result()
            self._log(
                (self._event(EventKind.RECEIVED, e, now, client=submission.client)
                 for e in self.entries_of(submission, accepted, now)),
                now,
            )

        fut.add_done_callback(logged)
        return fut

    # -- the queue manager's side ------------------------------------------------------

    def claim(self, limit: int) -> list[QueueEntry]:
        """Move up to ``limit`` due entries to active and return them (see Store.claim)."""
        return self.store.claim(limit, self.clock(), self.config.queue.quota_deferred)

    def mark_delivering(self, entries: Sequence[QueueEntry]) -> None:
        """Note that attempts started; returns once the store has the mark.

        Not flushed: recovery returns active and delivering entries alike,
        the mark only lets it say "in flight at crash, may be a duplicate"
        (see recover()).  The queue manager waits for it before the
        message's first byte goes out where it keeps no mark log (a shared
        queue, or a log that cannot be written): after a crash of the
        process (not of the machine) the mark is always there for an
        attempt that may have delivered.
        """
        self.mark_delivering_future(entries).result()

    def mark_delivering_future(self, entries: Sequence[QueueEntry]
                               ) -> concurrent.futures.Future[set[str]]:
        """As mark_delivering(), without waiting (for the queue manager's loop)."""
        return self.store.apply_future(
            [Transition(e.qid, QueueState.DELIVERING, expect=(QueueState.ACTIVE,))
             for e in entries],
            durable=False,
        )

    def release_claims(self, entries: Sequence[QueueEntry]) -> None:
        """Give claimed entries back untried (shutdown, dropped from memory)."""
        now = self.clock()
        self.store.apply(
            [Transition(e.qid, QueueState.DEFERRED if e.attempts else QueueState.INCOMING,
                        next_attempt_at=now if e.attempts else e.arrival_at,
                        expect=IN_FLIGHT_STATES)
             for e in entries]
        )

    def hold_claimed(self, entries: Sequence[QueueEntry]) -> list[QueueEntry]:
        """Put claimed entries on hold (a pre-delivery hook's decision)."""
        now = self.clock()
        applied = self.store.apply(
            [Transition(e.qid, QueueState.HOLD, expect=IN_FLIGHT_STATES) for e in entries])
        held = [e for e in entries if e.qid in applied]
        self._log((self._event(EventKind.HELD, e, now) for e in held), now)
        return held

    def drop_claimed(self, entries: Sequence[QueueEntry], reason: str = "") -> list[QueueEntry]:
        """Remove claimed entries without delivery or NDR (logged as discarded)."""
        now = self.clock()
        applied = self.store.apply(
            [Transition(e.qid, None, expect=IN_FLIGHT_STATES) for e in entries])
        dropped = [e for e in entries if e.qid in applied]
        reply = Reply(250, "2.0.0", f"dropped: {reason}" if reason else "dropped")
        self._log((self._event(EventKind.DISCARDED, e, now, reply=reply) for e in dropped), now)
        return dropped

    def record(
        self, results: Sequence[AttemptResult], *, flush: bool = False
    ) -> list[tuple[AttemptResult, QueueState | None]]:
        """Apply attempt outcomes; returns each result with the state it led to.

        The state is None when the entry is gone; results that did not apply
        are left out.  plan_record(), apply_record(), finish_record(): a
        caller on an event loop runs the three itself, waiting for the
        store's future rather than in a thread.  ``flush``: successes are
        flushed before it returns whatever queue.success_sync says.
        """
        results = self.log_successes(results)
        plan = self.plan_record(results, flush=flush)
        return self.finish_record(plan, self.apply_record(plan).result())

    def log_successes(self, results: Iterable[AttemptResult], trouble: LogTrouble | None = None
                      ) -> list[AttemptResult]:
        """Write the ``delivered`` lines of the successes among ``results``, now.

        Returns ``results`` as a list, with those successes marked logged
        and their time fixed, for plan_record and finish_record (which
        then skip their lines) and for the success journal.  Called before anything
        is durable: see "A success is logged before the store has it".
        Lines go in one write per time (a replay's successes keep theirs),
        each group marked once written: when the log cannot be written,
        the rest stay unmarked for finish_record to try after the commit,
        and ``trouble`` hears of it (without it: a warning).
        """
        out = list(results)
        if self.accounting is None:
            return out
        now = self.clock()
        groups: dict[float, list[int]] = {}
        for i, res in enumerate(out):
            if not res.logged and isinstance(res.outcome, Delivered):
                groups.setdefault(res.at_or(now), []).append(i)
        if not groups:
            return out
        with _reported(trouble):
            for at, idxs in groups.items():
                marked = [out[i].logged_at(at) for i in idxs]
                self._log([self._outcome_event(r, EventKind.DELIVERED, r.outcome.reply, at)
                           for r in marked], at)
                for i, res in zip(idxs, marked, strict=True):
                    out[i] = res
        return out

    def _outcome_event(self, res: AttemptResult, kind: EventKind, reply: Reply, at: float
                       ) -> dict[str, Any]:
        attempts = res.entry.attempts + (1 if res.attempted or kind is EventKind.DEFERRED
                                         else 0)
        return self._event(kind, res.entry, at, reply=reply, attempt=attempts,
                           localip=res.localip, remotemx=res.remotemx,
                           remoteip=res.remoteip, duration_s=res.duration_s)

    def plan_record(self, results: Sequence[AttemptResult], *, flush: bool = False
                    ) -> RecordPlan:
        """The store changes that record these outcomes (see record())."""
        now = self.clock()
        transitions: list[Transition] = []
        planned: list[tuple[AttemptResult, QueueState | None, EventKind, Reply]] = []
        stamped: dict[int, Reply] = {}  # recipients of one transaction share a reply
        delivered = False
        for res in results:
            e = res.entry
            reply = res.outcome.reply
            if res.attempted:
                # The reply says when it was got: the NDR's Last-Attempt-Date.
                got = stamped.get(id(reply))
                if got is None:
                    got = stamped[id(reply)] = reply.attempted_at(res.at_or(now))
                reply = got
            match res.outcome:
                case Delivered():
                    delivered = True
                    transitions.append(Transition(e.qid, None, reply=reply))
                    planned.append((res, None, EventKind.DELIVERED, reply))
                case PermFail():
                    transitions.append(Transition(
                        e.qid, QueueState.BOUNCE, next_attempt_at=now, reply=reply,
                        attempted=res.attempted, expect=IN_FLIGHT_STATES))
                    planned.append((res, QueueState.BOUNCE, EventKind.BOUNCED, reply))
                case TempFail():
                    failures = e.attempts + 1
                    at = self.retry.next_attempt_at(now, failures, e.arrival_at, e.is_report)
                    if at is None:
                        transitions.append(Transition(
                            e.qid, QueueState.BOUNCE, next_attempt_at=now, reply=reply,
                            attempted=res.attempted, expect=IN_FLIGHT_STATES))
                        planned.append((res, QueueState.BOUNCE, EventKind.EXPIRED, reply))
                    else:
                        transitions.append(Transition(
                            e.qid, QueueState.DEFERRED, next_attempt_at=at, reply=reply,
                            attempted=True, expect=IN_FLIGHT_STATES))
                        planned.append((res, QueueState.DEFERRED, EventKind.DEFERRED, reply))
        # A success is made durable in the store's group commit (or first in
        # the success journal, sluice.journal) before the queue manager
        # reuses the connection (docs/queue.md, "What is promised"): a
        # crash then sends it again only if it came in the last interval.
        # Failures alone are not flushed: lost in a power cut, a deferral
        # is only redone, never a lost message.  queue.success_sync "write"
        # treats successes so too (Postfix's own way): committed, written
        # to the kernel but not yet flushed, before the connection goes on.
        flushed = delivered and (self.flushes_successes or flush)
        return RecordPlan(now, transitions, planned, durable=flushed,
                          flush_soon=delivered and not flushed)

    def apply_record(self, plan: RecordPlan) -> concurrent.futures.Future[set[str]]:
        """Give ``plan``'s changes to the store; the future holds the qids applied."""
        return self.store.apply_future(plan.transitions, durable=plan.durable,
                                       flush_soon=plan.flush_soon)

    def finish_record(self, plan: RecordPlan, applied: set[str],
                      trouble: LogTrouble | None = None
                      ) -> list[tuple[AttemptResult, QueueState | None]]:
        """Log what the store applied of ``plan`` (unless logged first); record()'s answer.

        A log that cannot be written is reported to ``trouble`` (without
        it: a warning): the outcomes are in the store all the same.
        """
        out: list[tuple[AttemptResult, QueueState | None]] = []
        # By the time of each line (a replayed success's is its reply's): the
        # log's files are named by the time of their events.
        events: dict[float, list[dict[str, Any]]] = {}
        for res, state, kind, reply in plan.planned:
            if res.entry.qid not in applied:
                continue
            out.append((res, state))
            if res.logged:
                continue
            at = res.at_or(plan.now)
            events.setdefault(at, []).append(self._outcome_event(res, kind, reply, at))
        if not events:
            return out
        with _reported(trouble):
            for at, lines in events.items():
                self._log(lines, at)
        return out

    def expire(self, limit: int = 10000) -> int:
        """Bounce deferred entries past retry_maxtime (every bounces_interval)."""
        now = self.clock()
        total = 0
        while True:
            batch = self.store.expired(now - self.retry.maxtime_s,
                                       now - self.retry.maxtime_reports_s, limit)
            if not batch:
                return total
            transitions = [
                Transition(e.qid, QueueState.BOUNCE, next_attempt_at=now,
                           reply=e.last_reply or EXPIRED_REPLY, expect=(QueueState.DEFERRED,))
                for e in batch
            ]
            applied = self.store.apply(transitions)
            self._log(
                (self._event(EventKind.EXPIRED, e, now, reply=e.last_reply or EXPIRED_REPLY)
                 for e in batch if e.qid in applied),
                now,
            )
            total += len(applied)
            if len(batch) < limit or not applied:
                return total

    def run_bounces(self, limit: int = 1000) -> int:
        """Queue NDRs for entries in the bounce state; returns NDRs queued.

        Entries are leased first (store.claim_bounces), so concurrent runs --
        in other processes or on other nodes -- never report the same
        failure twice; a run that dies leaves them to the next one when the
        lease ends.
        """
        now = self.clock()
        total = 0
        while True:
            entries = self.store.claim_bounces(limit, now, NDR_LEASE_S)
            if not entries:
                return total
            total += self._ndrs_for(entries, now)
            if len(entries) < limit:
                return total

    def _ndrs_for(self, entries: Sequence[QueueEntry], now: float) -> int:
        by_spid: dict[str, list[QueueEntry]] = defaultdict(list)
        for e in entries:
            by_spid[e.spid].append(e)
        ndrs = 0
        for spid, group in by_spid.items():
            first = group[0]
            if first.is_report or not first.sender:
                # RFC 5321 6.1 / Mailismus: never an NDR for an NDR or for <>.
                kind = EventKind.DISCARDED
            else:
                try:
                    self._queue_ndr(spid, group, now)
                except StorageError:
                    continue  # try again on the next run; nothing is lost
                kind = EventKind.NDR
                ndrs += 1
            applied = self.store.apply(
                [Transition(e.qid, None, expect=(QueueState.BOUNCE,)) for e in group])
            self._log((self._event(kind, e, now, reply=e.last_reply)
                       for e in group if e.qid in applied), now)
        return ndrs

    def _queue_ndr(self, spid: str, group: Sequence[QueueEntry], now: float) -> Accepted:
        first = group[0]
        try:
            with self.store.open_content(spid) as stream:
                headers = read_header_block(stream, self.config.bounce.max_original_headers)
        except (StorageError, OSError):
            headers = b""
        failed = [
            FailedRecipient(
                recipient=e.recipient,
                reply=e.last_reply,
                last_attempt_at=e.last_reply.attempt_at if e.last_reply else None,
                remote_mta=(e.last_reply.remote_mta or None) if e.last_reply else None,
                expired=self.retry.is_expired(now, e.arrival_at, e.is_report)
                or (e.last_reply is not None and e.last_reply.is_transient),
            )
            for e in group
        ]
        report = build_ndr(
            reporting_mta=self.config.node.hostname,
            from_address=self.config.bounce.from_address,
            original_sender=first.sender,
            original_spid=spid,
            arrival_at=first.arrival_at,
            now=now,
            failed=failed,
            original_headers=headers,
            utf8=first.smtputf8,
        )
        # Flagged like the original, as Postfix does: the agent then asks for
        # SMTPUTF8 where it is offered, and elsewhere judges the NDR by its
        # own addresses and header block (docs/delivery.md).
        sub = Submission(sender="", recipients=(first.sender,), tenantid=first.tenantid,
                         jobid=first.jobid, transportid=first.transportid,
                         localip=first.localip, is_report=True, smtputf8=first.smtputf8)
        return self.submit(sub, report)

    # -- operator side ------------------------------------------------------------------

    def act(self, selector: Selector, action: Action, *, priority: int | None = None,
            reply: Reply | None = None) -> list[QueueEntry]:
        """Apply an operator action; returns the entries it touched (as they were)."""
        now = self.clock()
        touched = self.store.modify(selector, action, now, priority=priority, reply=reply)
        kind = _ACTION_EVENT[action]
        self._log((self._event(kind, e, now, reply=reply if action is Action.BOUNCE else None)
                   for e in touched), now)
        return touched

    def recover(self, delivered: Mapping[str, JournaledSuccess] | None = None,
                marked: Collection[str] = ()) -> int:
        """After a restart: in-flight entries return to the queue.

        Those whose attempt had started (state delivering, or still active
        with a mark in ``marked``, the mark log's: sluice.marks; the server
        may have the message) are logged as "recovered" with the reply
        IN_FLIGHT_REPLY, "in flight at crash, may be a duplicate".  On a
        queue other nodes share (PostgreSQL), only this node's: the others'
        attempts are in flight too.  Those ``delivered`` names (the success
        journal, sluice.journal) are recorded as delivered first, with the
        reply the journal kept, and are neither returned nor noted (on a
        queue of this node alone, whether or not the store had their
        "delivering" mark: the journal's line says the attempt was made);
        their ``delivered`` line was written before the journal had them,
        unless the journal says it could not be.
        """
        now = self.clock()
        if isinstance(self.store, SharedClaims):
            in_flight = candidates = self.store.own_in_flight()
        else:
            in_flight = list(self.store.entries(Selector(states=(QueueState.DELIVERING,))))
            candidates = in_flight
            if marked or delivered:
                claimed = list(self.store.entries(Selector(states=(QueueState.ACTIVE,))))
                candidates = in_flight + claimed
                in_flight = in_flight + [e for e in claimed if mark_of(e) in marked]
        if delivered:
            done = [delivered[e.qid].result(e) for e in candidates
                    if e.qid in delivered and delivered[e.qid].concerns(e)]
            if done:
                # Flushed whatever success_sync says: the journal goes next.
                self.record(done, flush=True)
                log.info("recorded %d deliveries from the success journal", len(done))
                replayed = {r.entry.qid for r in done}
                in_flight = [e for e in in_flight if e.qid not in replayed]
        count = self.store.recover(now)
        self._log((self._event(EventKind.RECOVERED, e, now, reply=IN_FLIGHT_REPLY)
                   for e in in_flight), now)
        return count
