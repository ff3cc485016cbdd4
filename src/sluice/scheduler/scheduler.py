"""The scheduler: which delivery goes next, from which source IP, and when.

SUMMARY
    sched = Scheduler(Settings.from_config(cfg), policy, suspensions)
    commands = sched.handle(event, now)      # or handle_all(events, now)
    at = sched.next_wakeup()                 # sleep until then, or an event

DESCRIPTION
    A sans-IO core: it never reads the clock, touches a socket or a file.
    The runtime feeds it events with the current time and carries out the
    commands it returns (events.py lists both).  This class holds the
    state and routes events, timers and commands to the parts, each in a
    file of its own:

        checks.py         refusals: misuse raises before anything changes
        queueing.py       jobs in (JobsQueued), changed, deferred, finished
        pickup.py         select, visit, start, requeue; minimum shares
        bindings.py       the policy bound to sub-queues and flights
        active.py         the active queue: memory in recipients, refills
        subqueues.py      sub-queues of jobs (FIFO), the emptied ones kept
        lines.py          the ring of ready sub-queues, blockers and waiters
        limits.py         the seam: counter entries checked and counted
          limits_grouped.py    (the fast one)  limits_reference.py (plain)
        suspensions.py    suspensions, indexed by the fields they name
        destinations.py   slow start, cohort failure, the status cache
        timers.py         rate windows, intervals, expiries, revivals
        observe.py        the views and explanations, on request

    One step (handle_all): refuse misuse before anything changes, fire
    the timers that are due, apply the events in order (results first
    release what they held), then pick: visit sub-queues in turn -- woken
    ones first, priority 1 before 0 -- until max_deliveries are in flight
    or none is ready; each visit starts the head job from a source IP that
    nothing holds, or parks the sub-queue on what holds it.  Last, ask for
    a refill if there is room.

STRATEGIES
    Round robin over sub-queues, FIFO inside one, parking instead of
    scanning (lines.py, pickup.py); the limits seam (limits.py); slow
    start and the destination status cache (destinations.py); a bounded
    active queue (active.py).  Source IP pools (Halon): a job may use any
    of its route's source IPs; they are tried in turn from where the
    sub-queue's last pickup left off, and a suspended or held IP is
    skipped (pickup.py).  The parts in functions (checks, queueing,
    pickup, bindings, observe) read this class's state directly: one
    owner of the state, no copies to keep in step.

INVARIANTS
    In flight per counter entry <= its concurrency; pickups of an entry in
    any window of Y seconds <= X; deliveries in flight <= max_deliveries;
    no parked sub-queue whose blockers all have room unless it has been
    woken; FIFO in a sub-queue; time never goes backwards (handle()
    raises ValueError and the state is unchanged, as for any misuse).

SEE ALSO
    docs/scheduler.md (the event loop and which file does what),
    sluice.scheduler.events, seeds/001, seeds/003, seeds/004
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from sluice.scheduler import bindings, checks, observe, pickup, queueing
from sluice.scheduler.active import ActiveQueue
from sluice.scheduler.destinations import Destinations
from sluice.scheduler.events import (
    ClockTicked,
    ClusterModeChanged,
    Command,
    ConditionAdded,
    ConditionRemoved,
    DeliveryFinished,
    EntriesClaimed,
    EntriesModified,
    Event,
    GrantsChanged,
    JobsQueued,
    MailArrived,
    PolicyReloaded,
    SuspensionAdded,
    SuspensionRemoved,
)
from sluice.scheduler.explanation import Explanation
from sluice.scheduler.limits import Limits
from sluice.scheduler.limits_grouped import GroupedLimits
from sluice.scheduler.lines import Blocker, Lines
from sluice.scheduler.policy import Policy, Suspension
from sluice.scheduler.settings import Settings
from sluice.scheduler.subqueues import Flight, Job, SubQueue, SubQueues
from sluice.scheduler.suspensions import Suspended, Suspensions
from sluice.scheduler.timers import Due, Timer, Timers
from sluice.scheduler.views import (
    CounterView,
    DestinationView,
    QueueStats,
    SubQueueView,
    SuspensionView,
    TenantView,
)

__all__ = ["Scheduler"]


class Scheduler:
    """The active queue's decisions; see the module docstring."""

    def __init__(self, settings: Settings | None = None, policy: Policy | None = None,
                 suspensions: Iterable[Suspension] = (), now: float = 0.0,
                 limits: Limits[Any] | None = None) -> None:
        self.settings = s = settings or Settings()
        self._now = now
        self._limits: Limits[Any] = limits if limits is not None else GroupedLimits()
        self._timers = Timers()
        self._shares = s.shares
        self._lines = Lines(self._set_slot_timer, s.shares,
                            functools.partial(pickup.needs, self)
                            if s.shares.any_min_share else None)
        self._susps = Suspensions()
        self._dests = Destinations(s)
        self._queues = SubQueues(s.destination_cache_size + s.maxmemoryqueue,
                                 functools.partial(bindings.forget, self))
        self._active = ActiveQueue(s)
        self._qids: dict[str, Job | Flight] = {}
        self._flights: dict[str, Flight] = {}
        self._policy = Policy()
        self._version = 0  # of the policy: sub-queues bound under another bind again
        self._pickups = 0
        # Per tenant: deliveries in flight and started (for shares and /metrics).
        self._tenant_inflight: dict[str, int] = {}
        self._tenant_pickups: dict[str, int] = {}
        bindings.set_policy(self, policy or Policy(), now)
        for susp in suspensions:
            self._add_suspension(susp, now, from_file=False)

    # ------------------------------------------------------------------ API

    @property
    def policy(self) -> Policy:
        """The policy in force (the file's, with run-time conditions)."""
        return self._policy

    @property
    def pickups(self) -> int:
        """Deliveries started so far (a statistic)."""
        return self._pickups

    @property
    def now(self) -> float:
        """The time of the last step (it never goes backwards)."""
        return self._now

    @property
    def memory_used(self) -> int:
        """Recipients held or asked for (claimed, routing, queued, in flight)."""
        return self._active.memory_used

    def check(self, event: Event) -> None:
        """Raise ValueError if ``event`` would be refused, changing nothing.

        For callers that accept operator changes (an API) and want to answer
        a bad request at once, before posting the event to the loop.
        """
        checks.check(self, event)

    def handle(self, event: Event, now: float) -> list[Command]:
        """Take one event at ``now``; return what to do."""
        return self.handle_all((event,), now)

    def tick(self, now: float) -> list[Command]:
        """Time passed (the runtime woke at next_wakeup())."""
        return self.handle_all((ClockTicked(),), now)

    def handle_all(self, events: Iterable[Event], now: float) -> list[Command]:
        """Take several events that happened by ``now``, then decide once."""
        if now < self._now:
            raise ValueError(f"time went backwards: {now} < {self._now}")
        events = tuple(events)
        checks.misuse(self, events)  # refuse misuse before anything changes
        self._now = now
        out: list[Command] = []
        for timer in self._timers.due(now, self._timer_live):
            self._fire(timer, now)
        lines = self._lines
        for event in events:
            if type(event) is DeliveryFinished:
                queueing.finish(self, event, now, out)
            else:
                lines.release_dirty(now)  # in the order things happened
                self._dispatch(event, now, out)
        lines.release_dirty(now)
        pickup.select(self, now, out)
        refill = self._active.refill(now)
        if refill is not None:
            out.append(refill)
        self._limits.collect(now)
        out += self._limits.outbox(now)
        return out

    def next_wakeup(self) -> float | None:
        """When the scheduler next needs handle()/tick() if nothing else happens."""
        times = [self._timers.next_at(self._timer_live), self._active.refill_at(self._now),
                 self._limits.wakeup()]
        return min((t for t in times if t is not None), default=None)

    # ------------------------------------------------------------ events

    def _dispatch(self, event: Event, now: float, out: list[Command]) -> None:
        match event:
            case JobsQueued(jobs=jobs, unrouted=unrouted):
                self._active.routed(sum(len(job.qids) for job in jobs), unrouted)
                for job in jobs:
                    queueing.enqueue(self, job, now, out)
            case EntriesClaimed(count=count, exhausted=exhausted, next_due_at=due):
                self._active.claimed(count, exhausted, due, now)
            case MailArrived():
                self._active.arrived(now)
            case EntriesModified(qids=qids):
                queueing.modified(self, qids)
                self._active.arrived(now)
            case PolicyReloaded(policy=policy):
                bindings.set_policy(self, policy, now)
            case ConditionAdded(counter_id=cid, condition=cond, position=pos):
                policy, cond = self._policy.with_condition(cid, cond, pos)
                if cond.expires_at is not None:
                    self._timers.set(cond.expires_at, Timer.CONDITION, (cid, cond.id))
                bindings.load(self, policy, now)
            case ConditionRemoved(counter_id=cid, condition_id=cond_id):
                bindings.load(self, self._policy.without_condition(cid, cond_id), now)
            case SuspensionAdded(suspension=susp):
                self._add_suspension(susp, now, from_file=False)
            case SuspensionRemoved(suspension_id=sid):
                self._remove_suspension(sid, now)
            case GrantsChanged() | ClusterModeChanged() | ClockTicked():
                for entry in self._limits.handle(event, now):
                    self._lines.release(entry, now)

    # ------------------------------------------------------------ timers

    def _set_slot_timer(self, blocker: Blocker, at: float) -> None:
        if blocker.timer_at is None or at < blocker.timer_at:
            blocker.timer_at = at
            self._timers.set(at, Timer.SLOT, blocker)

    @staticmethod
    def _cancel_slot(timer: Due) -> None:
        timer.obj.timer_at = None

    def _timer_live(self, timer: Due) -> bool:
        match timer.kind:
            case Timer.SLOT:
                return bool(timer.obj.timer_at == timer.at)
            case Timer.SUSPENSION:
                return self._susps.is_due(timer.obj, timer.at)
            case Timer.DEAD:
                return bool(timer.obj.dead_until == timer.at)
        return True

    def _fire(self, timer: Due, now: float) -> None:
        match timer.kind:
            case Timer.SLOT:
                timer.obj.timer_at = None
                self._lines.release(timer.obj, now)
            case Timer.SUSPENSION:
                self._remove_suspension(timer.obj.suspension.id, now)
            case Timer.DEAD:
                self._dests.revive(timer.obj, now)
            case Timer.CONDITION:
                counter_id, cond_id = timer.obj
                try:
                    counter = self._policy.counter(counter_id)
                except KeyError:
                    return
                if any(c.id == cond_id and c.expires_at is not None and c.expires_at <= now
                       for c in counter.conditions):
                    bindings.load(self, self._policy.without_condition(counter_id, cond_id), now)

    # ------------------------------------------------------- suspensions

    def _add_suspension(self, susp: Suspension, now: float, from_file: bool) -> None:
        blocker = self._susps.add(susp, now, from_file)
        if blocker is not None and blocker.suspension.expires_at is not None:
            self._timers.set(blocker.suspension.expires_at, Timer.SUSPENSION, blocker)

    def _remove_suspension(self, sid: str, now: float) -> None:
        blocker = self._susps.remove(sid)
        if blocker is not None:
            self._lines.release(blocker, now)

    def _suspended(self, sq: SubQueue) -> list[Suspended | None]:
        """Per source IP of ``sq``, the suspension that holds it, if any."""
        if sq.susp_version != self._susps.version:
            sq.susp = self._susps.lookup(sq.route, sq.ips)
            sq.susp_version = self._susps.version
        return sq.susp

    # -------------------------------------------------------------- views

    def stats(self) -> QueueStats:
        """Memory and work in numbers (for /metrics)."""
        return observe.stats(self)

    def subqueues(self) -> list[SubQueueView]:
        """Every sub-queue with work: its route, counts, and what holds it."""
        return observe.subqueues(self)

    def counters(self, now: float | None = None) -> list[CounterView]:
        """Counter entries against their thresholds."""
        return observe.counters(self, self._now if now is None else now)

    def suspensions(self, now: float | None = None) -> list[SuspensionView]:
        """Suspensions in force, then automatic ones (entries over a threshold)."""
        return observe.suspensions(self, self._now if now is None else now)

    def uses_id(self, change_id: str) -> bool:
        """Whether a suspension or a counter's condition in force has id ``change_id``."""
        return change_id in self._susps.by_id or any(
            c.id == change_id for counter in self._policy.counters for c in counter.conditions)

    def destinations(self, now: float | None = None) -> list[DestinationView]:
        """Slow-start windows and the status cache, per destination."""
        now = self._now if now is None else now
        return [observe.destination(d, now) for d in self._dests]

    def destination(self, name: str, now: float | None = None) -> DestinationView | None:
        """One destination's view, if the scheduler remembers it."""
        dest = self._dests.by_name.get(name)
        return None if dest is None else observe.destination(
            dest, self._now if now is None else now)

    def tenants(self) -> list[TenantView]:
        """Per tenant with work or a delivery: its share, what waits, what went."""
        return observe.tenants(self)

    def explain(self, qid: str, now: float | None = None) -> Explanation:
        """Why ``qid`` waits, and when it is expected to go."""
        return observe.explain(self, qid, self._now if now is None else now)
