"""The scheduler: which delivery goes next, from which source IP, and when.

SUMMARY
    sched = Scheduler(Settings.from_config(cfg), policy, suspensions)
    commands = sched.handle(event, now)      # or handle_all(events, now)
    at = sched.next_wakeup()                 # sleep until then, or an event

DESCRIPTION
    A sans-IO core: it never reads the clock, touches a socket or a file.
    The runtime feeds it events with the current time and carries out the
    commands it returns (events.py lists both).  This class only routes
    them to the parts, each in a file of its own:

        active.py         the active queue: memory in recipients, refills
        subqueues.py      sub-queues of jobs (FIFO), the emptied ones kept
        lines.py          the ring of ready sub-queues, blockers and waiters
        limits.py         the seam: counter entries checked and counted
          limits_grouped.py    (the fast one)  limits_reference.py (plain)
        suspensions.py    suspensions, indexed by the fields they name
        destinations.py   slow start, cohort failure, the status cache
        timers.py         rate windows, intervals, expiries, revivals
        observe.py        the views and explanations, on request

    One step (handle_all): fire the timers that are due, apply the events
    in order (results first release what they held), then pick: visit
    sub-queues in turn -- woken ones first, priority 1 before 0 -- until
    max_deliveries are in flight or none is ready; each visit starts the
    head job from a source IP that nothing holds, or parks the sub-queue
    on what holds it.  Last, ask for a refill if there is room.

STRATEGIES
    Round robin over sub-queues, FIFO inside one, parking instead of
    scanning (lines.py); the limits seam (limits.py); slow start and the
    destination status cache (destinations.py); a bounded active queue
    (active.py).  Source IP pools (Halon): a job may use any of its
    route's source IPs; they are tried in turn from where the sub-queue's
    last pickup left off, and a suspended or held IP is skipped.

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

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from sluice.model import Reply, TempFail
from sluice.scheduler import observe
from sluice.scheduler.active import ActiveQueue
from sluice.scheduler.destinations import Destination, Destinations
from sluice.scheduler.events import (
    ClockTicked,
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
    PolicyReloaded,
    StartDelivery,
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
                            self._needs if s.shares.any_min_share else None)
        self._susps = Suspensions()
        self._dests = Destinations(s)
        self._queues = SubQueues(s.destination_cache_size + s.maxmemoryqueue, self._forget)
        self._active = ActiveQueue(s)
        self._qids: dict[str, Job | Flight] = {}
        self._flights: dict[str, Flight] = {}
        self._policy = Policy()
        self._version = 0  # of the policy: sub-queues bound under another bind again
        self._pickups = 0
        # Per tenant: deliveries in flight and started (for shares and /metrics).
        self._tenant_inflight: dict[str, int] = {}
        self._tenant_pickups: dict[str, int] = {}
        self._set_policy(policy or Policy(), now)
        for susp in suspensions:
            self._add_suspension(susp, now, from_file=False)

    # ------------------------------------------------------------------ API

    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def pickups(self) -> int:
        """Deliveries started so far (a statistic)."""
        return self._pickups

    @property
    def now(self) -> float:
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
        self._check(event)

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
        finished: set[str] = set()
        for event in events:  # refuse misuse before anything changes
            if type(event) is DeliveryFinished:
                flight = self._flights.get(event.ref)
                if flight is None or event.ref in finished:
                    raise ValueError(f"no delivery {event.ref} in flight")
                if event.localip and event.localip != flight.ip:
                    raise ValueError(f"delivery {event.ref} was started from {flight.ip!r}, "
                                     f"not {event.localip!r}")
                finished.add(event.ref)
            else:
                self._check(event)
        self._now = now
        out: list[Command] = []
        for timer in self._timers.due(now, self._timer_live):
            self._fire(timer, now)
        lines = self._lines
        for event in events:
            if type(event) is DeliveryFinished:
                self._finish(event, now, out)
            else:
                lines.release_dirty(now)  # in the order things happened
                self._dispatch(event, now, out)
        lines.release_dirty(now)
        self._select(now, out)
        refill = self._active.refill(now)
        if refill is not None:
            out.append(refill)
        self._limits.collect(now)
        return out

    def next_wakeup(self) -> float | None:
        """When the scheduler next needs handle()/tick() if nothing else happens."""
        at_timer = self._timers.next_at(self._timer_live)
        at_refill = self._active.refill_at(self._now)
        if at_timer is None or at_refill is None:
            return at_refill if at_timer is None else at_timer
        return min(at_timer, at_refill)

    # ------------------------------------------------------------ events

    def _check(self, event: Event) -> None:
        match event:
            case JobsQueued(jobs=jobs):
                seen: set[str] = set()
                refs: set[str] = set()
                for job in jobs:
                    if job.ref in self._flights or job.ref in refs:
                        raise ValueError(f"job {job.ref} is already known")
                    refs.add(job.ref)
                    for qid in job.qids:
                        if qid in self._qids or qid in seen:
                            raise ValueError(f"recipient {qid} is queued twice")
                        seen.add(qid)
            case EntriesClaimed(count=count):
                self._active.check_claim(count)
            case ConditionAdded(counter_id=cid, condition=cond):
                try:
                    counter = self._policy.counter(cid)
                except KeyError:
                    raise ValueError(f"no counter {cid!r} in the policy") from None
                for name, _ in cond.match:
                    if name not in counter.field_names:
                        raise ValueError(f"counter {cid} does not count {name!r}")
            case ConditionRemoved(counter_id=cid, condition_id=cond_id):
                if cid not in {c.id for c in self._policy.counters}:
                    raise ValueError(f"no counter {cid!r} in the policy")
                if not cond_id:  # "" would match every condition without an id
                    raise ValueError("name the condition to remove by its id")
            case SuspensionAdded(suspension=susp):
                self._susps.check(susp)
            case _:
                pass

    def _dispatch(self, event: Event, now: float, out: list[Command]) -> None:
        match event:
            case JobsQueued(jobs=jobs, unrouted=unrouted):
                self._active.routed(sum(len(job.qids) for job in jobs), unrouted)
                for job in jobs:
                    self._enqueue(job, now, out)
            case EntriesClaimed(count=count, exhausted=exhausted, next_due_at=due):
                self._active.claimed(count, exhausted, due, now)
            case MailArrived():
                self._active.arrived(now)
            case EntriesModified(qids=qids):
                self._modified(qids)
                self._active.arrived(now)
            case PolicyReloaded(policy=policy):
                self._set_policy(policy, now)
            case ConditionAdded(counter_id=cid, condition=cond, position=pos):
                policy, cond = self._policy.with_condition(cid, cond, pos)
                if cond.expires_at is not None:
                    self._timers.set(cond.expires_at, Timer.CONDITION, (cid, cond.id))
                self._load(policy, now)
            case ConditionRemoved(counter_id=cid, condition_id=cond_id):
                self._load(self._policy.without_condition(cid, cond_id), now)
            case SuspensionAdded(suspension=susp):
                self._add_suspension(susp, now, from_file=False)
            case SuspensionRemoved(suspension_id=sid):
                self._remove_suspension(sid, now)
            case ClockTicked():
                pass

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
                    self._load(self._policy.without_condition(counter_id, cond_id), now)

    # ------------------------------------------------------------ policy

    def _set_policy(self, policy: Policy, now: float) -> None:
        """A policy file: its counters, and its suspensions replace the file's
        old ones (run-time suspensions stay)."""
        file_ids = {s.id for s in policy.suspensions}
        for sid, blocker in list(self._susps.by_id.items()):
            if blocker.from_file and sid not in file_ids:
                self._remove_suspension(sid, now)
        for susp in policy.suspensions:
            self._add_suspension(susp, now, from_file=True)
        for counter in policy.counters:
            for cond in counter.conditions:
                if cond.expires_at is not None:
                    self._timers.set(cond.expires_at, Timer.CONDITION, (counter.id, cond.id))
        self._load(policy, now)

    def _load(self, policy: Policy, now: float) -> None:
        """Counters changed: bind everything again and look at every sub-queue.

        O(sub-queues + deliveries): an operator action, not a pickup.
        """
        self._policy = policy
        limits = self._limits
        self._timers.cancel(Timer.SLOT, self._cancel_slot)  # old entries' windows
        limits.load(policy, now)
        self._version += 1
        self._dests.policy_changed()
        for blocker in (*self._dests, *self._susps):
            blocker.waiters = None
            blocker.pending = 0
        for flight in self._flights.values():
            binding = limits.bind(flight.job.route, flight.ip)
            limits.recount(binding)
            limits.unbind(binding)  # the flight counts in it; the sub-queue uses it
            flight.binding = binding
        lines = self._lines
        for queue in (*lines.woken, *lines.ring):
            for sq in queue:
                sq.woken_by = None
        lines.dirty.clear()
        for sq in self._queues:
            sq.parked_on = ()
            sq.woken_by = None
            self._bind(sq)
            if sq.live:
                lines.ready(sq)

    def _bind(self, sq: SubQueue) -> None:
        """Bind a sub-queue's source IPs to their counter entries."""
        limits = self._limits
        for binding in sq.bindings:
            limits.unbind(binding)
        sq.bindings = [limits.bind(sq.route, ip) for ip in sq.ips]
        sq.version = self._version
        for ip, binding in zip(sq.ips, sq.bindings, strict=True):
            self._dests.limit_from(sq.dest, ip, binding.destination_limit)

    def _forget(self, sq: SubQueue) -> None:
        """An emptied sub-queue is dropped: it no longer uses its bindings."""
        for binding in sq.bindings:
            self._limits.unbind(binding)
        sq.bindings = []
        sq.version = -1
        self._dests.forget(sq.dest, self._now)

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

    # ----------------------------------------------------------- queueing

    def _enqueue(self, job: DeliveryJob, now: float, out: list[Command]) -> None:
        route = job.route
        sq = self._queues.get(route, job.priority)
        dest = sq.dest if sq is not None else self._dests.get(route.destination)
        if dest.is_dead(now):
            out.append(DeferJob(job, job.qids, dest.dead_reply, dest.dead_until))
            if sq is None:
                self._dests.forget(dest, now)
            return
        if sq is None:
            sq = SubQueue(route, job.priority, dest)
            self._bind(sq)
            self._queues.add(sq)
        elif sq.version != self._version:
            self._bind(sq)
        rec = Job(job, sq, now)
        sq.jobs.append(rec)
        sq.live += 1
        for qid in job.qids:
            self._qids[qid] = rec
        self._active.queued += len(job.qids)
        self._lines.ready(sq)

    def _retire(self, sq: SubQueue) -> None:
        if sq.parked_on:
            self._lines.unpark(sq)
        self._queues.retire(sq)

    def _modified(self, qids: Sequence[str]) -> None:
        for qid in qids:
            rec = self._qids.get(qid)
            if not isinstance(rec, Job):
                continue  # unknown, or in flight: the store lets the operator win
            del self._qids[qid]
            self._active.queued -= 1
            rec.qids = tuple(q for q in rec.qids if q != qid)
            if not rec.qids:
                rec.sq.drop(rec)
                if not rec.sq.live:
                    self._retire(rec.sq)

    def _defer_all(self, sq: SubQueue, dest: Destination, out: list[Command]) -> None:
        """``dest`` is dead: every job of ``sq`` is deferred without a connection."""
        for rec in sq.jobs:
            if rec.dropped:
                continue
            out.append(DeferJob(rec.job, rec.qids, dest.dead_reply, dest.dead_until))
            for qid in rec.qids:
                del self._qids[qid]
            self._active.queued -= len(rec.qids)
        sq.live = 0
        self._retire(sq)

    # ------------------------------------------------------------ pickup

    def _select(self, now: float, out: list[Command]) -> None:
        limit = self.settings.max_deliveries
        lines = self._lines
        short = self._short_of_capacity if self._shares.any_min_share else None
        while len(self._flights) < limit:
            sq = lines.next(short)
            if sq is None:
                return
            woken = sq.woken_by
            if woken is None:
                self._visit(sq, now, out, None)
                continue
            sq.woken_by = None
            woken.pending -= 1
            if not self._visit(sq, now, out, woken):
                # The slot it was woken for may be free still: the next in line
                # (unless it went back into that line: releasing would find no room).
                lines.release(woken, now)

    def _visit(self, sq: SubQueue, now: float, out: list[Command],
               woken: Blocker | None) -> bool:
        """Start the head of ``sq`` from a source IP nothing holds, or park it.

        True: it took the slot ``woken`` promised and went back into that
        blocker's line.
        """
        sq.head()
        if not sq.live or sq.parked_on:
            return False  # a stale ring entry: retired, or parked meanwhile
        if sq.version != self._version:
            self._bind(sq)
        dest = sq.dest
        if dest.is_dead(now):
            self._defer_all(sq, dest, out)
            return False
        if dest.inflight >= dest.limit:
            self._lines.park(sq, [dest], woken, now)
            return False
        susps = self._suspended(sq)
        n = len(sq.ips)
        blockers: list[Blocker] = []
        for k in range(n):
            i = (sq.rr + k) % n
            held: Blocker | None = susps[i]
            if held is None:
                held = self._limits.holder(sq.bindings[i], now)
            if held is None:
                sq.rr = (i + 1) % n
                self._start(sq, i, now, out)
                return self._requeue(sq, woken, now)
            if held not in blockers:
                blockers.append(held)
        self._lines.park(sq, blockers, woken, now)
        return False

    def _requeue(self, sq: SubQueue, woken: Blocker | None, now: float) -> bool:
        """After a pickup: the sub-queue goes to the back of the ring -- or of
        the line of the blocker that woke it, if that one has no other room
        (not for a pool of source IPs, whose next delivery may leave from
        another IP, unless the blocker is the destination they share)."""
        if not sq.live:
            self._retire(sq)
            return False
        if (woken is not None and (not sq.pool or woken is sq.dest)
                and self._lines.requeue(sq, woken, now)):
            return True
        self._lines.ready(sq)
        return False

    def _start(self, sq: SubQueue, i: int, now: float, out: list[Command]) -> None:
        rec = sq.jobs.popleft()
        sq.live -= 1
        ip, binding = sq.ips[i], sq.bindings[i]
        self._limits.record(binding, now)
        tenant = sq.tenant
        Destinations.started(sq.dest, tenant)
        self._tenant_inflight[tenant] = self._tenant_inflight.get(tenant, 0) + 1
        self._tenant_pickups[tenant] = self._tenant_pickups.get(tenant, 0) + 1
        job, qids = rec.job, rec.qids
        flight = Flight(job, qids, ip, binding, sq.dest, tenant, now)
        self._flights[job.ref] = flight
        for qid in qids:
            self._qids[qid] = flight
        self._active.queued -= len(qids)
        self._active.inflight += len(qids)
        self._pickups += 1
        out.append(StartDelivery(job, ip, qids))

    # ------------------------------------------------------------ results

    def _finish(self, event: DeliveryFinished, now: float, out: list[Command]) -> None:
        flight = self._flights.pop(event.ref)
        for qid in flight.qids:
            if self._qids.get(qid) is flight:
                del self._qids[qid]
        self._active.inflight -= len(flight.qids)
        dirty = self._lines.dirty
        for entry in self._limits.release(flight.binding, now):
            dirty[entry] = None  # released once the batch of results is in
        dest = flight.dest
        reply: Reply | None = None
        if event.connection_failed:
            reply = next((o.reply for _, o in event.outcomes if isinstance(o, TempFail)), None)
        tenant = flight.tenant
        n = self._tenant_inflight[tenant] - 1
        if n:
            self._tenant_inflight[tenant] = n
        else:
            del self._tenant_inflight[tenant]
        if self._dests.finished(dest, tenant, event.connection_failed, reply, now):
            self._timers.set(dest.dead_until, Timer.DEAD, dest)
            for sq in list(dest.subqueues):
                if sq.live:
                    self._defer_all(sq, dest, out)
        if dest.waiters is not None:
            dirty[dest] = None
        if not dest.inflight and not dest.subqueues:
            self._dests.forget(dest, now)

    # ------------------------------------------------------------ shares

    def _short_of_capacity(self, tenant: str) -> bool:
        """Whether ``tenant`` holds less than its minimum share of max_deliveries."""
        reserved = self._shares.reserved(tenant, self.settings.max_deliveries)
        return reserved > self._tenant_inflight.get(tenant, 0)

    def _needs(self, blocker: Blocker) -> Callable[[str], int] | None:
        """For a destination, the slots each tenant lacks of its minimum share."""
        if not isinstance(blocker, Destination):
            return None
        shares = self._shares

        def needs(tenant: str) -> int:
            held = blocker.by_tenant.get(tenant, 0)
            return shares.reserved(tenant, blocker.limit) - held

        return needs

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
