"""The queue manager: the event loop around the sans-IO scheduler.

SUMMARY
    manager = QueueManager(config, queue, router=..., agent=..., hooks=...)
    await manager.run(stop_event)

DESCRIPTION
    The scheduler (sluice.scheduler) decides; this module does what it
    says and tells it what happened.  One asyncio task runs the loop:

        events so far  --handle_all(events, now)-->  commands
        Refill         claim from the store, run the pre-delivery hook,
                       route (transport map or DNS), group the recipients
                       of one message and destination into a job; answer
                       EntriesClaimed, then JobsQueued.
        StartDelivery  mark the entries delivering, hand the job to the
                       delivery agent, run the post-delivery hook; answer
                       DeliveryFinished; record the outcomes in the store.
        DeferJob       a dead destination: defer without a connection.

    and sleeps until the next event or the scheduler's next_wakeup().

    Around it, background tasks: the recorder (applies outcomes to the
    store in batches, and queues NDRs for bounces), the change-feed
    watcher (an operator changed entries this manager holds: drop them
    and give their claim back, so they come back re-read -- Halon's
    "re-inject"), the expiry sweep (every queue.bounces_interval), and the
    policy file watcher (a changed file is reloaded; a broken one is
    logged and the running policy kept).

STRATEGIES
    Blocking store calls run in a small thread pool, never on the loop.
    Outcomes are recorded in batches: while one batch commits, the next
    gathers (group commit again).  Route lookups of one refill are shared
    per (domain, transportid, nexthop).

    Graceful stop.  No refill and no new delivery once stopping; in-flight
    deliveries finish (for up to ``grace_s``), their outcomes are
    recorded, and every entry still held in memory gets its claim back.

INVARIANTS
    Every StartDelivery is answered by exactly one DeliveryFinished.
    Every claimed entry ends recorded, released, held or dropped; one
    that is not (a crash) is returned by the next start's recovery.

SEE ALSO
    sluice.scheduler (docs/scheduler.md), sluice.delivery, sluice.queue
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sluice.cluster.agent import ClusterAgent
from sluice.cluster.shared_limits import SharedLimits
from sluice.config import Config
from sluice.delivery.agent import DeliveryAgent, DeliveryRequest
from sluice.delivery.plan import Planner
from sluice.delivery.router import NextHop, Router
from sluice.hooks import Drop, Hold, Hooks
from sluice.model import PermFail, QueueEntry, QueueState, Reply, Selector, TempFail
from sluice.policyfile import load_policy_file, load_suspensions_file
from sluice.queue import AttemptResult, Queue
from sluice.scheduler import (
    AcquireGrants,
    ClusterLimits,
    Command,
    ConditionAdded,
    ConditionRemoved,
    DeferJob,
    DeliveryFinished,
    DeliveryJob,
    EntriesClaimed,
    EntriesModified,
    Event,
    JobsQueued,
    MailArrived,
    Policy,
    PolicyError,
    PolicyReloaded,
    Refill,
    ReturnGrants,
    Route,
    Scheduler,
    Settings,
    StartDelivery,
    Suspension,
    SuspensionAdded,
    SuspensionRemoved,
)
from sluice.shaping.runtime import Shaper
from sluice.store import Action as QueueAction

__all__ = ["ManagerStats", "QueueManager"]

log = logging.getLogger("sluice.manager")

T = TypeVar("T")

#: How soon a claim cut short by the per-domain cap (cluster mode) is tried again.
CAPPED_RETRY_S = 0.05


def _policy(path: str | None) -> Policy:
    # shaping: the counters a back-off condition needs (sluice.shaping.runtime).
    return Shaper.augment(load_policy_file(path) if path else Policy())


def _suspensions(path: str | None) -> tuple[Suspension, ...]:
    # The manual suspension file is created by the first suspension added at
    # run time; until then there is none.
    if not path or not os.path.exists(path):
        return ()
    return load_suspensions_file(path)


#: Events an operator sends (through the API or a signal), as opposed to the
#: ones the loop itself produces.
_OPERATOR_EVENTS = (PolicyReloaded, ConditionAdded, ConditionRemoved, SuspensionAdded,
                    SuspensionRemoved)


@dataclass(slots=True)
class _Job:
    job: DeliveryJob
    hop: NextHop
    entries: dict[str, QueueEntry]
    started: bool = False


@dataclass(slots=True)
class ManagerStats:
    """Counters since start, for the API and metrics."""

    claimed: int = 0
    deliveries: int = 0
    delivered: int = 0
    deferred: int = 0
    bounced: int = 0
    unrouted: int = 0
    started_at: float = field(default_factory=time.time)


class QueueManager:
    """Runs the scheduler against the store, the router and the delivery agent."""

    def __init__(self, config: Config, queue: Queue, *, router: Router,
                 agent: DeliveryAgent, hooks: Hooks | None = None,
                 clock: Callable[[], float] = time.time, grace_s: float = 30.0,
                 change_poll_s: float = 1.0, policy_poll_s: float = 2.0) -> None:
        self.config = config
        self.queue = queue
        self.router = router
        self.agent = agent
        self.hooks = hooks or Hooks()
        self.planner = Planner(router, self.hooks)
        self.clock = clock
        self.grace_s = grace_s
        self.change_poll_s = change_poll_s
        self.policy_poll_s = policy_poll_s
        self.policy_path = config.scheduler.policy
        policy = _policy(self.policy_path)
        suspensions = _suspensions(config.scheduler.suspensions)
        self._last_now = clock()
        # Several nodes: limits shared through Redis (sluice.cluster).
        shared = SharedLimits.from_config(config)
        self.scheduler = Scheduler(Settings.from_config(config), policy, suspensions,
                                   now=self._last_now,
                                   limits=None if shared is None else ClusterLimits())
        self.stats = ManagerStats()
        self._events: list[Event] = []
        self._wake = asyncio.Event()
        self._jobs: dict[str, _Job] = {}
        self._ref = itertools.count(1)
        self._routing: set[str] = set()  # qids claimed and being routed
        self._modified_while_routing: set[str] = set()
        self._pending: list[AttemptResult] = []
        self._delivering: list[QueueEntry] = []
        self._recorder: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._deliveries: set[asyncio.Task[Any]] = set()
        self._stopping = False
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="sluice-io")
        self._route_cache: dict[Route, Route] = {}
        self._policy_mtime = self._mtime(self.policy_path)
        self._change_seq = 0
        self._bounce_pending = False
        self.cluster = (None if shared is None else
                        ClusterAgent(config, queue, shared, post=self.post, clock=self._now,
                                     change=functools.partial(self.change, publish=False),
                                     policy=lambda: self.scheduler.policy))
        # shaping: remote replies change the limits (sluice.shaping; docs/shaping.md).
        self.shaper = Shaper(config, self.post, lambda: self.scheduler.policy, self._now)
        self.shaper.bounce = self._shaping_bounce

    # -- plumbing -----------------------------------------------------------------

    def _now(self) -> float:
        # The scheduler's time never goes backwards, even if the wall clock does.
        now = self.clock()
        if now < self._last_now:
            now = self._last_now
        self._last_now = now
        return now

    def post(self, event: Event) -> None:
        """Tell the scheduler something happened (from the loop's thread)."""
        self._events.append(event)
        self._wake.set()

    def change(self, event: Event, *, publish: bool = True) -> None:
        """An operator's change (a policy reload, a condition or suspension
        added or removed): checked now -- ValueError says what is wrong, and
        nothing changes -- then applied by the loop, and in a cluster given
        to the other nodes (``publish``: not when it came from them)."""
        if not isinstance(event, _OPERATOR_EVENTS):
            raise TypeError(f"{type(event).__name__} is not an operator change")
        self.scheduler.check(event)
        self.post(event)
        if publish and self.cluster is not None:
            self.cluster.publish(event)

    def notify_mail(self, count: int = 1) -> None:
        """New mail was queued: refill soon (receivers call this)."""
        self.post(MailArrived(count))

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args))

    def _spawn(self, coro: Any, *, delivery: bool = False) -> None:
        task = asyncio.ensure_future(coro)
        group = self._deliveries if delivery else self._tasks
        group.add(task)
        task.add_done_callback(group.discard)
        task.add_done_callback(self._task_done)

    @staticmethod
    def _task_done(task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

    @staticmethod
    def _mtime(path: str | None) -> float | None:
        if not path:
            return None
        try:
            return os.stat(path).st_mtime
        except OSError:
            return None

    # -- the loop ---------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set, then stop gracefully."""
        recovered = await self._io(self.queue.recover)
        if recovered:
            log.info("returned %d entries left in flight by the last run", recovered)
        self.post(MailArrived())
        background = [
            asyncio.ensure_future(self._watch_changes()),
            asyncio.ensure_future(self._sweep_expired()),
            asyncio.ensure_future(self._watch_policy()),
        ]
        if self.cluster is not None:
            background.append(asyncio.ensure_future(self.cluster.run(stop)))
        stopper = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                self._step()
                wake = self.scheduler.next_wakeup()
                shaping_wake = self.shaper.next_wakeup()  # shaping
                if shaping_wake is not None and (wake is None or shaping_wake < wake):
                    wake = shaping_wake
                timeout = None if wake is None else max(0.0, wake - self.clock())
                waiter = asyncio.ensure_future(self._wake.wait())
                await asyncio.wait({waiter, stopper}, timeout=timeout,
                                   return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                self._wake.clear()
        finally:
            stopper.cancel()
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await self._shutdown()

    def _step(self) -> None:
        self.shaper.tick(self._now())  # shaping: expiries and recovery steps, as events
        try:
            self._decide()
        finally:
            if self._delivering:
                # The "delivering" mark of every attempt started in this step,
                # as one store operation (not waited for; see mark_delivering).
                self.queue.mark_delivering(self._delivering)
                self._delivering = []

    def _decide(self) -> None:
        events, self._events = self._events, []
        now = self._now()
        if any(isinstance(e, _OPERATOR_EVENTS) for e in events):
            # Operator changes one at a time: one that is refused (it was
            # valid when posted, but an earlier change made it wrong) is
            # logged and dropped, never taking the deliveries' events with it.
            rest: list[Event] = []
            for event in events:
                if not isinstance(event, _OPERATOR_EVENTS):
                    rest.append(event)
                    continue
                try:
                    self._execute(self.scheduler.handle(event, now))
                except ValueError as exc:
                    log.error("operator change %s refused: %s", type(event).__name__, exc)
            events = rest
        if events:
            commands = self.scheduler.handle_all(events, now)
        else:
            wake = self.scheduler.next_wakeup()
            if wake is None or wake > now:
                return
            commands = self.scheduler.tick(now)
        self._execute(commands)

    def _execute(self, commands: Sequence[Command]) -> None:
        for cmd in commands:
            match cmd:
                case StartDelivery(job=job, localip=localip, qids=qids):
                    self._start(job, localip, qids)
                case Refill(limit=limit):
                    if self._stopping:
                        self.post(EntriesClaimed(0, exhausted=True))
                    else:
                        self._spawn(self._refill(limit))
                case DeferJob(job=job, qids=qids, reply=reply):
                    self._defer_dead(job, qids, reply)
                case AcquireGrants() | ReturnGrants():
                    if self.cluster is not None:
                        self.cluster.execute(cmd)

    # -- refill and routing ----------------------------------------------------------

    async def _refill(self, limit: int) -> None:
        try:
            entries = await self._io(self.queue.claim, limit)
        except Exception:
            log.exception("claiming entries failed; will try again")
            self.post(EntriesClaimed(0, exhausted=True))
            return
        exhausted = len(entries) < limit
        next_due = None
        if exhausted:
            with contextlib.suppress(Exception):
                next_due = await self._io(self.queue.store.due_at)
        self.stats.claimed += len(entries)
        self._routing.update(e.qid for e in entries)
        self.post(EntriesClaimed(len(entries), exhausted=exhausted, next_due_at=next_due))
        if getattr(self.queue.store, "last_claim_capped", False):
            # Left behind for the per-domain cap, not for want of mail: look
            # again soon, as this node's deliveries make room.
            asyncio.get_running_loop().call_later(CAPPED_RETRY_S, self.notify_mail, 0)
        if not entries:
            return
        try:
            jobs, unrouted = await self._route_all(entries)
        finally:
            self._routing.difference_update(e.qid for e in entries)
        modified = self._modified_while_routing
        if modified:
            # An operator changed some of these while they were being routed.
            keep_jobs = []
            for job in jobs:
                gone = [q for q in job.qids if q in modified]
                info = self._jobs[job.ref]
                if gone:
                    await self._release([info.entries.pop(q) for q in gone])
                    unrouted += len(gone)
                if info.entries:
                    if gone:
                        job = DeliveryJob(job.ref, job.spid, tuple(info.entries), job.route,
                                          job.priority, job.arrival_at)
                        info.job = job
                    keep_jobs.append(job)
                else:
                    del self._jobs[job.ref]
            modified.difference_update(e.qid for e in entries)
            jobs = keep_jobs
        self.post(JobsQueued(tuple(jobs), unrouted=unrouted))

    async def _route_all(self, entries: Sequence[QueueEntry]) -> tuple[list[DeliveryJob], int]:
        """Pre-delivery hook, routing and grouping into jobs (the Planner);
        what is not delivered now is held, dropped or recorded."""
        try:
            plan = await self.planner.plan(entries)
        except Exception:
            log.exception("planning %d entries failed; giving their claims back", len(entries))
            await self._release(entries)
            return [], len(entries)
        hold: list[QueueEntry] = []
        drop: list[tuple[QueueEntry, str]] = []
        failed: list[AttemptResult] = []
        for item in plan.settled:
            match item.decision:
                case Hold():
                    hold.append(item.entry)
                case Drop(reason=reason):
                    drop.append((item.entry, reason))
                case _:
                    failed.append(item.attempt_result())
        if hold:
            await self._io(self.queue.hold_claimed, hold)
        for entry, reason in drop:
            await self._io(self.queue.drop_claimed, [entry], reason)
        if failed:
            self._record(failed)
        jobs = []
        for planned in plan.jobs:
            ref = f"j{next(self._ref)}"
            first = planned.entries[0]
            job = DeliveryJob(ref, first.spid, tuple(e.qid for e in planned.entries),
                              self._intern(planned.scheduler_route()),
                              priority=planned.priority, arrival_at=first.arrival_at)
            self._jobs[ref] = _Job(job, planned.route, {e.qid: e for e in planned.entries})
            jobs.append(job)
        unrouted = len(plan.settled)
        self.stats.unrouted += unrouted
        return jobs, unrouted

    def _intern(self, route: Route) -> Route:
        """Equal routes as one object: the scheduler keys its sub-queues on them."""
        known = self._route_cache.get(route)
        if known is None:
            if len(self._route_cache) > 100_000:
                self._route_cache.clear()
            self._route_cache[route] = route
            known = route
        return known

    # -- delivery ------------------------------------------------------------------------

    def _start(self, job: DeliveryJob, localip: str, qids: tuple[str, ...]) -> None:
        info = self._jobs.get(job.ref)
        if info is None or self._stopping:
            # Stopping (or the job vanished): answer at once, give the claims back.
            entries = [info.entries[q] for q in qids if q in info.entries] if info else []
            self._jobs.pop(job.ref, None)
            self.post(DeliveryFinished(job.ref, (), connection_failed=False,
                                       new_connection=False, localip=localip))
            if entries:
                self._spawn(self._release(entries))
            return
        info.started = True
        entries = [info.entries[q] for q in qids]
        self._delivering.extend(entries)
        self.stats.deliveries += 1
        self._spawn(self._deliver(info, tuple(entries), localip), delivery=True)

    async def _deliver(self, info: _Job, entries: tuple[QueueEntry, ...], localip: str) -> None:
        ref = info.job.ref
        try:
            request = DeliveryRequest(
                route=info.hop, entries=entries,
                content=functools.partial(self.queue.store.open_content, entries[0].spid),
                localip=localip, smtputf8=entries[0].smtputf8)
            result = await self.agent.deliver(request)
            results = await self.planner.finish(result)
            self.shaper.observe(info.job.route, results)  # shaping
            self.shaper.take(self.hooks)  # shaping: Shape decisions of the post hook
            self.post(DeliveryFinished(
                ref, tuple((r.entry.qid, r.outcome) for r in results),
                connection_failed=result.connection_failed,
                new_connection=result.new_connection, localip=localip))
        except asyncio.CancelledError:
            # Stopped hard: the entries stay "delivering" and return at the next start.
            self.post(DeliveryFinished(ref, (), connection_failed=False,
                                       new_connection=False, localip=localip))
            raise
        except Exception:
            log.exception("delivery of %s failed unexpectedly", ref)
            reply = Reply(451, "4.3.0", "local error during delivery, will retry")
            results = [AttemptResult(e, TempFail(reply), attempted=False) for e in entries]
            self.post(DeliveryFinished(ref, tuple((e.qid, TempFail(reply)) for e in entries),
                                       connection_failed=False, new_connection=False,
                                       localip=localip))
        finally:
            self._jobs.pop(ref, None)
        self._record(results)

    def _defer_dead(self, job: DeliveryJob, qids: tuple[str, ...], reply: Reply) -> None:
        info = self._jobs.pop(job.ref, None)
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
        self._record(results)

    # -- recording -----------------------------------------------------------------------

    def _record(self, results: Iterable[AttemptResult]) -> None:
        self._pending.extend(results)
        if self._recorder is None or self._recorder.done():
            self._recorder = asyncio.ensure_future(self._flush())
            self._recorder.add_done_callback(self._task_done)

    async def _flush(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                applied = await self._io(self.queue.record, batch)
            except Exception:
                # The store is failing: the entries stay claimed and return at
                # the next start (or when the store works again and we restart).
                log.exception("recording %d outcomes failed", len(batch))
                continue
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
                self._bounce_soon()

    def _bounce_soon(self) -> None:
        if self._bounce_pending:
            return
        self._bounce_pending = True

        async def run() -> None:
            await asyncio.sleep(0.2)  # let a burst of bounces gather into fewer NDR runs
            self._bounce_pending = False
            try:
                queued = await self._io(self.queue.run_bounces)
            except Exception:
                log.exception("queueing NDRs failed; will try again")
                return
            if queued:
                self.notify_mail(queued)

        self._spawn(run())

    async def _release(self, entries: Sequence[QueueEntry]) -> None:
        if entries:
            try:
                await self._io(self.queue.release_claims, list(entries))
            except Exception:
                log.exception("giving back %d claims failed (recovered at next start)",
                              len(entries))

    # -- background duties ------------------------------------------------------------------

    async def _watch_changes(self) -> None:
        """Operator changes made to entries held here: drop and re-claim them."""
        # Changes made before this start do not concern this run's memory.
        self._change_seq, _ = await self._io(self.queue.store.changes_since, 0)
        while True:
            await asyncio.sleep(self.change_poll_s)
            try:
                seq, changes = await self._io(self.queue.store.changes_since, self._change_seq)
            except Exception:
                log.exception("reading the change feed failed")
                continue
            self._change_seq = seq
            if changes:
                self.apply_changes({c.qid for c in changes})

    def apply_changes(self, qids: set[str]) -> None:
        """Entries changed in the store by an operator: forget the in-memory copies."""
        held: list[QueueEntry] = []
        known: list[str] = []
        for info in list(self._jobs.values()):
            if info.started:
                continue  # an attempt in flight: its result meets the store's expect rule
            hit = [q for q in info.entries if q in qids]
            if not hit:
                continue
            known.extend(hit)
            held.extend(info.entries.pop(q) for q in hit)
            if not info.entries:
                self._jobs.pop(info.job.ref, None)
        self._modified_while_routing.update(q for q in qids if q in self._routing)
        if known:
            self.post(EntriesModified(tuple(known)))
            self._spawn(self._release(held))
        # A retry or release may have made mail due: look soon.
        self.notify_mail(0)

    async def _sweep_expired(self) -> None:
        interval = max(1.0, self.config.queue.bounces_interval)
        while True:
            try:
                expired = await self._io(self.queue.expire)
                if expired:
                    log.info("%d deferred entries expired", expired)
                    self._bounce_soon()
                # Bounces left by a crash or a failed NDR run are picked up here too.
                if (await self._io(self.queue.store.count))[QueueState.BOUNCE]:
                    self._bounce_soon()
            except Exception:
                log.exception("the expiry sweep failed")
            await asyncio.sleep(interval)

    async def _watch_policy(self) -> None:
        while True:
            await asyncio.sleep(self.policy_poll_s)
            if self.shaper.changed():  # shaping: the rules file changed
                self.shaper.reload()
            mtime = self._mtime(self.policy_path)
            if mtime == self._policy_mtime:
                continue
            self._policy_mtime = mtime
            self.reload_policy()

    def reload_policy(self, *, raise_errors: bool = False) -> Policy | None:
        """Read the policy file again; on error keep the running policy (and
        return None, or raise the PolicyError when ``raise_errors``)."""
        self.shaper.reload()  # shaping: its rules reload with the policy (SIGHUP, API)
        try:
            policy = _policy(self.policy_path)
        except PolicyError as exc:
            log.error("policy not reloaded, keeping the running one:\n%s", exc)
            if raise_errors:
                raise
            return None
        self.post(PolicyReloaded(policy))
        log.info("policy reloaded from %s", self.policy_path)
        return policy

    def _shaping_bounce(self, fired: Any) -> None:
        """shaping: bounce the queued mail of a group that will never accept."""
        domain = dict(fired.fields).get("recipientdomain")
        if not domain:
            log.error("shaping rule %s: bounce needs a recipient domain; nothing bounced",
                      fired.rule)
            return
        reply = Reply(550, "5.1.10" if "5.1.10" in fired.reply else "5.4.4",
                      f"destination will never accept: {fired.reply} "
                      f"(shaping rule {fired.rule})")
        selector = Selector(domain=domain, states=(QueueState.INCOMING, QueueState.DEFERRED))

        async def run() -> None:
            touched = await self._io(functools.partial(self.queue.act, selector,
                                                       QueueAction.BOUNCE, reply=reply))
            if touched:
                self.apply_changes({e.qid for e in touched})
                self._bounce_soon()

        self._spawn(run())

    # -- stopping ----------------------------------------------------------------------------

    async def _shutdown(self) -> None:
        self._stopping = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._deliveries:
            _done, pending = await asyncio.wait(set(self._deliveries), timeout=self.grace_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        # Drain what the scheduler still says (DeliveryFinished bookkeeping).
        with contextlib.suppress(Exception):
            self._step()
        if self._recorder is not None:
            with contextlib.suppress(Exception):
                await self._recorder
        if self._pending:
            with contextlib.suppress(Exception):
                await self._flush()
        leftovers = [e for info in self._jobs.values() for e in info.entries.values()]
        self._jobs.clear()
        await self._release(leftovers)
        await self.agent.close()
        self._pool.shutdown(wait=True)
