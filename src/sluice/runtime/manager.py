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
                       delivery agent, run the post-delivery hook and
                       record the outcomes in the store (durably, before
                       the connection is reused); answer DeliveryFinished.
        DeferJob       a dead destination: defer without a connection.

    and sleeps until the next event or the scheduler's next_wakeup().

    Around it, the duties, each a part that restarts after a crash
    (sluice.runtime.parts): the change-feed watcher (an operator changed
    entries this manager holds: drop them and give their claim back, so
    they come back re-read -- Halon's "re-inject"), the expiry sweep
    (every queue.bounces_interval), and the policy file watcher (a
    changed file is reloaded; a broken one is logged and the running
    policy kept).  And the work the loop starts: refills, deliveries, the
    recorder (applies outcomes to the store in batches), NDR runs.

TASKS
    run() owns every task it starts: the work in one asyncio.TaskGroup,
    the duties in a Supervisor inside it.  A duty that crashes is logged
    once and restarted after a back-off.  Work that crashes -- a bug, as
    expected failures are handled where they happen -- would leave the
    scheduler waiting for an answer that never comes, so it fails run()
    (and `sluice serve` stops with a message); so does a crash of the
    loop itself.  Stopping goes in order: the loop, the duties, refills
    and NDR runs, then deliveries (given grace_s to finish), the
    recorder, the claims still held.

STRATEGIES
    Blocking store calls run in a small thread pool, never on the loop.
    Route lookups of one refill are shared per (domain, transportid,
    nexthop).

    Graceful stop.  No refill and no new delivery once stopping; in-flight
    deliveries finish (for up to ``grace_s``), their outcomes are
    recorded, and every entry still held in memory gets its claim back.

    At least once, with short windows (docs/queue.md, "What is
    promised").  Each step's "delivering" marks are one store operation,
    and a delivery waits for it after the server's 354, before the
    message goes out: a crash after that point is logged at the next
    start as "in flight at crash, may be a duplicate".  Once the replies
    are in, the agent calls back (DeliveryRequest.settle): the outcomes
    go to the recorder's next group commit and the connection waits for
    it, so a success is durable one commit after its reply.  Outcomes of
    deliveries without a transaction are recorded after, as before.

    A failing store backs off.  A refill that cannot claim (a full disk)
    waits before the scheduler may ask again -- 50 ms, doubling, at most
    30 s by default -- and logs one warning, a reminder a minute, one line
    when it works again (sluice.runtime.parts.Trouble); so do the
    recorder and the NDR runs.  Each shows in /metrics while it fails.

INVARIANTS
    Every StartDelivery is answered by exactly one DeliveryFinished.
    Every claimed entry ends recorded, released, held or dropped; one
    that is not (a crash) is returned by the next start's recovery.

SEE ALSO
    sluice.scheduler (docs/scheduler.md), sluice.delivery, sluice.queue,
    sluice.runtime.parts
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sluice import faults
from sluice.cluster.agent import ClusterAgent
from sluice.cluster.shared_limits import SharedLimits
from sluice.config import Config
from sluice.delivery.agent import AgentStats, DeliveryAgent, DeliveryRequest, DeliveryResult
from sluice.delivery.plan import Planner
from sluice.delivery.router import NextHop, Router
from sluice.hooks import Drop, Hold, Hooks
from sluice.model import QueueEntry, QueueState, Reply, Selector, TempFail
from sluice.queue import AttemptResult, Queue
from sluice.runtime.parts import Health, Supervisor, Trouble
from sluice.runtime.policy_file import PolicyFile, load_suspensions
from sluice.runtime.recorder import Recorder
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
    PolicyReloaded,
    Refill,
    ReturnGrants,
    Route,
    Scheduler,
    Settings,
    StartDelivery,
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
                 change_poll_s: float = 1.0, policy_poll_s: float = 2.0,
                 health: Health | None = None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.config = config
        self.queue = queue
        self.router = router
        self.agent = agent
        self.hooks = hooks or Hooks()
        self.planner = Planner(router, self.hooks)
        self.clock = clock
        self.grace_s = grace_s
        self.change_poll_s = change_poll_s
        self.health = health or Health()
        self._sleep = sleep
        self.policy_file = PolicyFile(config.scheduler.policy, post=self.post,
                                      running=lambda: self.scheduler.policy,
                                      poll_s=policy_poll_s,
                                      augment=Shaper.augment)  # shaping: back-off counters
        policy = self.policy_file.load()
        suspensions = load_suspensions(config.scheduler.suspensions)
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
        self._delivering: list[QueueEntry] = []
        self._marked: asyncio.Future[None] | None = None  # the mark of this step's starts
        self._group: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._deliveries: set[asyncio.Task[Any]] = set()
        self._stopping = False
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="sluice-io")
        self._route_cache: dict[Route, Route] = {}
        self._change_seq: int | None = None
        self._claiming = self.health.part("claiming mail")
        self.recorder = Recorder(queue, self.stats, self.health, spawn=self._spawn, io=self._io,
                                 notify_mail=self.notify_mail, sleep=sleep)
        self.cluster = (None if shared is None else
                        ClusterAgent(config, queue, shared, post=self.post, clock=self._now,
                                     change=functools.partial(self.change, publish=False),
                                     policy=lambda: self.scheduler.policy))
        # shaping: remote replies change the limits (sluice.shaping; docs/shaping.md).
        self.shaper = Shaper(config, self.post, lambda: self.scheduler.policy, self._now)
        self.shaper.bounce = self._shaping_bounce
        self.policy_file.on_poll = self._poll_shaping  # shaping: its rules file is watched

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

    def _spawn(self, coro: Coroutine[Any, Any, None], *, delivery: bool = False
               ) -> asyncio.Task[None] | None:
        """Start work owned by run()'s task group (None: the group is ending)."""
        if self._group is None:
            coro.close()
            raise RuntimeError("the queue manager is not running")
        try:
            task = self._group.create_task(coro)
        except RuntimeError:
            # The group is shutting down after a failure: what this work
            # would have done is redone at the next start (recovery).
            coro.close()
            return None
        group = self._deliveries if delivery else self._tasks
        group.add(task)
        task.add_done_callback(group.discard)
        return task

    # -- the loop ---------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set, then stop gracefully.

        Raises (an ExceptionGroup from the task group) when the loop or work
        it started crashed; the claims held are given back first as far as
        the store allows."""
        recovered = await self._io(self.queue.recover)
        if recovered:
            log.info("returned %d entries left in flight by the last run", recovered)
        self.post(MailArrived())
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                try:
                    async with Supervisor(self.health, sleep=self._sleep) as duties:
                        duties.keep("change feed watcher", self._watch_changes)
                        duties.keep("expiry sweep", self._sweep_expired)
                        duties.keep("policy file watcher", self.policy_file.watch)
                        if self.cluster is not None:
                            duties.keep("cluster agent", self._cluster_part(stop))
                        await self._loop(stop)
                finally:
                    await self._shutdown()
        finally:
            self._group = None
            await self.agent.close()
            self._pool.shutdown(wait=True)

    def _cluster_part(self, stop: asyncio.Event) -> Callable[[Trouble], Awaitable[None]]:
        """The cluster agent as a part: Redis heartbeats, grants, shared changes."""
        agent = self.cluster
        assert agent is not None

        async def run(trouble: Trouble) -> None:
            await agent.run(stop)

        return run

    async def _loop(self, stop: asyncio.Event) -> None:
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
                try:
                    await asyncio.wait({waiter, stopper}, timeout=timeout,
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()
                self._wake.clear()
        finally:
            stopper.cancel()

    def _step(self) -> None:
        self.shaper.tick(self._now())  # shaping: expiries and recovery steps, as events
        try:
            self._decide()
        finally:
            if self._delivering:
                # The "delivering" mark of every attempt started in this step,
                # as one store operation; each waits for it after 354.
                entries, marked = self._delivering, self._marked
                self._delivering, self._marked = [], None
                if marked is not None and self._spawn(self._mark(entries, marked)) is None:
                    marked.set_result(None)

    async def _mark(self, entries: list[QueueEntry], marked: asyncio.Future[None]) -> None:
        try:
            await self._io(self.queue.mark_delivering, entries)
        except Exception as exc:
            self.recorder.failed(exc)  # only the note at a restart is missed
        finally:
            if not marked.done():
                marked.set_result(None)

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
                    if self._stopping or self._spawn(self._refill(limit)) is None:
                        self.post(EntriesClaimed(0, exhausted=True))
                case DeferJob(job=job, qids=qids, reply=reply):
                    self._defer_dead(job, qids, reply)
                case AcquireGrants() | ReturnGrants():
                    if self.cluster is not None:
                        self.cluster.execute(cmd)

    # -- refill and routing ----------------------------------------------------------

    async def _refill(self, limit: int) -> None:
        try:
            entries = await self._io(self.queue.claim, limit)
        except Exception as exc:
            # A failing store (a full disk): wait before the scheduler may
            # ask again -- it asks for no other refill while this one is open.
            await self._sleep(self._claiming.failed(exc))
            self.post(EntriesClaimed(0, exhausted=True))
            return
        self._claiming.ok()
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
                    await self.recorder.release([info.entries.pop(q) for q in gone])
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
            await self.recorder.release(entries)
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
        try:
            if hold:
                await self._io(self.queue.hold_claimed, hold)
            for entry, reason in drop:
                await self._io(self.queue.drop_claimed, [entry], reason)
        except Exception as exc:
            # Still claimed in the store: they return at the next start.
            self.recorder.failed(exc)
        if failed:
            self.recorder.record(failed)
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
                self._spawn(self.recorder.release(entries))
            return
        info.started = True
        entries = [info.entries[q] for q in qids]
        self._delivering.extend(entries)
        if self._marked is None:
            self._marked = asyncio.get_running_loop().create_future()
        self.stats.deliveries += 1
        if self._spawn(self._deliver(info, tuple(entries), localip, self._marked),
                       delivery=True) is None:
            self.post(DeliveryFinished(job.ref, (), connection_failed=False,
                                       new_connection=False, localip=localip))

    async def _deliver(self, info: _Job, entries: tuple[QueueEntry, ...], localip: str,
                       marked: asyncio.Future[None]) -> None:
        ref = info.job.ref
        # Outcomes made durable while the agent still held the connection.
        settled: list[AttemptResult] = []

        async def started() -> None:
            await asyncio.shield(marked)

        async def settle(result: DeliveryResult) -> None:
            results = await self.planner.finish(result)
            settled.extend(results)
            await asyncio.shield(self.recorder.record(results))
            faults.point("after_commit")

        rest: list[AttemptResult] = []
        try:
            request = DeliveryRequest(
                route=info.hop, entries=entries,
                content=functools.partial(self.queue.store.open_content, entries[0].spid),
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
            done = {r.entry.qid for r in settled}
            rest = [AttemptResult(e, TempFail(reply), attempted=False) for e in entries
                    if e.qid not in done]
            self.post(DeliveryFinished(ref, tuple((r.entry.qid, r.outcome)
                                                  for r in settled + rest),
                                       connection_failed=False, new_connection=False,
                                       localip=localip))
        finally:
            self._jobs.pop(ref, None)
        if rest:
            self.recorder.record(rest)

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
        self.recorder.record(results)

    # -- duties (parts that restart) ------------------------------------------------------

    async def _watch_changes(self, trouble: Trouble) -> None:
        """Operator changes made to entries held here: drop and re-claim them."""
        if self._change_seq is None:
            # Changes made before this start do not concern this run's memory.
            self._change_seq, _ = await self._io(self.queue.store.changes_since, 0)
        while True:
            await asyncio.sleep(self.change_poll_s)
            seq, changes = await self._io(self.queue.store.changes_since, self._change_seq)
            trouble.ok()
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
            self._spawn(self.recorder.release(held))
        # A retry or release may have made mail due: look soon.
        self.notify_mail(0)

    async def _sweep_expired(self, trouble: Trouble) -> None:
        interval = max(1.0, self.config.queue.bounces_interval)
        while True:
            expired = await self._io(self.queue.expire)
            if expired:
                log.info("%d deferred entries expired", expired)
                self.recorder.bounce_soon()
            # Bounces left by a crash or a failed NDR run are picked up here too.
            if (await self._io(self.queue.store.count))[QueueState.BOUNCE]:
                self.recorder.bounce_soon()
            trouble.ok()
            await asyncio.sleep(interval)

    @property
    def policy_path(self) -> str | None:
        return self.policy_file.path

    @property
    def connections(self) -> AgentStats:
        """The delivery agent's connection counters."""
        return self.agent.stats

    def parts(self) -> list[Trouble]:
        """Every part of the process with its failures (Health)."""
        return self.health.parts()

    def _poll_shaping(self) -> None:
        if self.shaper.changed():  # shaping: the rules file changed
            self.shaper.reload()

    def reload_policy(self, *, raise_errors: bool = False, who: str = "",
                      reason: str = "") -> Policy | None:
        """Read the policy file again (PolicyFile.reload), and the shaping
        rules with it (SIGHUP, the API)."""
        self.shaper.reload()  # shaping
        return self.policy_file.reload(raise_errors=raise_errors, who=who, reason=reason)

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
                self.recorder.bounce_soon()

        self._spawn(run())

    # -- stopping ----------------------------------------------------------------------------

    async def _shutdown(self) -> None:
        """Stop in order: refills and NDR runs, deliveries (with grace), the
        recorder, the claims still held in memory."""
        self._stopping = True
        recorder = self.recorder.task
        others = [t for t in self._tasks if t is not recorder]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        if self._deliveries:
            _done, pending = await asyncio.wait(set(self._deliveries), timeout=self.grace_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        # Drain what the scheduler still says (DeliveryFinished bookkeeping).
        try:
            self._step()
        except Exception:
            log.exception("the scheduler failed while stopping")
        await self.recorder.drain()
        leftovers = [e for info in self._jobs.values() for e in info.entries.values()]
        self._jobs.clear()
        await self.recorder.release(leftovers)
