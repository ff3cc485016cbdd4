"""The scheduler's invariants under random traffic, results and operators (hypothesis).

A rule-based state machine plays the runtime: it queues jobs, finishes
deliveries (some fail), moves a fake clock, suspends and lifts, and has
operators take entries away.  After every step it checks, with its own
bookkeeping rather than the scheduler's:

- no counter entry has more in flight than its concurrency threshold (the
  hosts a condition's pattern matches count in one entry);
- no Y-second window holds more than X pickups of a rate-limited entry,
  and pickups of an entry with connectinterval are that far apart;
- no ready job starves while capacity is idle (every waiting sub-queue is
  held by a suspension, a full counter entry, a full or dead destination);
- FIFO inside a sub-queue at one priority;
- a suspended source IP is never used.

Operators also reload the policy while mail flows.  At the end the
machine lifts every suspension and drains the queue: every entry ends
delivered, bounced or held.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sluice.model import Delivered, Reply, TempFail
from sluice.scheduler import (
    Command,
    Counter,
    DeferJob,
    DeliveryFinished,
    DeliveryJob,
    EntriesModified,
    JobsQueued,
    Policy,
    PolicyReloaded,
    Route,
    Scheduler,
    Settings,
    StartDelivery,
    Suspension,
    SuspensionAdded,
    SuspensionRemoved,
    Thresholds,
    parse_policy,
)
from sluice.scheduler.policy import CASELESS_FIELDS, Pattern

pytestmark = pytest.mark.property

OK = Delivered(Reply(250, "2.0.0", "ok"))
FAIL = TempFail(Reply(421, "4.4.1", "connection refused"))
IP1, IP2 = "192.0.2.1", "192.0.2.2"

POLICIES = [
    [{"fields": ["localip"], "concurrency": 3}],
    [{"fields": ["localip", "recipientdomain"],
      "if": {"recipientdomain": "a.example", "concurrency": 1}, "concurrency": 2},
     {"concurrency": 5}],
    [{"fields": [{"remotemx": {"google": ["*.google.com"]}}],
      "if": {"remotemx": "#google", "rate": "3/10"}, "concurrency": 2}],
    [{"fields": ["recipientdomain"], "rate": "2/5", "connectinterval": 1},
     {"fields": ["tenantid"], "concurrency": 2}],
    [{"fields": ["localip", "tenantid"], "concurrency": 1, "rate": "4/20"}],
    [{"fields": ["remotemx"], "if": [{"remotemx": "*.google.com", "concurrency": 1,
                                      "rate": "2/5"},
                                     {"remotemx": "/\\.example$/", "concurrency": 2}],
      "concurrency": 3}],
]

DOMAINS = [("a.example", "mx.a.example"), ("b.example", "mx.b.example"),
           ("gmail.com", "alt1.gmail-smtp-in.l.google.com"),
           ("googlemail.com", "aspmx.l.google.com")]
POOLS = [(), (IP1,), (IP2,), (IP1, IP2)]
SUSPENSIONS = [
    (("localip", IP1),),
    (("localip", IP2), ("recipientdomain", "gmail.com")),
    (("recipientdomain", "b.example"),),
    (("tenantid", "t2"), ("recipientdomain", "a.example")),
]

routes = st.builds(
    lambda d, pool, tenant: Route(d[0], tenantid=tenant, localip=pool, remotemx=d[1]),
    st.sampled_from(DOMAINS), st.sampled_from(POOLS), st.sampled_from(["t1", "t2"]))


def key_of(counter: Counter, route: Route, ip: str) -> tuple[str, ...]:
    """The entry a delivery counts in: its values, or the pattern of the condition it meets."""
    key = [f.component(route.value(f.name, ip)) for f in counter.fields]
    names = counter.field_names
    for cond in counter.conditions:
        pooled = list(key)
        for name, want in cond.match:
            pos = names.index(name)
            if Pattern.is_pattern(want):
                if not Pattern.compile(want).matches(key[pos]):
                    break
                pooled[pos] = want
            elif key[pos] != (want.lower() if name in CASELESS_FIELDS else want):
                break
        else:
            return tuple(pooled)
    return tuple(key)


def suspended(susp: Suspension, route: Route, ip: str) -> bool:
    for name, value in susp.fields:
        have = route.value(name, ip)
        if name in CASELESS_FIELDS:
            have = have.lower()
        if have != value:
            return False
    return True


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.ids = itertools.count(1)
        self.sched = Scheduler()
        self.policy = Policy()
        self.inflight: dict[str, tuple[StartDelivery, float]] = {}
        self.pickups: dict[tuple[str, tuple[str, ...]], list[float]] = defaultdict(list)
        self.fifo: dict[tuple[Route, int], list[str]] = defaultdict(list)
        self.jobs: dict[str, DeliveryJob] = {}
        self.remaining: dict[str, set[str]] = {}  # queued job -> qids still in it
        self.suspensions: dict[str, Suspension] = {}
        self.attempts: dict[str, int] = defaultdict(int)
        self.delivered: set[str] = set()
        self.bounced: set[str] = set()
        self.held: set[str] = set()
        self.all_qids: set[str] = set()
        self.retry: list[tuple[float, DeliveryJob]] = []
        self.reloaded = False

    @initialize(policy=st.sampled_from(POLICIES), initial=st.integers(1, 3),
                capacity=st.integers(2, 8))
    def start(self, policy: list[dict[str, object]], initial: int, capacity: int) -> None:
        self.policy = parse_policy(policy)
        self.sched = Scheduler(Settings(max_deliveries=capacity,
                                        initial_destination_concurrency=initial,
                                        default_destination_concurrency_limit=4,
                                        dead_destination_ttl_s=30), self.policy)

    # -- the runtime's side ------------------------------------------------------

    def apply(self, commands: Sequence[Command]) -> None:
        for cmd in commands:
            if isinstance(cmd, StartDelivery):
                self.on_start(cmd)
            elif isinstance(cmd, DeferJob):
                self.on_defer(cmd)

    def on_start(self, cmd: StartDelivery) -> None:
        job = cmd.job
        route = job.route
        assert cmd.localip in (route.localip or ("",)), "not one of the job's source IPs"
        self.expire_suspensions()
        for susp in self.suspensions.values():
            assert not suspended(susp, route, cmd.localip), \
                f"{cmd.localip} used although {susp.id} is in force"
        line = self.fifo[(route, job.priority)]
        assert line and line[0] == job.ref, f"FIFO broken: {job.ref} before {line[:1]}"
        line.pop(0)
        assert set(cmd.qids) == self.remaining.pop(job.ref)
        for counter in self.policy.counters:
            key = key_of(counter, route, cmd.localip)
            limit = counter.thresholds_for(key)[0].concurrency
            if limit is not None:
                # Checked at each start, so that it holds across reloads too: a
                # reload cannot recall deliveries, but none may start over it.
                same = sum(1 for c, _ in self.inflight.values()
                           if key_of(counter, c.job.route, c.localip) == key)
                assert same < limit, f"{counter.id} {key}: started with {same} of {limit}"
            self.pickups[(counter.id, key)].append(self.now)
        self.inflight[job.ref] = (cmd, self.now)

    def on_defer(self, cmd: DeferJob) -> None:
        line = self.fifo[(cmd.job.route, cmd.job.priority)]
        line.remove(cmd.job.ref)
        assert set(cmd.qids) == self.remaining.pop(cmd.job.ref)
        self.fail(cmd.job, cmd.qids)

    def fail(self, job: DeliveryJob, qids: Sequence[str]) -> None:
        live = tuple(q for q in qids if q not in self.held)
        if not live:
            return
        self.attempts[job.ref] += 1
        if self.attempts[job.ref] >= 3:
            self.bounced.update(live)
            return
        again = DeliveryJob(f"{job.ref}.{self.attempts[job.ref]}", job.spid, live, job.route,
                            job.priority)
        self.attempts[again.ref] = self.attempts[job.ref]
        self.retry.append((self.now + 5, again))

    def queue(self, jobs: Sequence[DeliveryJob]) -> None:
        for job in jobs:
            self.fifo[(job.route, job.priority)].append(job.ref)
            self.jobs[job.ref] = job
            self.remaining[job.ref] = set(job.qids)
        self.apply(self.sched.handle(JobsQueued(tuple(jobs)), self.now))

    # -- rules -------------------------------------------------------------------

    @rule(route=routes, priority=st.integers(0, 1), n=st.integers(1, 4),
          rcpts=st.integers(1, 2))
    def queue_jobs(self, route: Route, priority: int, n: int, rcpts: int) -> None:
        jobs = []
        for _ in range(n):
            i = next(self.ids)
            spid = f"{i:08X}"
            qids = tuple(f"{spid}-{k}" for k in range(rcpts))
            self.all_qids.update(qids)
            jobs.append(DeliveryJob(f"j{i}", spid, qids, route, priority))
        self.queue(jobs)

    @precondition(lambda self: self.inflight)
    @rule(data=st.data(), failed=st.booleans())
    def finish(self, data: st.DataObject, failed: bool) -> None:
        ref = data.draw(st.sampled_from(sorted(self.inflight)))
        cmd, _ = self.inflight.pop(ref)
        outcome = FAIL if failed else OK
        commands = self.sched.handle(DeliveryFinished(
            ref, tuple((q, outcome) for q in cmd.qids), connection_failed=failed,
            localip=cmd.localip), self.now)
        if failed:
            self.fail(cmd.job, cmd.qids)
        else:
            self.delivered.update(cmd.qids)  # delivered wins over an operator's hold
            self.held.difference_update(cmd.qids)
        self.apply(commands)

    @rule(dt=st.sampled_from([0.5, 1.0, 2.5, 5.0, 11.0]))
    def advance(self, dt: float) -> None:
        self.now += dt
        self.apply(self.sched.tick(self.now))
        due = [j for at, j in self.retry if at <= self.now]
        self.retry = [(at, j) for at, j in self.retry if at > self.now]
        if due:
            self.queue(due)

    @rule(fields=st.sampled_from(SUSPENSIONS), ttl=st.sampled_from([None, 3.0, 20.0]))
    def suspend(self, fields: tuple[tuple[str, str], ...], ttl: float | None) -> None:
        susp = Suspension(fields, expires_at=None if ttl is None else self.now + ttl)
        old = self.suspensions.get(susp.id)
        if old is not None:  # the scheduler keeps the old tag/reason, and the new expiry
            susp = Suspension(fields, old.id, susp.expires_at, old.tag, old.reason)
        self.suspensions[susp.id] = susp
        self.apply(self.sched.handle(SuspensionAdded(susp), self.now))

    @precondition(lambda self: self.suspensions)
    @rule(data=st.data())
    def lift(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.suspensions)))
        del self.suspensions[sid]
        self.apply(self.sched.handle(SuspensionRemoved(sid), self.now))

    @rule(policy=st.sampled_from(POLICIES))
    def reload(self, policy: list[dict[str, object]]) -> None:
        new = parse_policy(policy)
        # Counters that keep their id and fields keep their rate windows; new
        # ones start empty (docs/policies.md), so only their history resets.
        kept = {(c.id, c.signature) for c in self.policy.counters} & \
            {(c.id, c.signature) for c in new.counters}
        for key in list(self.pickups):
            cid = key[0]
            if not any(cid == k[0] for k in kept):
                del self.pickups[key]
        self.policy = new
        self.reloaded = True
        self.apply(self.sched.handle(PolicyReloaded(new), self.now))

    @precondition(lambda self: self.remaining or self.inflight)
    @rule(data=st.data())
    def operator_holds(self, data: st.DataObject) -> None:
        pool = sorted({q for qs in self.remaining.values() for q in qs}
                      | {q for cmd, _ in self.inflight.values() for q in cmd.qids})
        qid = data.draw(st.sampled_from(pool))
        self.held.add(qid)
        for ref, qids in list(self.remaining.items()):
            if qid in qids:
                qids.discard(qid)
                if not qids:
                    del self.remaining[ref]
                    job = self.jobs[ref]
                    self.fifo[(job.route, job.priority)].remove(ref)
        self.apply(self.sched.handle(EntriesModified((qid,)), self.now))

    # -- invariants --------------------------------------------------------------

    def expire_suspensions(self) -> None:
        for sid, susp in list(self.suspensions.items()):
            if susp.expires_at is not None and susp.expires_at <= self.now:
                del self.suspensions[sid]

    @invariant()
    def concurrency_never_exceeds_a_threshold(self) -> None:
        if self.reloaded:
            return  # deliveries started under the old policy; on_start checks every start
        counts: dict[tuple[str, tuple[str, ...]], int] = defaultdict(int)
        for cmd, _ in self.inflight.values():
            for counter in self.policy.counters:
                counts[(counter.id, key_of(counter, cmd.job.route, cmd.localip))] += 1
        for (cid, key), n in counts.items():
            limit = self.policy.counter(cid).thresholds_for(key)[0].concurrency
            assert limit is None or n <= limit, f"{cid} {key}: {n} in flight > {limit}"

    @invariant()
    def no_rate_window_holds_more_than_x(self) -> None:
        for (cid, key), times in self.pickups.items():
            thresholds = self.policy.counter(cid).thresholds_for(key)[0]
            if thresholds.rate is not None:
                x, y = thresholds.rate.count, thresholds.rate.per_s
                for a, b in zip(times, times[x:], strict=False):
                    assert b - a >= y, f"{cid} {key}: {x + 1} pickups within {b - a}s < {y}s"
            if thresholds.connectinterval_s:
                for a, b in itertools.pairwise(times):
                    assert b - a >= thresholds.connectinterval_s

    def held_back(self, route: Route) -> bool:
        """Whether the head of a sub-queue of ``route`` may not go now."""
        self.expire_suspensions()
        dest = self.sched.destination(route.destination)
        if dest is not None and (dest.dead or dest.inflight >= int(dest.window)):
            return True
        for ip in route.localip or ("",):
            if any(suspended(s, route, ip) for s in self.suspensions.values()):
                continue
            blocked = False
            for counter in self.policy.counters:
                key = key_of(counter, route, ip)
                in_flight = sum(1 for cmd, _ in self.inflight.values()
                                if key_of(counter, cmd.job.route, cmd.localip) == key)
                times = self.pickups.get((counter.id, key), [])
                if self.entry_full(counter.thresholds_for(key)[0], in_flight, times):
                    blocked = True
                    break
            if not blocked:
                return False
        return True

    def entry_full(self, th: Thresholds, in_flight: int, times: list[float]) -> bool:
        if th.concurrency is not None and in_flight >= th.concurrency:
            return True
        if th.rate is not None:
            recent = sum(1 for t in times if t > self.now - th.rate.per_s)
            if recent >= th.rate.count:
                return True
        return bool(th.connectinterval_s and times
                    and self.now < times[-1] + th.connectinterval_s)

    @invariant()
    def no_ready_job_starves_while_capacity_is_idle(self) -> None:
        if len(self.inflight) >= self.sched.settings.max_deliveries:
            return
        for (route, _), line in self.fifo.items():
            if line:
                assert self.held_back(route), \
                    f"{line[0]} to {route.recipientdomain} could go but waits"

    @invariant()
    def the_scheduler_agrees_on_what_is_queued(self) -> None:
        stats = self.sched.stats()
        assert stats.queued_jobs == len(self.remaining)
        assert stats.inflight_jobs == len(self.inflight)

    def teardown(self) -> None:
        # Lift everything, deliver everything: every entry ends somewhere.
        for sid in list(self.suspensions):
            del self.suspensions[sid]
            self.apply(self.sched.handle(SuspensionRemoved(sid), self.now))
        for _ in range(500):
            if not (self.inflight or self.remaining or self.retry):
                break
            for ref in sorted(self.inflight):
                cmd, _ = self.inflight.pop(ref)
                self.delivered.update(cmd.qids)
                self.held.difference_update(cmd.qids)
                self.apply(self.sched.handle(
                    DeliveryFinished(ref, tuple((q, OK) for q in cmd.qids)), self.now))
            wake = self.sched.next_wakeup()
            self.now = max(self.now + 1, wake if wake is not None else self.now)
            self.advance(0)
        assert not (self.inflight or self.remaining or self.retry), "the queue did not drain"
        ended = self.delivered | self.bounced | self.held
        assert self.all_qids <= ended, f"lost: {sorted(self.all_qids - ended)[:5]}"


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
