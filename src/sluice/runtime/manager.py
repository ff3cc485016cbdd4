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

    This module is the loop and its wiring; the nouns it drives are
    files of their own:

        jobs.py         the jobs held between routing and delivery
        refill.py       Refill: claim, plan (hook, routing), group into jobs
        deliveries.py   StartDelivery and DeferJob; the step's marks
        duties.py       the change-feed watcher and the expiry sweep
        recorder.py     outcomes to the store, NDR runs, claims given back
        policy_file.py  the policy file watcher

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
    promised").  Each step's "delivering" marks are one line of the mark
    log (sluice.marks), or where none can be kept one store operation; a
    delivery waits for it after the server's 354, before
    the message goes out: a crash after that point is logged at the next
    start as "in flight at crash, may be a duplicate".  Once the replies
    are in, the agent calls back (DeliveryRequest.settle): the outcomes
    go to the recorder's next group commit and the connection waits for
    it (or, with a success journal, for its sync, which precedes the
    store's: sluice.journal), so a success is durable one commit after its
    reply.  Outcomes of deliveries without a transaction are recorded
    after, as before.

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
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from sluice import cluster
from sluice.config import Config
from sluice.delivery.agent import AgentStats, DeliveryAgent
from sluice.delivery.plan import Planner
from sluice.delivery.router import Router
from sluice.hooks import Hooks
from sluice.journal import JournaledSuccess, SuccessJournal, journal_paths, read_journal
from sluice.marks import MarkLog, mark_files, mark_paths, read_marks
from sluice.model import QueueState, Reply, Selector
from sluice.queue import Queue
from sluice.runtime.deliveries import Deliveries
from sluice.runtime.duties import ChangeWatcher, ExpirySweep
from sluice.runtime.jobs import Jobs
from sluice.runtime.parts import Health, Supervisor, Trouble
from sluice.runtime.policy_file import PolicyFile, load_suspensions
from sluice.runtime.recorder import Recorder
from sluice.runtime.refill import Refiller
from sluice.scheduler import (
    AcquireGrants,
    ClusterLimits,
    Command,
    ConditionAdded,
    ConditionRemoved,
    DeferJob,
    EntriesClaimed,
    EntriesModified,
    Event,
    MailArrived,
    Policy,
    PolicyReloaded,
    Refill,
    ReturnGrants,
    Scheduler,
    Settings,
    StartDelivery,
    SuspensionAdded,
    SuspensionRemoved,
)
from sluice.shaping.runtime import Shaper
from sluice.store import Action as QueueAction
from sluice.store import SharedClaims

if TYPE_CHECKING:
    from sluice.cluster.agent import ClusterAgent
    from sluice.cluster.shared_limits import SharedLimits

__all__ = ["ManagerStats", "QueueManager"]

log = logging.getLogger("sluice.manager")

T = TypeVar("T")

#: Events an operator sends (through the API or a signal), as opposed to the
#: ones the loop itself produces.
_OPERATOR_EVENTS = (PolicyReloaded, ConditionAdded, ConditionRemoved, SuspensionAdded,
                    SuspensionRemoved)


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
        # Several nodes: limits shared through Redis (sluice.cluster).  The
        # Redis and PostgreSQL clients are imported only then: they are a
        # third of this process's memory, and a killed process closes its
        # connections only once the kernel has freed all of it (a next hop
        # that answers meanwhile gets the message twice; docs/queue.md).
        shared: SharedLimits | None = None
        if cluster.enabled(config):
            from sluice.cluster.shared_limits import SharedLimits

            shared = SharedLimits.from_config(config)
        self.scheduler = Scheduler(Settings.from_config(config), policy, suspensions,
                                   now=self._last_now,
                                   limits=None if shared is None else ClusterLimits())
        self.stats = ManagerStats()
        self._events: list[Event] = []
        self._wake = asyncio.Event()
        self.jobs = Jobs()
        self._group: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._deliveries: set[asyncio.Task[Any]] = set()
        self._stopping = False
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="sluice-io")
        claiming = self.health.part("claiming mail")
        self.recorder = Recorder(queue, self.stats, self.health, spawn=self._spawn, io=self._io,
                                 notify_mail=self.notify_mail, sleep=sleep)
        self.refiller = Refiller(queue, self.planner, self.recorder, self.jobs, self.stats,
                                 claiming, io=self._io, post=self.post,
                                 notify_mail=self.notify_mail, sleep=sleep)
        self.change_watcher = ChangeWatcher(queue.store, io=self._io, apply=self.apply_changes,
                                            poll_s=change_poll_s)
        self.expiry_sweep = ExpirySweep(queue, self.recorder, io=self._io,
                                        interval_s=config.queue.bounces_interval)
        self.cluster: ClusterAgent | None = None
        if shared is not None:
            from sluice.cluster.agent import ClusterAgent

            self.cluster = ClusterAgent(config, queue, shared, post=self.post, clock=self._now,
                                        change=functools.partial(self.change, publish=False),
                                        policy=lambda: self.scheduler.policy)
        # shaping: remote replies change the limits (sluice.shaping; docs/shaping.md),
        # on every node of a cluster (share).
        self.shaper = Shaper(config, self.share, lambda: self.scheduler.policy, self._now)
        self.shaper.bounce = self._shaping_bounce
        self.shaper.taken = self.scheduler.uses_id
        self.policy_file.on_poll = self._poll_shaping  # shaping: its rules file is watched
        self.deliveries = Deliveries(queue, self.planner, self.recorder, agent, self.shaper,
                                     self.hooks, self.jobs, self.stats, post=self.post,
                                     spawn=self._spawn,
                                     spawn_delivery=functools.partial(self._spawn, delivery=True),
                                     stopping=lambda: self._stopping)
        self.recorder.on_applied = self.deliveries.applied

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
        """Check an operator's change now, then have the loop apply it.

        The change is a policy reload, or a condition or suspension added
        or removed.  ValueError says what is wrong, and nothing changes;
        in a cluster it is given to the other nodes (``publish``: not when
        it came from them).
        """
        if not isinstance(event, _OPERATOR_EVENTS):
            raise TypeError(f"{type(event).__name__} is not an operator change")
        self.scheduler.check(event)
        if publish:
            self.share(event)
        else:
            self.post(event)

    def share(self, event: Event) -> None:
        """Apply a change made on this node here, and in a cluster on every node.

        The operator's changes (change()) and the shaping rules' actions
        come this way; changes from the other nodes do not (they come
        through change(publish=False)), so no change goes round twice.
        Nothing here audits: whoever made the change did, on this node.
        """
        self.post(event)
        if self.cluster is not None:
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

        Raises an ExceptionGroup (from the task group) when the loop or work
        it started crashed; the claims held are given back first as far as
        the store allows.
        """
        journal = journal_paths(self.config.queue.path, self.config.node.id)
        # A journal an earlier run left is replayed even if this one keeps none.
        try:
            delivered: dict[str, JournaledSuccess] | None = await self._io(read_journal, journal)
        except OSError as exc:  # its successes may go twice: never a reason not to start
            log.error("cannot read the success journal (%s); it is left as it is and this "
                      "run keeps none", exc)
            delivered = None
        # The mark log (sluice.marks): a queue of this node alone keeps one,
        # and reads every one under queue.path, whichever node id named it.
        keeps_marks = not isinstance(self.queue.store, SharedClaims)
        marks = mark_paths(self.config.queue.path, self.config.node.id)
        left = await self._io(mark_files, self.config.queue.path) if keeps_marks else []
        try:
            marked = await self._io(read_marks, left)
        except OSError as exc:  # never a reason not to start
            log.error("cannot read the mark log (%s); attempts only it named return "
                      "without a note", exc)
            marked = set()
        recovered = await self._io(self.queue.recover, delivered, marked)
        if recovered:
            log.info("returned %d entries left in flight by the last run", recovered)
        if delivered is not None and self.config.queue.journals_successes:
            try:
                self.recorder.journal = await self._io(
                    SuccessJournal.open, journal, asyncio.get_running_loop())
            except OSError as exc:
                log.error("cannot open the success journal (%s); this run keeps none", exc)
        elif delivered is not None:
            for path in journal:
                await self._io(path.unlink, True)
        if keeps_marks:
            self.deliveries.marks = await self._io(self._open_marks, marks, left)
        self.post(MailArrived())
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                try:
                    async with Supervisor(self.health, sleep=self._sleep) as duties:
                        duties.keep("change feed watcher", self.change_watcher.run)
                        duties.keep("expiry sweep", self.expiry_sweep.run)
                        duties.keep("policy file watcher", self.policy_file.watch)
                        if self.cluster is not None:
                            duties.keep("cluster agent", self._cluster_part(stop))
                        await self._loop(stop)
                finally:
                    await self._shutdown()
        finally:
            self._group = None
            await self.agent.close()
            journal_open, self.recorder.journal = self.recorder.journal, None
            if journal_open is not None:
                await self._io(journal_open.close)
            marks_open, self.deliveries.marks = self.deliveries.marks, None
            if marks_open is not None:
                marks_open.close()
            self._pool.shutdown(wait=True)

    @staticmethod
    def _open_marks(mine: Sequence[Path], left: Sequence[Path]) -> MarkLog | None:
        """This run's mark log, empty; the files of other node ids go (read already).

        None if it cannot be opened: the deliveries then wait for the
        store's mark, and this node's files are removed, so that no old
        line is read at a later start.
        """
        for path in left:
            if path not in mine:
                with contextlib.suppress(OSError):
                    path.unlink()
        try:
            return MarkLog.open(mine)
        except OSError as exc:
            log.error("cannot open the mark log (%s); deliveries wait for the store's "
                      "mark", exc)
            for path in mine:
                with contextlib.suppress(OSError):
                    path.unlink()
            return None

    def _cluster_part(self, stop: asyncio.Event) -> Callable[[Trouble], Awaitable[None]]:
        """The cluster agent as a part: Redis heartbeats, grants, shared changes."""
        agent = self.cluster
        assert agent is not None

        async def run(trouble: Trouble) -> None:
            await agent.run(stop)

        return run

    async def _loop(self, stop: asyncio.Event) -> None:
        # One wake-up for events and for stop: the loop awaits the Event
        # itself, with no task (nor asyncio.wait's futures) made per turn.
        stopper = asyncio.ensure_future(stop.wait())
        stopper.add_done_callback(lambda _: self._wake.set())
        try:
            while not stop.is_set():
                self._step()
                wake = self.scheduler.next_wakeup()
                shaping_wake = self.shaper.next_wakeup()  # shaping
                if shaping_wake is not None and (wake is None or shaping_wake < wake):
                    wake = shaping_wake
                if not self._wake.is_set():
                    timeout = None if wake is None else max(0.0, wake - self.clock())
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(timeout):
                            await self._wake.wait()
                self._wake.clear()
        finally:
            stopper.cancel()

    def _step(self) -> None:
        self.shaper.tick(self._now())  # shaping: expiries and recovery steps, as events
        try:
            self._decide()
        finally:
            # The "delivering" mark of every attempt started in this step:
            # one line of the mark log, else one store operation; each
            # waits for it after 354.
            self.deliveries.mark_started()

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
                    self.deliveries.start(job, localip, qids)
                case Refill(limit=limit):
                    if self._stopping or self._spawn(self.refiller.refill(limit)) is None:
                        self.post(EntriesClaimed(0, exhausted=True))
                case DeferJob(job=job, qids=qids, reply=reply):
                    self.deliveries.defer_dead(job, qids, reply)
                case AcquireGrants() | ReturnGrants():
                    if self.cluster is not None:
                        self.cluster.execute(cmd)

    def apply_changes(self, qids: set[str]) -> None:
        """Entries changed in the store by an operator: forget the in-memory copies."""
        known, held = self.jobs.forget(qids)
        if known:
            self.post(EntriesModified(tuple(known)))
            self._spawn(self.recorder.release(held))
        # A retry or release may have made mail due: look soon.
        self.notify_mail(0)

    @property
    def policy_path(self) -> str | None:
        """The policy file in use, if there is one."""
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
        """Read the policy file again, and the shaping rules with it.

        For SIGHUP and the API; PolicyFile.reload says what is returned and
        raised.
        """
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
        """Stop in order, then give back the claims still held in memory.

        The order: refills and NDR runs, deliveries (with grace), the
        recorder.
        """
        self._stopping = True
        recorder = self.recorder.tasks
        others = [t for t in self._tasks if t not in recorder]
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
        await self.recorder.release(self.jobs.clear())
